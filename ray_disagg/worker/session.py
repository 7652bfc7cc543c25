"""What a worker asks of whatever runs it: its device, where it is, the driver's objects,
reporting metrics and checkpoints, the checkpoint to restart from.

Under ``DisaggregatedTrainer`` that is Ray Train (:class:`RaySession`, the default).
The tests' Ray-free runner (``ray_disagg.testing.local``) installs its own session in
each of its processes, so the same loops run on plain gloo process groups. One session
per process, like the worker runtime.
"""

from __future__ import annotations

import torch


class RaySession:
    """A worker started by Ray Train."""

    def device(self) -> torch.device:
        import ray.train.torch

        return ray.train.torch.get_device()

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def placement(self) -> tuple[str | None, int | None]:
        from ray_disagg.launch.ray_compat import current_placement

        return current_placement()

    def fetch(self, ref):
        """The object behind ``ref`` (an ``ObjectRef`` put by the driver)."""
        import ray

        return ray.get(ref)

    def run_tasks(self, fn, calls: list[tuple], timeout_s: float) -> list:
        """``[fn(*args) for args in calls]``, each a Ray task (one CPU) on the cluster;
        ``TimeoutError`` when they have not all finished within ``timeout_s`` (e.g. no
        free CPU for them)."""
        import ray

        task = ray.remote(num_cpus=1, max_retries=0)(fn)
        refs = [task.remote(*args) for args in calls]
        try:
            return ray.get(refs, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            for ref in refs:
                ray.cancel(ref, force=True)
            raise TimeoutError(
                f"{len(refs)} Ray tasks did not finish within {timeout_s:.0f}s"
            ) from None
        except ray.exceptions.RayTaskError as e:
            raise e.as_instanceof_cause() from None

    def report(
        self,
        metrics: dict,
        checkpoint_dir: str | None = None,
        name: str | None = None,
        async_upload: bool = False,
    ):
        """``ray.train.report`` (every rank; with ``checkpoint_dir`` every rank uploads its
        files into the run's directory ``name``; ``async_upload``: in the background, then
        ``checkpoint_dir`` is deleted)."""
        import ray.train

        if checkpoint_dir is None:
            ray.train.report(metrics)
            return
        kwargs = {}
        if async_upload:
            kwargs = {
                "checkpoint_upload_mode": ray.train.CheckpointUploadMode.ASYNC,
                "delete_local_checkpoint_after_upload": True,
                "checkpoint_upload_fn": _move_or_copy,
            }
        ray.train.report(
            metrics,
            checkpoint=ray.train.Checkpoint.from_directory(checkpoint_dir),
            checkpoint_dir_name=name,
            **kwargs,
        )

    def wait_reports(self, timeout_s: float) -> None:
        """Until every report of this worker is queued for the controller (asynchronous
        uploads queue theirs when done, in order)."""
        from ray_disagg.launch.ray_compat import wait_reports_queued

        wait_reports_queued(timeout_s)

    def restart_checkpoint(self):
        """The latest checkpoint of this run when the workers were restarted (a standby
        worker: the one it was handed when taking over), else ``None``."""
        import ray.train

        if self.taken_over_at is not None:
            return self.taken_over_at
        return ray.train.get_checkpoint()

    taken_over_at = None
    """A standby worker's checkpoint to continue from (``ray_disagg.worker.standby``)."""


def _move_or_copy(checkpoint, name: str):
    """Ray Train's upload of ``checkpoint`` into the run's ``name``: on local (or mounted)
    storage every file is moved into place, not copied (a checkpoint of a large model
    is written once); on other filesystems Ray Train's own copy."""
    import os
    import shutil

    import pyarrow.fs
    import ray.train

    from ray_disagg.launch import ray_compat as rc

    filesystem = rc.storage_filesystem()
    if not isinstance(filesystem, pyarrow.fs.LocalFileSystem):
        return rc.persist_checkpoint(checkpoint, name)
    dest = rc.checkpoint_path(name)
    for root, _, files in os.walk(checkpoint.path):
        out = os.path.join(dest, os.path.relpath(root, checkpoint.path))
        os.makedirs(out, exist_ok=True)
        for f in files:  # every rank adds its own files, as Ray Train's copy merges them
            shutil.move(os.path.join(root, f), os.path.join(out, f))  # a rename when it can
    return ray.train.Checkpoint(dest, filesystem=filesystem)


_session = RaySession()


def get_session():
    return _session


def set_session(session) -> None:
    """Install this process's session (the local runner does, before the loop starts)."""
    global _session
    _session = session
