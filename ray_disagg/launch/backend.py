"""Ray Train backends of the module groups.

Like Ray Train's ``TorchConfig``/``TorchBackend`` (which they extend), each sets up the
group's own default ``torch.distributed`` process group (gloo on CPU, NCCL on GPU); in
addition they build the group's named device mesh on every worker.
"""

from __future__ import annotations

from dataclasses import dataclass

from ray_disagg.launch.ray_compat import (
    TorchBackend,
    TorchConfig,
    quiet_data_progress,
    quiet_train_reports,
)
from ray_disagg.worker import runtime

__all__ = ["ModuleBackendConfig"]


@dataclass(kw_only=True)
class ModuleBackendConfig(TorchConfig):
    """``TorchConfig`` plus the group's device mesh (``mesh_shape`` over ``mesh_axes``).

    Example:
        >>> cfg = ModuleBackendConfig(module="vision", mesh_shape=(2, 2), mesh_axes=("dp", "sp"))
        >>> cfg.world_size
        4
    """

    module: str = "module"
    """Name of the module group (a part of the model: ``"vision"``, ``"audio"``, ``"text"``)."""

    mesh_shape: tuple[int, ...] = (1, 1)
    """Sizes of the mesh axes; their product is the group's number of workers."""

    mesh_axes: tuple[str, ...] = ("dp", "mp")
    """Names of the mesh axes, fetched by name (``mesh["dp"]``)."""

    verbose: bool = False
    """Keep Ray Train's log line of every report in the workers (dropped by default: the
    driver prints each step, ``ray_disagg.launch.progress``) and Ray Data's progress bars
    of the datasets they read (off by default)."""

    def __post_init__(self) -> None:
        self.mesh_shape = tuple(int(s) for s in self.mesh_shape)
        if len(self.mesh_shape) != len(self.mesh_axes):
            raise ValueError(f"mesh_shape {self.mesh_shape} does not match axes {self.mesh_axes}.")
        if any(s < 1 for s in self.mesh_shape):
            raise ValueError(f"mesh_shape {self.mesh_shape} must be positive.")

    @property
    def world_size(self) -> int:
        n = 1
        for s in self.mesh_shape:
            n *= s
        return n

    @property
    def backend_cls(self):
        return _ModuleBackend


class _ModuleBackend(TorchBackend):
    # Backend is a per-process singleton: all per-group state lives in backend_config.

    def on_start(self, worker_group, backend_config: ModuleBackendConfig):
        if len(worker_group) != backend_config.world_size:
            raise ValueError(
                f"{backend_config.module} group has {len(worker_group)} workers but its mesh "
                f"{dict(zip(backend_config.mesh_axes, backend_config.mesh_shape))} needs "
                f"{backend_config.world_size}."
            )
        super().on_start(worker_group, backend_config)
        if not backend_config.verbose:
            worker_group.execute(quiet_train_reports)
            worker_group.execute(quiet_data_progress)
        worker_group.execute(
            runtime.init_runtime,
            backend_config.module,
            backend_config.mesh_shape,
            backend_config.mesh_axes,
            backend_config.timeout_s,
        )
