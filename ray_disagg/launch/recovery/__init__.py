"""What the coordinator does when a worker fails or the cluster changes (all of it runs
in the coordinator, the driver-side actor; the workers' side is
:mod:`ray_disagg.worker.recovery` and :mod:`ray_disagg.worker.standby`):

- :mod:`~ray_disagg.launch.recovery.policies`: the run's failure policy and the group
  restart policy (Ray Train V2's shape: a policy returns a decision,
  :mod:`~ray_disagg.launch.recovery.decisions`, the controller executes it);
- :mod:`~ray_disagg.launch.recovery.restart`: restarting one group alone, the sequence;
- :mod:`~ray_disagg.launch.recovery.survivors`: which groups may restart alone, and the
  calls that stop the surviving groups' transfers and park them meanwhile;
- :mod:`~ray_disagg.launch.recovery.standby`: a group's standby copy, taking its place;
- :mod:`~ray_disagg.launch.recovery.elastic`: elastic groups' sizes (checked on the
  driver) and their policy (start, shrink after a loss, grow).
"""
