"""The run's placement groups, named for the run, so that the driver removes whatever a run
reserved however it ended.

Every placement group a run's coordinator creates (each group's, a colocated run's shared
one, an elastic probe's) is named ``ray_disagg:<run id>:<what>:<suffix>``. A placement group
outlives the actor that created it (its lifetime is the job's), so a coordinator killed
while it starts a group would leave that group's reservation behind until the driver exits.
The driver's :func:`release` removes every placement group still reserved under the run's
name, at the end of ``fit()`` however it ends: nothing has to be registered first, so there
is no window in which a reservation exists that the driver does not know of.

Example:
    >>> name = reservation_name("0123abcd", "vision")
    >>> name.startswith("ray_disagg:0123abcd:vision:")
    True
    >>> run_of(name), run_of("someone-elses")
    ('0123abcd', None)
"""

from __future__ import annotations

import logging
import uuid

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)

logger = logging.getLogger(__name__)

__all__ = ["PREFIX", "release", "reservation_name", "reserve", "reserved", "run_of"]

PREFIX = "ray_disagg"
"""The first part of every placement group name a run gives."""


def reservation_name(run_id: str, what: str) -> str:
    """A new placement group name of run ``run_id`` (unique: Ray refuses a name in use)."""
    return f"{PREFIX}:{run_id}:{what}:{uuid.uuid4().hex[:8]}"


def run_of(name: str) -> str | None:
    """The run id in a placement group name of :func:`reservation_name`, else ``None``."""
    parts = name.split(":", 2)
    return parts[1] if len(parts) == 3 and parts[0] == PREFIX else None


def reserve(bundles: list[dict], strategy: str, run_id: str, what: str) -> PlacementGroup:
    """A placement group of run ``run_id`` (``what``: whose, in its name)."""
    return placement_group(bundles, strategy=strategy, name=reservation_name(run_id, what))


def reserved(run_id: str) -> dict[str, str]:
    """Name -> id of every placement group of run ``run_id`` not yet removed."""
    return {
        pg["name"]: pg_id
        for pg_id, pg in placement_group_table().items()
        if run_of(pg["name"]) == run_id and pg["state"] != "REMOVED"
    }


def release(run_id: str) -> list[str]:
    """Remove every placement group of run ``run_id`` still reserved (pending ones too);
    returns their names. A name removed meanwhile by its group's own shutdown is skipped."""
    removed = []
    for name, pg_id in reserved(run_id).items():
        try:
            remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(pg_id)))
            removed.append(name)
        except Exception:  # noqa: BLE001 - removed meanwhile
            logger.debug("Placement group %s was already removed.", name, exc_info=True)
    return removed
