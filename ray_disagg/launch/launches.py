"""What the coordinator starts: each group's launch (built on the driver), every group's
launch at one set of sizes, the exchanging pairs, the colocated placement."""

from __future__ import annotations

from dataclasses import dataclass

from ray.train import ScalingConfig

from ray_disagg.launch.ray_compat import ObjectRefWrapper

__all__ = ["Colocation", "GroupLaunch", "Launch", "Transfers"]


@dataclass
class GroupLaunch:
    """What the coordinator needs to start one module group (built on the driver)."""

    name: str
    scaling_config: ScalingConfig
    backend_config: object
    train_fn_ref: ObjectRefWrapper
    standby_fn_ref: ObjectRefWrapper | None = None
    """The train function of the group's standby workers (``ModuleGroup(standby=True)``:
    ``ray_disagg.launch.recovery.standby``), else ``None``."""


@dataclass(frozen=True)
class Colocation:
    """One placement group for all groups: ``num_bundles`` bundles of ``bundle`` (the sum
    of one worker of each group), placed with ``strategy`` (built on the driver)."""

    bundle: dict
    num_bundles: int
    strategy: str


@dataclass(frozen=True)
class Transfers:
    """Which workers exchange tensors (``(group, rank)`` pairs, from the batch plan) and
    the requested tier (``"auto"`` or a tier name)."""

    pairs: tuple
    requested: str = "auto"


@dataclass(frozen=True)
class Launch:
    """Starting every group at one set of sizes: each group's ``GroupLaunch`` (LLM group
    first) and the ``Transfers`` (exchanging pairs) of that layout."""

    groups: dict
    transfers: object
