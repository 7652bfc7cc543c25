"""Which tier moves tensors between two workers, from where they are."""

from __future__ import annotations

from dataclasses import dataclass

from ray_disagg.transport.base import TIERS

__all__ = ["Location", "choose_tier", "group_offsets", "pair_tiers"]


@dataclass(frozen=True)
class Location:
    """Where one worker runs (reported by the worker itself when the groups connect)."""

    node: str
    """Ray node id."""
    pid: int
    device: str
    """``"cpu"`` or ``"cuda"``."""
    gpu: str | None = None
    """UUID of the worker's GPU (``None`` on CPU)."""
    placement_group: str | None = None
    """Placement group id (hex) the worker was scheduled in."""
    bundle: int | None = None
    """Bundle index of that placement group."""


def _why_not(tier: str, a: Location, b: Location) -> str | None:
    same_node = a.node == b.node
    both_gpu = a.device == b.device == "cuda"
    if tier == "shm" and not same_node:
        return "the two workers are on different nodes"
    if tier == "cuda_ipc" and not (both_gpu and same_node and a.gpu == b.gpu):
        return "CUDA IPC needs both workers on the same GPU (colocated)"
    if tier == "nccl":
        if not both_gpu:
            return "NCCL needs both workers on GPUs"
        if a.gpu == b.gpu and same_node:
            return "NCCL refuses two ranks of one communicator on the same GPU"
    return None


def choose_tier(a: Location, b: Location, requested: str = "auto") -> str:
    """The tier for transfers between ``a`` and ``b``: ``requested`` when it is a tier
    (``ValueError`` when it cannot work there), else the fastest that works:
    same GPU -> cuda_ipc, two GPUs -> nccl, CPU on one node -> shm, otherwise gloo.

    Example:
        >>> cpu = Location(node="n1", pid=1, device="cpu")
        >>> choose_tier(cpu, Location(node="n1", pid=2, device="cpu"))
        'shm'
        >>> choose_tier(cpu, Location(node="n2", pid=2, device="cpu"))
        'gloo'
    """
    if requested != "auto":
        if requested not in TIERS:
            raise ValueError(f"transfer={requested!r}: must be 'auto' or one of {TIERS}.")
        why = _why_not(requested, a, b)
        if why:
            raise ValueError(f"transfer={requested!r} cannot be used here: {why}.")
        return requested
    if a.device == b.device == "cuda":
        return "cuda_ipc" if a.node == b.node and a.gpu == b.gpu else "nccl"
    if a.device == b.device == "cpu" and a.node == b.node:
        return "shm"
    return "gloo"


def group_offsets(sizes: dict[str, int]) -> dict[str, int]:
    """Channel rank of each group's rank 0: the groups' ranks one after another, in
    ``sizes`` order."""
    offsets, off = {}, 0
    for name, n in sizes.items():
        offsets[name], off = off, off + n
    return offsets


def pair_tiers(
    offsets: dict[str, int], pairs, locations: list[Location], requested: str = "auto"
) -> dict[tuple[int, int], str]:
    """The tier of each exchanging pair ``((group, rank), (group, rank))``, keyed by the
    pair's channel ranks (lower first); ``ValueError`` naming the pair when ``requested``
    cannot work between them."""
    tiers = {}
    for (ga, ra), (gb, rb) in pairs:
        a, b = offsets[ga] + ra, offsets[gb] + rb
        try:
            tier = choose_tier(locations[a], locations[b], requested)
        except ValueError as e:
            raise ValueError(f"between {ga} rank {ra} and {gb} rank {rb}: {e}") from None
        tiers[(min(a, b), max(a, b))] = tier
    return tiers
