"""Which encoder replicas may exchange tensors with which LLM replicas (a bounded
*neighbourhood* per replica), and the balancing that keeps inside them.

Lay both groups' replicas side by side on a circle of circumference 1: encoder replica
``e`` of ``E`` covers ``[e/E, (e+1)/E]`` (its right end included, the last one's being
the circle's start), LLM replica ``d`` of ``L`` covers ``[d/L, (d+1)/L)``. They are
neighbours where the two overlap, so encoder replica ``e`` has at most ``ceil(L / E) + 1``
LLM neighbours and LLM replica ``d`` at most ``ceil(E / L) + 1`` encoder neighbours,
whatever the cluster's size; consecutive LLM replicas share an encoder replica, and the
last encoder replica serves the first LLM replica too, so load can move around the whole
ring. Contiguous slices (no costs) exchange only inside it already; balanced and
token-budget plans place every sample on a neighbour of its LLM replica.

Example:
    >>> n = Neighbourhoods(encoders=4, llms=2)
    >>> [n.of_llm(d) for d in range(2)], [n.of_encoder(e) for e in range(4)]
    ([(0, 1, 3), (1, 2, 3)], [(0,), (0, 1), (1,), (0, 1)])
"""

from __future__ import annotations

import functools
import heapq
import math
from dataclasses import dataclass

import numpy as np

__all__ = ["Neighbourhoods", "band_split", "ring", "spread"]


@dataclass(frozen=True)
class Neighbourhoods:
    """The band of neighbours between ``encoders`` encoder replicas and ``llms`` LLM
    replicas (see the module docstring)."""

    encoders: int
    llms: int

    def of_llm(self, d: int) -> tuple[int, ...]:
        """The encoder replicas LLM replica ``d`` may exchange with, ascending."""
        e, n = self.encoders, self.llms
        near = set(range(max(0, -(-d * e // n) - 1), min(e, -(-(d + 1) * e // n))))
        return tuple(sorted(near | {e - 1} if d == 0 else near))

    def of_encoder(self, e: int) -> tuple[int, ...]:
        """The LLM replicas encoder replica ``e`` may exchange with, ascending."""
        m, n = self.encoders, self.llms
        near = set(range(e * n // m, min(n, (e + 1) * n // m + 1)))
        return tuple(sorted(near | {0} if e == m - 1 else near))

    def pairs(self) -> set[tuple[int, int]]:
        """``(encoder replica, LLM replica)`` for every neighbouring pair."""
        return {(e, d) for d in range(self.llms) for e in self.of_llm(d)}

    @property
    def max_llm_peers(self) -> int:
        """The most LLM neighbours of an encoder replica (``<= ceil(L/E) + 1``)."""
        return max(len(self.of_encoder(e)) for e in range(self.encoders))

    @property
    def max_encoder_peers(self) -> int:
        """The most encoder neighbours of an LLM replica (``<= ceil(E/L) + 1``)."""
        return max(len(self.of_llm(d)) for d in range(self.llms))


def band_split(shares: list[list[int]], cost, n: int, loads: list[float] | None = None):
    """One microbatch's samples over ``n`` encoder replicas, each sample on a neighbour of
    its LLM replica: ``shares[d]``, LLM replica ``d``'s positions; ``cost[p]``, position
    ``p``'s encoder cost; ``loads``, each encoder replica's cost in the step's earlier
    microbatches (updated: the step evens out as a whole). A sweep along the ring sets
    each encoder replica's quota of each neighbour's cost (every replica up to the mean,
    the last neighbour of an LLM replica taking what is left of it); each LLM replica's
    samples then go, largest first, to the neighbour with the most quota left (fewest
    samples, lowest index on ties: zero costs spread evenly). Each list comes out in
    position order. Deterministic.

    Example:
        >>> band_split([[0, 1, 2, 3], [4, 5, 6, 7]], [6, 1, 1, 1, 1, 1, 1, 1], 4)
        [[0], [1, 3], [4, 5, 6], [2, 7]]
    """
    of_llm, of_encoder = ring(n, len(shares))
    loads = [0.0] * n if loads is None else loads
    cost = cost.tolist() if hasattr(cost, "tolist") else cost
    supply = [float(sum(cost[p] for p in s)) for s in shares]
    # the sweep: replicas in order fill up to the mean from their lowest LLM neighbour
    # with cost left; the last neighbour of an LLM replica (the first LLM replica's: the
    # last encoder replica) takes all that is left of it
    target, quotas = (sum(supply) + sum(loads)) / n, [{} for _ in shares]
    for e in range(n):
        room = target - loads[e]
        for d in of_encoder[e]:
            take = supply[d] if e == of_llm[d][-1] else min(supply[d], max(room, 0.0))
            if take > 0:
                quotas[d][e] = take
                supply[d] -= take
                room -= take
    out = [[] for _ in range(n)]
    for d, share in enumerate(shares):
        near, q = of_llm[d], quotas[d]
        left = [q.get(e, 0.0) for e in near]
        for p in sorted(share, key=lambda p: (-cost[p], p)):
            best = 0  # the most quota left, then the fewest samples, then the lowest index
            for i in range(1, len(near)):
                if left[i] > left[best] or (
                    left[i] == left[best] and len(out[near[i]]) < len(out[near[best]])
                ):
                    best = i
            e = near[best]
            left[best] -= cost[p]
            loads[e] += cost[p]
            out[e].append(p)
    return [sorted(o) for o in out]


@functools.lru_cache(maxsize=16)
def ring(encoders: int, llms: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """``(of_llm, of_encoder)``: every LLM replica's and every encoder replica's
    neighbours (:class:`Neighbourhoods`, computed once per pair of sizes)."""
    band = Neighbourhoods(encoders, llms)
    of_llm = tuple(band.of_llm(d) for d in range(llms))
    return of_llm, tuple(band.of_encoder(e) for e in range(encoders))


def spread(positions: list[int], costs: list[list[float]], n: int) -> list[list[int]]:
    """``positions`` into ``n`` lists of equal counts, balancing every kind of cost at
    once (``costs[k][i]``: cost ``k`` of ``positions[i]``, e.g. the LLM's tokens and each
    encoder's estimate): each cost is scaled to its total, samples go largest (by their
    largest scaled cost) first, each to the list with room that is least loaded in the
    cost where the sample is largest (then least loaded overall, fewest samples, lowest
    index). With one kind of cost this is longest-processing-time. Each list comes out in
    position order. Deterministic.

    Example:
        >>> spread([0, 1, 2, 3], [[4, 4, 1, 1], [0, 0, 8, 8]], 2)  # tokens, patches
        [[0, 2], [1, 3]]
    """
    per, kinds = len(positions) // n, len(costs)
    arr = np.asarray(costs, dtype=np.float64).reshape(kinds, len(positions))
    totals = np.array([math.fsum(row) or 1.0 for row in arr.tolist()])  # exact: every worker
    scaled = arr / totals[:, None]
    largest = scaled.max(axis=0)
    order = np.lexsort((np.arange(len(positions)), -largest)).tolist()
    kind, scaled = scaled.argmax(axis=0).tolist(), scaled.T.tolist()  # ties: the first kind
    loads = [[0.0] * kinds for _ in range(n)]
    counts, out = [0] * n, [[] for _ in range(n)]
    heaps = [[(0.0, 0.0, 0, r) for r in range(n)] for _ in range(kinds)]
    for i in order:
        heap = heaps[kind[i]]
        while True:  # an entry is current while its count is (full lists: never)
            _, _, count, r = heapq.heappop(heap)
            if count == counts[r] < per:
                break
        out[r].append(positions[i])
        counts[r] = count = count + 1
        load = loads[r] = [a + b for a, b in zip(loads[r], scaled[i])]
        if count < per:
            total = sum(load)
            for k in range(kinds):
                heapq.heappush(heaps[k], (load[k], total, count, r))
    return [sorted(o) for o in out]
