"""The bins of token-budget batching (``max_tokens_per_microbatch``): how a step's samples
are chosen and placed (the plans that use them: :mod:`ray_disagg.pipeline.budget`).

A step has one *bin* per LLM microbatch and data-parallel replica (``micro_batches x
llm_dp``), whose LLM batch holds at most ``max_tokens`` tokens, padding included
(:class:`RowShape`: unpacked, its sequences x the longest; packed, its rows x the
longest row; a pair's two sequences both count), and per encoder group one bin per
microbatch and encoder replica, holding at most ``max_patches`` of that tower's input
patches. Samples are placed in the epoch's order
(:func:`~ray_disagg.pipeline.assignment.sample_order`): each goes to the LLM bin where
it leaves the smallest batch within the budget (the least-loaded on ties) and, in that
microbatch, to the least-loaded replica of each encoder group, among the LLM replica's
neighbours (:class:`~ray_disagg.pipeline.neighbours.Neighbourhoods`), where its patches fit; so
samples of similar length share a microbatch and both the LLM and the encoder work are
balanced. A sample that fits nowhere ends the step once every LLM bin holds a sample
(until then it waits, first in line for the next step, while later samples fill the
empty bins); so does reaching ``max_samples`` (``global_batch_size``; the last samples
of a step go to its empty bins). At the epoch's end
a step with an empty LLM bin is dropped, as a fixed-size plan drops its incomplete last
batch. Deterministic: every worker computes the same steps.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from ray_disagg.pipeline.neighbours import ring

__all__ = [
    "MAX_WAITING",
    "BinFiller",
    "BudgetStep",
    "RowShape",
    "fill_epoch",
    "fill_steps",
    "over_budget",
]


@dataclass(frozen=True)
class RowShape:
    """The LLM batch of a microbatch, as its collate pads it: ``rows`` x ``width``.
    Unpacked (``max_seq_len=None``) each sequence is a row and the rows are padded to the
    longest; packed, sequences fill rows of ``max_seq_len`` next-fit in order and the rows
    are padded to the longest row.

    Example:
        >>> RowShape().add((5, 3), None).add((4,), None).tokens  # 3 rows x 5
        15
        >>> RowShape().add((5, 3), 8).add((4,), 8).tokens  # [5, 3] [4]: 2 rows x 8
        16
    """

    rows: int = 0
    width: int = 0
    last: int = 0  # packed: the tokens of the last row

    def add(self, lengths, max_seq_len: int | None) -> RowShape:
        rows, width, last = self.rows, self.width, self.last
        for n in lengths:
            if max_seq_len is not None and rows and last + n <= max_seq_len:
                last += n
            else:
                rows, last = rows + 1, n
            width = max(width, last)
        return RowShape(rows, width, last)

    @property
    def tokens(self) -> int:
        return self.rows * self.width


@dataclass
class BudgetStep:
    """One step's samples (dataset indices): ``llm[j][d]`` for microbatch ``j`` and LLM
    replica ``d``; ``encoders[part][j][e]`` for encoder replica ``e``."""

    llm: list[list[list[int]]]
    encoders: dict[str, list[list[list[int]]]]
    shapes: list[list[RowShape]] = dataclasses.field(default_factory=list)
    loads: dict[str, list[list[float]]] = dataclasses.field(default_factory=dict)

    @classmethod
    def empty(cls, k: int, llm_dp: int, encoder_dps: dict[str, int]) -> BudgetStep:
        return cls(
            llm=[[[] for _ in range(llm_dp)] for _ in range(k)],
            encoders={
                p: [[[] for _ in range(n)] for _ in range(k)] for p, n in encoder_dps.items()
            },
            shapes=[[RowShape()] * llm_dp for _ in range(k)],
            loads={p: [[0.0] * n for _ in range(k)] for p, n in encoder_dps.items()},
        )

    @property
    def count(self) -> int:
        return sum(len(b) for mb in self.llm for b in mb)

    @property
    def empty_bins(self) -> int:
        return sum(not b for mb in self.llm for b in mb)

    @property
    def every_bin_used(self) -> bool:
        return self.empty_bins == 0

    def indices(self) -> list[int]:
        """The step's samples, replica-major: replica 0's microbatches in order, then 1..."""
        return [i for d in range(len(self.llm[0])) for mb in self.llm for i in mb[d]]


@dataclass
class BinFiller:
    """Places samples into one step's bins (see the module docstring). ``lengths[i]``:
    sample ``i``'s LLM sequence lengths (one, or a pair's two); ``patches[part][i]``: its
    input patches per encoder group (``i``: a dataset index, or a stream's read number)."""

    lengths: object
    patches: dict
    max_tokens: int
    max_patches: object  # a number, or per encoder part
    max_samples: int
    shape: tuple  # (micro_batches, llm_dp, {encoder part: dp})
    max_seq_len: int | None = None  # packed rows (RowShape); None: unpacked
    _least: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def bins(self) -> int:
        return self.shape[0] * self.shape[1]

    def cap(self, part: str) -> float:
        cap = self.max_patches[part] if isinstance(self.max_patches, dict) else self.max_patches
        return math.inf if cap is None else cap

    def new_step(self) -> BudgetStep:
        return BudgetStep.empty(*self.shape)

    def place(self, step: BudgetStep, i: int, only_empty: bool = False) -> bool:
        """Whether sample ``i`` found a place in ``step`` (and took it); ``only_empty``:
        in an empty LLM bin."""
        if step.count >= self.max_samples:
            return False
        # the last samples of a full step go to its empty bins
        only_empty = only_empty or step.count + step.empty_bins >= self.max_samples
        options = []
        for j, mb in enumerate(step.shapes):
            for d, shape in enumerate(mb):
                grown = shape.add(self.lengths[i], self.max_seq_len)
                if grown.tokens <= self.max_tokens and not (only_empty and step.llm[j][d]):
                    options.append((grown.tokens, shape.tokens, j, d, grown))
        for *_, j, d, grown in sorted(options, key=lambda o: o[:4]):
            chosen = self._encoder_replicas(step, j, d, i)
            if chosen is None:
                continue
            step.llm[j][d].append(i)
            step.shapes[j][d] = grown
            for part, e in chosen.items():
                step.encoders[part][j][e].append(i)
                step.loads[part][j][e] += float(self.patches[part][i])
            return True
        return False

    def _encoder_replicas(self, step: BudgetStep, j: int, d: int, i: int) -> dict[str, int] | None:
        """Per encoder group, a neighbour of LLM replica ``d`` in microbatch ``j`` where
        sample ``i``'s patches fit (:meth:`_replica`), or ``None``."""
        out = {}
        for part in step.loads:
            e = self._replica(step, j, d, part, float(self.patches[part][i]))
            if e is None:
                return None
            out[part] = e
        return out

    def _replica(self, step: BudgetStep, j: int, d: int, part: str, p: float) -> int | None:
        """The replica of ``part`` for ``p`` patches of LLM bin ``(j, d)``. Under a patch
        cap it must leave each other empty LLM bin a neighbour with room for a sample (the
        least of the group's), and the neighbours that fewer empty bins depend on go
        first; then the least loaded (fewest samples, lowest index on ties)."""
        load, cap = step.loads[part][j], self.cap(part)
        of_llm, of_encoder = ring(len(load), self.shape[1])
        empty = {b for r in of_llm[d] for b in of_encoder[r] if b != d and not step.llm[j][b]}
        least = self.least(part) if empty and cap < math.inf else 0.0

        def keeps(r: int) -> bool:
            return all(
                any(cap - load[x] - (p if x == r else 0.0) >= least for x in of_llm[b])
                for b in empty
                if r in of_llm[b]
            )

        fits = [r for r in of_llm[d] if load[r] + p <= cap and (cap == math.inf or keeps(r))]
        if not fits:
            return None
        counts = [len(b) for b in step.encoders[part][j]]
        need = dict.fromkeys(fits, 0.0)
        if cap < math.inf:
            need = {r: sum(1 / len(of_llm[b]) for b in empty if r in of_llm[b]) for r in fits}
        return min(fits, key=lambda r: (need[r], load[r], counts[r], r))

    def least(self, part: str) -> float:
        """The fewest patches of a sample with any (0 when none has; a stream's: of the
        records read so far)."""
        patches = self.patches[part]
        if isinstance(patches, dict):  # a stream's reads: they grow
            return min((float(n) for n in patches.values() if n > 0), default=0.0)
        if part not in self._least:
            patches = np.asarray(patches, dtype=np.float64)
            self._least[part] = float(patches[patches > 0].min()) if (patches > 0).any() else 0.0
        return self._least[part]


def fill_epoch(
    order,
    lengths,
    patches: dict[str, np.ndarray],
    *,
    max_tokens: int,
    max_patches: float | None,
    micro_batches: int,
    llm_dp: int,
    encoder_dps: dict[str, int],
    max_samples: int,
    max_seq_len: int | None = None,
) -> list[BudgetStep]:
    """The steps of one epoch whose samples come in ``order`` (see the module docstring).

    Example:
        >>> lengths = [(6,), (2,), (3,), (5,), (1,), (7,)]
        >>> steps = fill_epoch(range(6), lengths, {}, max_tokens=8, max_seq_len=8,
        ...                    max_patches=None, micro_batches=1, llm_dp=2, encoder_dps={},
        ...                    max_samples=8)
        >>> [s.llm for s in steps]  # per step, per microbatch, per replica (packed rows)
        [[[[0], [1, 2]]], [[[3], [4, 5]]]]
    """
    shape = (micro_batches, llm_dp, encoder_dps)
    return fill_steps(
        BinFiller(lengths, patches, max_tokens, max_patches, max_samples, shape, max_seq_len), order
    )


MAX_WAITING = 64
"""Samples that may wait for a later step, per LLM bin; more are left out of the epoch
(a patch cap that keeps many samples from sharing a microbatch: the plan says so)."""


def fill_steps(filler: BinFiller, order, cover: bool = False) -> list[BudgetStep]:
    """:func:`fill_epoch` with its ``filler``. ``cover``: every sample in some step (a
    forward-only pass over all): the incomplete last step's empty bins take repeats of
    the smallest samples."""
    order = list(order)
    steps, waiting, rest = [], deque(), iter(order)
    while True:
        step = filler.new_step()
        waiting = deque(i for i in waiting if not filler.place(step, i))  # they go first
        ended = _fill_from(filler, step, rest, waiting, MAX_WAITING * filler.bins)
        if ended and cover and step.count and not step.every_bin_used:
            _repeat_into(filler, step, order)
        if step.every_bin_used:
            steps.append(step)
        if ended and (not step.every_bin_used or not waiting):
            return steps  # what is left (waiting, or an incomplete step) is dropped


def _fill_from(filler: BinFiller, step: BudgetStep, rest, waiting: deque, limit: int) -> bool:
    """Place samples from ``rest`` until the step is full; ``True`` when ``rest`` ran out."""
    while step.count < filler.max_samples:
        i = next(rest, None)
        if i is None:
            return True
        if not filler.place(step, i):
            if len(waiting) < limit:
                waiting.append(i)
            if step.every_bin_used:
                return False
    return False


def _repeat_into(filler: BinFiller, step: BudgetStep, order: list) -> None:
    """Fill ``step``'s empty LLM bins with repeats, smallest samples first."""
    smallest = sorted(order, key=lambda i: (sum(filler.lengths[i]), i))
    for _ in range(step.empty_bins):
        next((i for i in smallest if filler.place(step, i, only_empty=True)), None)


def over_budget(
    lengths, patches: dict[str, int], max_tokens: int, max_patches=None, max_seq_len=None
) -> str | None:
    """Why a sample of these LLM sequence ``lengths`` and encoder ``patches`` fits no
    microbatch (``"has ..."``), or ``None``; ``max_patches``: a number, or per encoder
    part; ``max_seq_len``: packed rows (else unpacked).

    Example:
        >>> over_budget((10, 9), {}, max_tokens=16)  # a pair, padded to its longer answer
        'has 20 LLM tokens in a microbatch (2 rows x 10), more than max_tokens_per_microbatch=16'
    """
    shape = RowShape().add(lengths, max_seq_len)
    if shape.tokens > max_tokens:
        return (
            f"has {shape.tokens} LLM tokens in a microbatch ({shape.rows} rows x "
            f"{shape.width}), more than max_tokens_per_microbatch={max_tokens}"
        )
    for part, n in patches.items():
        cap = max_patches.get(part) if isinstance(max_patches, dict) else max_patches
        if cap is not None and n > cap:
            return f"has {n} {part} patches, more than {cap} (max_patches_per_microbatch)"
    return None
