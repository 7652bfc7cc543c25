"""Replays the groups' action lists on in-order devices and finds waits in a cycle.

Every worker runs its step as one in-order queue of operations, as a GPU does with
``CUDA_DEVICE_MAX_CONNECTIONS=1`` (every stream's work in one hardware queue): a
point-to-point transfer with a peer (sends and receives of one action on one pair, issued
together) completes only when the peer's queue has the mirror transfer at its head, and a
collective (SP all-to-all, TP broadcast, FSDP all-gather, the end-of-step sums within a
group) only when every member has it at its head; the step's statistics then cross
between the groups' rank 0s as transfers (no collective spans the groups). That is
stricter than NCCL and gloo need (they may buffer small sends), so a schedule that never
gets stuck here cannot wait in a cycle there, whatever the buffering.

:func:`programs` turns each group's action list (``ray_disagg.pipeline.schedule``) into
these queues for a layout; :func:`run` replays them and raises :class:`Deadlock` naming the
workers stuck and what each waits for.

Example:
    >>> layout = {"vision": GroupShape(dp=1, mp=1), "text": GroupShape(dp=1, mp=1)}
    >>> run(programs(layout, "text", k=4, max_in_flight=2))
    82
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ray_disagg.pipeline.schedule import Op, encoder_actions, llm_actions

__all__ = ["GroupShape", "Transfer", "Collective", "Deadlock", "programs", "run"]


@dataclass(frozen=True)
class GroupShape:
    """A group's data-parallel and model-parallel sizes; ``fsdp``: its forward and
    backward gather over every rank of the group (not only the replica's mp ranks);
    ``trains``: an encoder group that gets gradients back."""

    dp: int
    mp: int = 1
    fsdp: bool = False
    trains: bool = True


Worker = tuple[str, int, int]  # group, data-parallel replica, model-parallel rank


@dataclass(frozen=True)
class Transfer:
    """This worker's transfers with ``peer`` in one action: ``(send|recv, message)``."""

    peer: Worker
    ops: tuple[tuple[str, str], ...]

    def mirrors(self, other: Transfer, me: Worker) -> bool:
        flip = {"send": "recv", "recv": "send"}
        return other.peer == me and sorted(other.ops) == sorted((flip[d], m) for d, m in self.ops)


@dataclass(frozen=True)
class Collective:
    """A collective named ``name`` over ``members``."""

    name: str
    members: frozenset


class Deadlock(RuntimeError):
    """Workers wait for each other in a cycle (or for a peer that has finished)."""


def _collective(name: str, shape: GroupShape, group: str, d: int, scope: str) -> list:
    """A collective over the replica's mp ranks (``scope="mp"``), the mp rank's dp peers
    (``"dp"``) or the whole group (``"group"``); nothing when it has one member."""
    if scope == "mp":
        members = {(group, d, m) for m in range(shape.mp)}
    else:
        members = {(group, r, m) for r in range(shape.dp) for m in range(shape.mp)}
    return [Collective(f"{group}:{name}:{scope}:{d if scope == 'mp' else ''}", frozenset(members))]


def _pairs(groups, llm, j, talks) -> dict[str, list[tuple[int, int]]]:
    return {
        g: [(d, t) for d in range(s.dp) for t in range(groups[llm].dp) if talks(g, d, t, j)]
        for g, s in groups.items()
        if g != llm
    }


def _encoder_queue(groups, llm, group, d, m, step, k, limit, talks) -> list:
    shape, lead = groups[group], m == 0
    heavy = "group" if shape.fsdp else "mp"
    llm_peers = sorted(
        {t for j in range(k) for dd, t in _pairs(groups, llm, j, talks)[group] if dd == d}
    )
    out: list = []
    for a in encoder_actions(k, limit, trains=shape.trains):
        peers = (
            [t for dd, t in _pairs(groups, llm, a.mb, talks)[group] if dd == d]
            if a.mb is not None
            else []
        )
        tag = f"{step}:{group}{d}"
        if a.op is Op.RECV_INPUTS:
            out += [Transfer((llm, t, 0), (("recv", f"in:{tag}:t{t}"),)) for t in llm_peers if lead]
            out += _collective(f"inputs:{step}", shape, group, d, "mp")
        elif a.op is Op.FORWARD:
            out += _collective(f"fwd:{step}:{a.mb}", shape, group, d, heavy)
            out += [
                Transfer((llm, t, 0), (("send", f"c{a.mb}:{tag}:t{t}"),)) for t in peers if lead
            ]
        elif a.op is Op.RECV_GRADS:
            out += [
                Transfer((llm, t, 0), (("recv", f"g{a.mb}:{tag}:t{t}"),)) for t in peers if lead
            ]
        elif a.op is Op.BACKWARD:
            out += _collective(f"bwd:{step}:{a.mb}", shape, group, d, heavy)
    return out


def _llm_queue(groups, llm, t, m, step, k, limit, talks, schedule) -> list:
    shape, lead = groups[llm], m == 0
    heavy = "group" if shape.fsdp else "mp"
    encoders = [g for g in groups if g != llm]
    trains = any(groups[g].trains for g in encoders)
    out: list = []
    for a in schedule(k, limit, sends_grads=trains):
        pairs = _pairs(groups, llm, a.mb, talks) if a.mb is not None else {}
        peers = [(g, d) for g in encoders for d, tt in pairs.get(g, []) if tt == t]
        if a.op is Op.SEND_INPUTS:
            every = _pairs_any(groups, llm, k, talks, t)
            out += [
                Transfer((g, d, 0), (("send", f"in:{step}:{g}{d}:t{t}"),)) for g, d in every if lead
            ]
            out += _collective(f"inputs:{step}", shape, llm, t, "mp")
            out += _collective(f"labels:{step}", shape, llm, t, "dp")
        elif a.op is Op.RECV_CROSSINGS:
            ops = [("recv", f"c{a.mb}:{step}:{g}{d}:t{t}") for g, d in peers]
            out += [Transfer((g, d, 0), (op,)) for (g, d), op in zip(peers, ops) if lead]
        elif a.op is Op.TRAIN:
            out += _collective(f"train:{step}:{a.mb}", shape, llm, t, heavy)
        elif a.op is Op.SEND_GRADS:
            back = [(g, d) for g, d in peers if groups[g].trains]
            out += [
                Transfer((g, d, 0), (("send", f"g{a.mb}:{step}:{g}{d}:t{t}"),))
                for g, d in back
                if lead
            ]
    return out


def _pairs_any(groups, llm, k, talks, t) -> list[tuple[str, int]]:
    every = set()
    for j in range(k):
        for g, pairs in _pairs(groups, llm, j, talks).items():
            every |= {(g, d) for d, tt in pairs if tt == t}
    return sorted(every, key=lambda gd: (list(groups).index(gd[0]), gd[1]))


def programs(
    groups: dict[str, GroupShape],
    llm: str,
    k: int,
    max_in_flight: int = 1,
    steps: int = 2,
    talks: Callable[[str, int, int, int], bool] | None = None,
    llm_schedule: Callable = llm_actions,
) -> dict[Worker, list]:
    """Each worker's queue for ``steps`` steps of ``k`` microbatches. ``talks(group, d,
    t, j)``: whether encoder replica ``d`` of ``group`` and LLM replica ``t`` share
    samples in microbatch ``j`` (default: every pair, a superset of any plan's);
    ``llm_schedule``: the LLM side's action lists (another order, to compare)."""
    talks = talks or (lambda g, d, t, j: True)
    everyone = frozenset(
        (g, d, m) for g, s in groups.items() for d in range(s.dp) for m in range(s.mp)
    )
    out: dict[Worker, list] = {w: [] for w in everyone}
    for step in range(steps):
        for g, d, m in everyone:
            if g == llm:
                out[(g, d, m)] += _llm_queue(
                    groups, llm, d, m, step, k, max_in_flight, talks, llm_schedule
                )
            else:
                out[(g, d, m)] += _encoder_queue(
                    groups, llm, g, d, m, step, k, max_in_flight, talks
                )
        for w, queue in out.items():
            queue += _statistics(groups, llm, w, step)
    return out


def _statistics(groups: dict[str, GroupShape], llm: str, me: Worker, step: int) -> list:
    """The end of a step (``Channel.all_reduce_sum``): a sum within each group, each
    encoder group's rank 0 sends it to the LLM group's rank 0 and gets the total back, each
    group's rank 0 shares it in its group."""
    group, hub = me[0], (llm, 0, 0)
    members = frozenset(
        (group, r, m) for r in range(groups[group].dp) for m in range(groups[group].mp)
    )
    out: list = [Collective(f"sum:{step}:{group}", members)]
    others = [g for g in groups if g != llm]
    if me == hub:
        out += [Transfer((g, 0, 0), (("recv", f"stats:{step}:{g}"),)) for g in others]
        out += [Transfer((g, 0, 0), (("send", f"total:{step}:{g}"),)) for g in others]
    elif me == (group, 0, 0):
        out += [
            Transfer(hub, (("send", f"stats:{step}:{group}"),)),
            Transfer(hub, (("recv", f"total:{step}:{group}"),)),
        ]
    return out + [Collective(f"share:{step}:{group}", members)]


def run(queues: dict[Worker, list]) -> int:
    """Replays the queues; returns the number of operations completed, or raises
    :class:`Deadlock` naming each stuck worker and the operation at its head."""
    queues = {w: list(q) for w, q in queues.items()}
    done = 0
    while any(queues.values()):
        ready = _ready(queues)
        if not ready:
            stuck = {w: q[0] for w, q in sorted(queues.items()) if q}
            lines = "\n".join(f"  {w}: {op}" for w, op in stuck.items())
            raise Deadlock(f"{len(stuck)} workers wait for each other:\n{lines}")
        for w in ready:
            queues[w].pop(0)
            done += 1
    return done


def _ready(queues) -> set:
    """Workers whose head operation can complete now (with its partners)."""
    ready = set()
    for w, q in queues.items():
        if not q or w in ready:
            continue
        head = q[0]
        if isinstance(head, Collective):
            if all(queues.get(p) and queues[p][0] == head for p in head.members):
                ready |= set(head.members)
        else:
            peer = queues.get(head.peer)
            if peer and isinstance(peer[0], Transfer) and head.mirrors(peer[0], w):
                ready |= {w, head.peer}
    return ready
