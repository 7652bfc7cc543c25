"""The channel's process groups: one *link* per pair of groups that talk across.

A link spans the workers of two groups that exchange with each other (the leaders in the
plan's transfer pairs) plus both groups' rank 0 (the per-step statistics go from each
encoder group's rank 0 to the hub's, the first group's: the LLM group). Its gloo group
carries the headers and the gloo-tier tensors; it is created with gloo's lazy
connections, and each member then connects only to its own peers in the link (one
concurrent round: post a send to every peer, then receive from every peer), so a worker
holds as many connections as it has peers, not as many as the job has workers.

NCCL-tier pairs of a link share communicators: one over each connected part of the
link's NCCL pairs (with separate placement, usually the whole ring of leaders; with
colocated groups, the pairs between GPUs), connected eagerly (``ncclCommInitRank`` is one
rendezvous of the part). A part with two members on one GPU (NCCL refuses that) keeps a
two-rank communicator per pair. So a worker holds at most one gloo group and one NCCL
communicator per other group it exchanges with (an Omni LLM leader: two of each),
whatever the number of replicas, and start-up costs one round per link, every worker
taking its links in one global order.

:func:`plan_links` is a pure function of the :class:`~ray_disagg.transport.channel.
ChannelSpec` (the benchmarks and the planner count with it); :func:`connect` builds one
link on a worker.

Example:
    >>> from ray_disagg.transport.channel import ChannelSpec
    >>> spec = ChannelSpec("127.0.0.1", 0, {"text": 0, "vision": 2}, {"text": 2, "vision": 4},
    ...                    60.0, "p", tiers={(0, 2): "gloo", (1, 4): "gloo"})
    >>> [(link.groups, link.members) for link in plan_links(spec)]
    [(('text', 'vision'), (0, 1, 2, 4))]
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["Link", "LinkGroups", "connect", "plan_links"]


@dataclass(frozen=True)
class Link:
    """The side ranks of two groups that talk to each other, and who talks to whom."""

    groups: tuple[str, str]
    """(the hub group, the other group) for a link with the hub, else in group order."""
    members: tuple[int, ...]
    """Side ranks in the link, sorted (a member's link rank is its index)."""
    pairs: tuple[tuple[int, int], ...]
    """Who talks to whom: the transfer pairs between the groups and the two rank 0s
    (``(low, high)`` side ranks, sorted)."""
    nccl_parts: tuple[tuple[int, ...], ...] = ()
    """Connected parts of the link's NCCL-tier pairs (sorted side ranks each)."""

    def rank(self, side_rank: int) -> int:
        return self.members.index(side_rank)

    def peers(self, side_rank: int) -> tuple[int, ...]:
        """The members ``side_rank`` exchanges with in this link."""
        return tuple(
            sorted({b if a == side_rank else a for a, b in self.pairs if side_rank in (a, b)})
        )

    def part(self, side_rank: int) -> tuple[int, ...] | None:
        return next((p for p in self.nccl_parts if side_rank in p), None)

    @property
    def name(self) -> str:
        return f"{self.groups[0]}-{self.groups[1]}"


def plan_links(spec) -> tuple[Link, ...]:
    """Every link of the channel, in the global order in which workers connect them: one
    per pair of groups with transfer pairs, and one between the hub (the first group) and
    every other group (the statistics)."""
    order = list(spec.offsets)
    hub = order[0]
    pairs: dict[tuple[str, str], set] = {(hub, g): set() for g in order[1:]}
    for a, b in spec.tiers:
        ga, gb = sorted((spec.group(a), spec.group(b)), key=order.index)
        pairs.setdefault((ga, gb), set()).add((min(a, b), max(a, b)))
    links = []
    for (ga, gb), ps in sorted(
        pairs.items(), key=lambda kv: (order.index(kv[0][0]), order.index(kv[0][1]))
    ):
        ps = set(ps) | {tuple(sorted((spec.offsets[ga], spec.offsets[gb])))}
        members = tuple(sorted({r for p in ps for r in p}))
        nccl = [p for p in ps if spec.tier(*p) == "nccl"]
        links.append(Link((ga, gb), members, tuple(sorted(ps)), _parts(nccl)))
    return tuple(links)


def _parts(pairs) -> tuple[tuple[int, ...], ...]:
    """The connected parts of a graph given by its edges (union-find)."""
    parent: dict[int, int] = {}

    def root(x: int) -> int:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in pairs:
        parent[root(a)] = root(b)
    parts: dict[int, list[int]] = {}
    for x in list(parent):
        parts.setdefault(root(x), []).append(x)
    return tuple(sorted(tuple(sorted(p)) for p in parts.values()))


class LinkGroups:
    """One worker's process groups of a link: the gloo group (headers, gloo tensors) and
    the NCCL communicators of its part (``nccl``: peer side rank -> (group, rank in it))."""

    def __init__(self, link: Link, gloo, nccl: dict):
        self.link, self.gloo, self.nccl = link, gloo, nccl


def connect(link: Link, spec, store, me: int, node_ip: str, device=None) -> LinkGroups:
    """Build ``me``'s groups of ``link`` (every member calls it, links in the order of
    :func:`plan_links`): the lazy gloo group, then one round connecting ``me`` to its peers,
    then the NCCL communicator of ``me``'s part (if any)."""
    timeout = timedelta(seconds=spec.timeout_s)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=node_ip, lazy_init=True)]
    prefix = f"{spec.prefix}/link/{link.name}"
    gloo = dist.ProcessGroupGloo(
        dist.PrefixStore(prefix, store), link.rank(me), len(link.members), opts
    )
    _handshake(gloo, link, me)
    return LinkGroups(link, gloo, _nccl(link, spec, store, me, device, prefix))


def _handshake(gloo, link: Link, me: int) -> None:
    """Connect ``me`` to each of its peers now (a dead peer is then noticed at once, as
    with eager connections): every send posted first, so no two members wait in a cycle."""
    peers, one = [link.rank(p) for p in link.peers(me)], torch.ones(1, dtype=torch.uint8)
    sent = [gloo.send([one], p, 0) for p in peers]
    for p in peers:
        gloo.recv([torch.zeros(1, dtype=torch.uint8)], p, 0).wait()
    for work in sent:
        work.wait()


def _nccl(link: Link, spec, store, me: int, device, prefix: str) -> dict:
    """peer -> (communicator, the peer's rank in it) for ``me``'s NCCL-tier peers."""
    part = link.part(me)
    if part is None:
        return {}
    from ray_disagg.transport.nccl import link_group, pair_group

    mine = [p for p in link.pairs if me in p and spec.tier(*p) == "nccl"]
    gpus = [(spec.locations[r].node, spec.locations[r].gpu) for r in part] if spec.locations else []
    if len(set(gpus)) < len(gpus):  # two members on one GPU: a communicator per pair
        return {
            (b if a == me else a): (
                pair_group(store, spec.prefix, a, b, me, spec.timeout_s, device),
                int(me == a),  # the pair's rank 0 is its lower side rank
            )
            for a, b in mine
        }
    pg = link_group(
        store, f"{prefix}/nccl{link.nccl_parts.index(part)}", part, me, spec.timeout_s, device
    )
    return {(b if a == me else a): (pg, part.index(b if a == me else a)) for a, b in mine}
