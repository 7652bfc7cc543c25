"""The environment variable that arms a fault drill (``ray_disagg.testing.faults``).

Its own module so that the driver, the workers' hook (``ray_disagg.worker.faults_hook``)
and the test machinery share the name without importing one another."""

FAULT_DRILL_ENV = "RAY_DISAGG_FAULT_DRILL"
