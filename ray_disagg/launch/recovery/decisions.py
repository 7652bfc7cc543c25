"""What the coordinator's policies decide (data only): the controller executes it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["RestartGroup"]


@dataclass(frozen=True)
class RestartGroup:
    """Restart group ``name`` alone and continue every group from ``checkpoint`` (the
    other groups keep their workers)."""

    name: str
    checkpoint: Any
    """The registered checkpoint every group continues from."""
    launch: Any = None
    """Every group's ``Launch`` at the sizes to continue with, or a function giving it once
    the group stopped (an elastic group's size after a failure); ``None``: the same."""
    failure: bool = True
    """A worker failed (counted in ``<group>_restarts``); ``False``: a resize."""
    old: int | None = None
    """A resize: the group's size before."""
