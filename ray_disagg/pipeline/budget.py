"""Token-budget batching (``max_tokens_per_microbatch``): plans whose steps take the
samples that fit, instead of a fixed count (how the samples are chosen and placed:
:mod:`ray_disagg.pipeline.bins`): :class:`BudgetPlan` for map-style data (every step
computed from the samples' sizes, on every worker alike), :class:`StreamBudgetPlan` for a
conversation stream (each LLM leader fills its own microbatches as it reads).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from dataclasses import dataclass

import numpy as np

from ray_disagg.pipeline.assignment import BatchPlan, balanced_split, sample_order
from ray_disagg.pipeline.bins import BinFiller, BudgetStep, fill_steps, over_budget
from ray_disagg.pipeline.neighbours import band_split

__all__ = ["BudgetPlan", "BudgetedPlan", "StreamBudgetPlan"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BudgetedPlan(BatchPlan):
    """The budget's settings, shared by :class:`BudgetPlan` and :class:`StreamBudgetPlan`."""

    max_tokens: int = 0
    """LLM tokens per microbatch and replica, padding included (``max_tokens_per_microbatch``)."""
    max_patches: int | None = None
    """Input patches per microbatch and encoder replica (``max_patches_per_microbatch``)."""
    max_seq_len: int | None = None
    """Packed rows of this many tokens (``pack_sequences``); ``None``: unpacked."""

    def _encoders(self) -> dict[str, int]:
        """Each encoder group's data-parallel size."""
        return {g: n for g, n in self.dp_sizes.items() if g != self.reader_group}

    def caps(self) -> dict[str, int] | int | None:
        """The patch cap of a bin (per encoder part where it differs)."""
        return self.max_patches

    def over_budget(self, lengths, patches: dict[str, int]) -> str | None:
        """:func:`over_budget` under this plan's budget."""
        return over_budget(lengths, patches, self.max_tokens, self.caps(), self.max_seq_len)

    def filler(self, lengths, patches, max_samples: int, shape: tuple) -> BinFiller:
        caps = self.caps()
        return BinFiller(
            lengths, patches, self.max_tokens, caps, max_samples, shape, self.max_seq_len
        )


@dataclass(frozen=True)
class BudgetPlan(BudgetedPlan):
    """A :class:`~ray_disagg.pipeline.assignment.BatchPlan` whose steps take the samples
    that fit a token budget per microbatch (:func:`~ray_disagg.pipeline.bins.fill_epoch`);
    ``global_batch_size`` is the most samples a step takes. The epochs have different
    numbers of steps when shuffled. Validation uses one unshuffled epoch; DPO's
    precomputed reference pass one with ``cover`` (every sample, repeats in the last step).

    Example:
        >>> plan = BudgetPlan(num_samples=6, global_batch_size=8, dp_sizes={"text": 2},
        ...                   max_tokens=8, max_seq_len=8,
        ...                   lengths=[(6,), (2,), (3,), (5,), (1,), (7,)])
        >>> plan.global_indices(1), plan.assign(1)
        ([3, 4, 5], [{'text': [[0], [1, 2]]}])
    """

    lengths: list | None = None
    """Per dataset index: its LLM sequences' lengths (one, or a pair's two)."""
    patches: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    """Per encoder group, per dataset index: its tower's input patches."""
    cover: bool = False
    """Every sample in some step, once over (a forward-only pass: repeats fill the last)."""
    what: str = "training"
    """The samples' name in messages (``"validation"``)."""

    def __post_init__(self) -> None:
        bins = self.dp_sizes[self.reader_group] * self.micro_batches
        if self.global_batch_size < bins:
            raise ValueError(
                f"global_batch_size={self.global_batch_size} is below the {bins} microbatches "
                f"of a step ({self.reader_group} data-parallel size x micro_batches): with "
                "max_tokens_per_microbatch every microbatch needs a sample; raise it."
            )
        self._check_left_out(bins)
        self.__dict__.pop("_epochs")  # the workers compute their own (not pickled)
        self.__dict__.pop("_counts", None)

    def _check_left_out(self, bins: int) -> None:
        """Epoch 0 leaves out at most a step's worth of samples (warned above that;
        ``ValueError`` when more than half, or any with ``cover``)."""
        n = self.num_samples
        left = n - len({i for s in self.epoch_steps(0) for i in s.indices()})
        cap = f" and max_patches_per_microbatch={self.max_patches}" if self.max_patches else ""
        why = (
            f"{left} of the {n} {self.what} samples fit no step of {bins} microbatches within "
            f"max_tokens_per_microbatch={self.max_tokens}{cap}"
        )
        if left and self.cover or left > n / 2:
            raise ValueError(
                f"{why}: a patch cap that keeps samples with media from sharing a microbatch "
                "(fewer encoder replicas than LLM replicas, each LLM replica's samples "
                "encoded by its neighbouring encoder replicas) or too few samples; raise "
                "the cap or the budget, or add samples."
            )
        if left > self.global_batch_size:
            logger.warning("%s; they are left out of epoch 0.", why)

    @functools.cached_property
    def _epochs(self) -> dict[int, list[BudgetStep]]:
        return {}

    @functools.cached_property
    def _counts(self) -> list[int]:
        return []

    def epoch_steps(self, epoch: int) -> list[BudgetStep]:
        """The steps of ``epoch`` (computed once; every epoch's are alike unshuffled)."""
        key = epoch if self.shuffle else 0
        if key not in self._epochs:
            if len(self._epochs) >= 2:
                self._epochs.pop(min(self._epochs))
            order = sample_order(self.num_samples, self.seed, key) if self.shuffle else None
            shape = (self.micro_batches, self.dp_sizes[self.reader_group], self._encoders())
            filler = self.filler(self.lengths, self.patches, self.global_batch_size, shape)
            order = range(self.num_samples) if order is None else order
            self._epochs[key] = fill_steps(filler, order, cover=self.cover)
        return self._epochs[key]

    def _locate(self, step: int) -> tuple[int, int]:
        """``(epoch, step within it)``."""
        epoch = 0
        while True:
            if epoch == len(self._counts):
                self._counts.append(len(self.epoch_steps(epoch)))
            if step < self._counts[epoch]:
                return epoch, step
            step -= self._counts[epoch]
            epoch += 1

    def _step(self, step: int) -> BudgetStep:
        epoch, pos = self._locate(step)
        return self.epoch_steps(epoch)[pos]

    @property
    def steps_per_epoch(self) -> int:
        """Of the first epoch (shuffled epochs may differ)."""
        return len(self.epoch_steps(0))

    def epoch_of(self, step: int) -> int:
        return self._locate(step)[0]

    def global_indices(self, step: int) -> list[int]:
        return self._step(step).indices()

    def assign(self, step: int, step_costs=None) -> list[dict[str, list[list[int]]]]:
        """Per microbatch, per group, per replica: the batch positions of its bin."""
        s = self._step(step)
        position = {i: p for p, i in enumerate(s.indices())}
        out = []
        for j, llm in enumerate(s.llm):
            mb = {self.reader_group: [[position[i] for i in b] for b in llm]}
            for part, bins in s.encoders.items():
                mb[part] = [sorted(position[i] for i in b) for b in bins[j]]
            out.append(mb)
        return out

    def exchange_pairs(self, group: str, other: str) -> set[tuple[int, int]]:
        return self.neighbour_pairs(group, other)


@dataclass(frozen=True)
class StreamBudgetPlan(BudgetedPlan):
    """Token-budget batching of a conversation stream: each LLM leader fills its own
    ``micro_batches`` bins from its records (:class:`~ray_disagg.pipeline.bins.BinFiller`),
    so the step's layout is known once read: ``assign(step, layout)`` with ``layout =
    {"counts": [[samples of microbatch j] per leader], "costs": {part: the cost of each
    position}}`` (positions leader-major, then by microbatch). Without a patch cap the
    encoder replicas share each microbatch balanced by cost inside each leader's
    neighbourhood (:func:`~ray_disagg.pipeline.neighbours.band_split`); with one, each
    encoder replica serves fixed leaders (:meth:`serves`) and a leader's bin holds at
    most the cap over the leaders one replica serves (:meth:`caps`), so no replica
    exceeds it.
    Before the read (``layout=None``) every share is empty.

    Example:
        >>> plan = StreamBudgetPlan(num_samples=9, global_batch_size=8, max_tokens=64,
        ...                         dp_sizes={"vision": 1, "text": 2}, max_patches=100,
        ...                         reader="text")
        >>> plan.caps(), plan.assign(0, {"counts": [[2], [1]], "costs": {"vision": [1] * 3}})
        ({'vision': 50}, [{'text': [[0, 1], [2]], 'vision': [[0, 1, 2]]}])
    """

    def __post_init__(self) -> None:
        dp = self.dp_sizes[self.reader_group]
        if self.global_batch_size // dp < self.micro_batches:
            raise ValueError(
                f"global_batch_size={self.global_batch_size} leaves fewer samples per "
                f"{self.reader_group} replica ({self.global_batch_size // dp}) than "
                f"micro_batches={self.micro_batches}: with max_tokens_per_microbatch every "
                "microbatch needs a sample; raise it."
            )

    @property
    def per_replica(self) -> int:
        """The most samples one leader's step takes."""
        return self.global_batch_size // self.dp_sizes[self.reader_group]

    def epoch_of(self, step: int) -> int:
        """0: the stream's own epoch is reported (its source's ``epoch`` metric)."""
        return 0

    def caps(self) -> dict[str, int] | None:
        if self.max_patches is None:
            return None
        dp = self.dp_sizes[self.reader_group]
        return {g: self.max_patches // math.ceil(dp / n) for g, n in self._encoders().items()}

    def serves(self, part: str, e: int) -> list[int]:
        """The leaders whose samples replica ``e`` of encoder group ``part`` encodes
        under a patch cap, consecutive and among its neighbours: ``d * n // dp == e``
        (``n`` replicas, fewer than the leaders), or the one leader ``e * dp // n`` (as
        many or more: a leader's replicas share its samples)."""
        dp, n = self.dp_sizes[self.reader_group], self.dp_sizes[part]
        return [d for d in range(dp) if d * n // dp == e] if n < dp else [e * dp // n]

    def assign(self, step: int, step_costs=None) -> list[dict[str, list[list[int]]]]:
        reader, k = self.reader_group, self.micro_batches
        if step_costs is None:
            return [{g: [[] for _ in range(n)] for g, n in self.dp_sizes.items()}] * k
        counts, first = step_costs["counts"], 0
        out = [{reader: []} for _ in range(k)]
        for per_mb in counts:
            for j, n in enumerate(per_mb):
                out[j][reader].append(list(range(first, first + n)))
                first += n
        loads = {part: [0.0] * n for part, n in self._encoders().items()}  # over the step
        for mb in out:
            for part, n in self._encoders().items():
                cost = step_costs["costs"][part]
                mb[part] = self._split(part, n, mb[reader], cost, loads[part])
        return out

    def _split(self, part: str, n: int, shares: list[list[int]], cost, loads) -> list[list[int]]:
        """Microbatch positions over ``part``'s ``n`` replicas (see the class docstring)."""
        if self.max_patches is None:
            return band_split(shares, cost, n, loads)
        out = [[] for _ in range(n)]
        for d, share in enumerate(shares):
            mine = [e for e in range(n) if d in self.serves(part, e)]
            costs = [float(cost[p]) for p in share]
            for e, got in zip(mine, balanced_split(share, costs, len(mine), equal_counts=False)):
                out[e] += got
        assert sum(map(len, out)) == sum(map(len, shares))
        return [sorted(o) for o in out]
