"""One Ray Train ``WorkerGroup`` per module, presented to the controller as one group.

Ray Train's ``TrainController`` drives exactly one worker group. ``ModuleWorkerGroups``
owns a real ``WorkerGroup`` per module (own placement group, resources, backend and
default process group) and exposes the few methods the controller calls, so Ray Train's
own state machine, failure policy and checkpoint manager run unchanged:

- poll: the union of every group's worker statuses (in group order), so a
  report is consolidated, and a checkpoint registered, only when every worker of every
  group has reported it;
- shutdown/abort: all groups together, so no peer stays blocked in a cross-group recv.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import ray
from ray.train import ScalingConfig

from ray_disagg._internal import runtime
from ray_disagg._internal.ray_compat import (
    AcceleratorSetupCallback,
    BackendSetupCallback,
    ObjectRefWrapper,
    PreemptionCallback,
    ReportCallbackHandler,
    TrainRunContext,
    UserCallbackHandler,
    WorkerGroup,
    WorkerGroupContext,
    WorkerGroupPollStatus,
    group_train_run_context,
)
from ray_disagg._internal.side_group import SideGroupSpec

logger = logging.getLogger(__name__)

# Callbacks that consume the consolidated poll status of all workers.
_UNION_CALLBACKS = (ReportCallbackHandler, UserCallbackHandler)
# The preemption watcher assumes one group's rank numbering; not supported across groups.
_DROPPED_CALLBACKS = (PreemptionCallback,)


@dataclass
class GroupLaunch:
    """What the coordinator needs to start one module group (built on the driver)."""

    name: str
    scaling_config: ScalingConfig
    backend_config: object
    train_fn_ref: ObjectRefWrapper


@dataclass(frozen=True)
class ModulePollStatus(WorkerGroupPollStatus):
    """Poll status whose error text names the module group and its rank."""

    labels: dict[int, str] = field(default_factory=dict)

    def get_error_string(self) -> str:
        lines = []
        for idx, status in self.worker_statuses.items():
            if status.error is not None:
                text = str(status.error)
                if len(text) > 2000:
                    text = text[:1000] + "\n...\n" + text[-1000:]
                lines.append(f"[{self.labels.get(idx, idx)} failed]:\n{text}")
        return "\n".join(lines)


class ModuleWorkerGroups:
    """The module groups of one run attempt (see module docstring)."""

    def __init__(self, groups: dict[str, WorkerGroup], union_callbacks: list):
        self._groups = groups
        self._union_callbacks = union_callbacks
        self._latest_poll_status = None
        self._labels = {}
        idx = 0
        for name, wg in groups.items():
            for r in range(len(wg.get_workers())):
                self._labels[idx] = f"{name} group rank {r}"
                idx += 1

    @classmethod
    def create(
        cls,
        *,
        launches: dict[str, GroupLaunch],
        train_run_context: TrainRunContext,
        run_attempt_id: str,
        callbacks: list,
        side_timeout_s: float,
        janitor=None,
    ) -> ModuleWorkerGroups:
        union = [c for c in callbacks if isinstance(c, _UNION_CALLBACKS)]
        shared = [
            c
            for c in callbacks
            if not isinstance(c, _UNION_CALLBACKS) and not isinstance(c, _DROPPED_CALLBACKS)
        ]
        started: dict[str, WorkerGroup] = {}
        try:
            for name, launch in launches.items():
                started[name] = cls._start_group(launch, train_run_context, run_attempt_id, shared)
                if janitor is not None:  # removes it should the coordinator die
                    state = started[name].get_worker_group_state()
                    ray.get(janitor.register.remote(state.placement_group_handle.placement_group))
            groups = cls(started, union)
            groups._connect_side_group(run_attempt_id, side_timeout_s)
        except BaseException:
            for wg in started.values():
                try:
                    wg.shutdown()
                except Exception:
                    logger.warning("Shutting down a partially started group failed.", exc_info=True)
            raise
        for cb in union:
            cb.after_worker_group_start(groups)
        return groups

    @staticmethod
    def _start_group(launch: GroupLaunch, base_ctx, run_attempt_id, shared) -> WorkerGroup:
        sc = launch.scaling_config
        ctx = group_train_run_context(base_ctx, sc, launch.backend_config)
        wg_ctx = WorkerGroupContext(
            run_attempt_id=run_attempt_id,
            train_fn_ref=launch.train_fn_ref,
            num_workers=sc.num_workers,
            resources_per_worker=sc._resources_per_worker_not_none,
            placement_strategy=sc.placement_strategy,
            label_selector=sc._label_selector_per_worker(sc.num_workers),
        )
        own = [
            AcceleratorSetupCallback(launch.backend_config, sc),
            BackendSetupCallback(launch.backend_config),
        ]
        logger.info("Starting %s group: %d workers", launch.name, sc.num_workers)
        return WorkerGroup.create(
            train_run_context=ctx, worker_group_context=wg_ctx, callbacks=own + shared
        )

    def _connect_side_group(self, run_attempt_id: str, timeout_s: float) -> None:
        host = next(iter(self._groups.values())).get_workers()[0]
        addr, port = ray.get(host.execute_async(runtime.host_side_store, timeout_s))
        offsets, sizes, off = {}, {}, 0
        for name, wg in self._groups.items():
            offsets[name], sizes[name] = off, len(wg.get_workers())
            off += sizes[name]
        spec = SideGroupSpec(addr, port, offsets, sizes, timeout_s, f"side/{run_attempt_id}")
        refs = [
            w.execute_async(runtime.join_side_group, spec, name, w.distributed_context.world_rank)
            for name, wg in self._groups.items()
            for w in wg.get_workers()
        ]
        ray.get(refs, timeout=timeout_s)

    # ---- what TrainController calls -------------------------------------------------

    def __len__(self) -> int:
        return len(self._labels)

    def has_started(self) -> bool:
        return all(wg.has_started() for wg in self._groups.values())

    def get_workers(self):
        return [w for wg in self._groups.values() for w in wg.get_workers()]

    def get_worker_group_state(self):
        return next(iter(self._groups.values())).get_worker_group_state()

    def get_latest_poll_status(self):
        return self._latest_poll_status

    def set_required_barrier_ranks(self, ranks) -> bool:
        return False

    def poll_status(self, timeout: float | None = None) -> ModulePollStatus:
        statuses, idx = {}, 0
        for wg in self._groups.values():
            for status in wg.poll_status(timeout=timeout).worker_statuses.values():
                statuses[idx] = status
                idx += 1
        result = ModulePollStatus(worker_statuses=statuses, labels=self._labels)
        for cb in self._union_callbacks:
            cb.after_worker_group_poll_status(result)
        self._latest_poll_status = result
        return result

    def shutdown(self) -> None:
        for cb in self._union_callbacks:
            cb.before_worker_group_shutdown(self)
        errors = []
        for wg in self._groups.values():
            try:
                wg.shutdown()
            except Exception as e:  # shut the other groups down regardless
                errors.append(e)
        if errors:
            raise errors[0]

    def abort(self) -> None:
        for wg in self._groups.values():
            try:
                wg.abort()
            except Exception:
                logger.warning("Aborting a module group failed.", exc_info=True)
