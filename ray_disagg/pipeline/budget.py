"""Token-budget batching (``max_tokens_per_microbatch``): plans whose steps take the
samples that fit, instead of a fixed count (how the samples are chosen and placed:
:mod:`ray_disagg.pipeline.bins`): :class:`BudgetPlan` for map-style data (every step
computed from the samples' sizes, on every worker alike), :class:`StreamBudgetPlan` for a
conversation stream (each LLM leader fills its own microbatches as it reads).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import numpy as np

from ray_disagg.pipeline.assignment import BatchPlan, balanced_split, sample_order
from ray_disagg.pipeline.bins import BinFiller, BudgetStep, fill_steps, over_budget

__all__ = ["BudgetPlan", "BudgetedPlan", "StreamBudgetPlan", "fixed_batch_size"]


@dataclass(frozen=True)
class BudgetedPlan(BatchPlan):
    """The budget's settings, shared by :class:`BudgetPlan` and :class:`StreamBudgetPlan`."""

    max_tokens: int = 0
    """LLM tokens per microbatch and replica, padding included (``max_tokens_per_microbatch``)."""
    max_patches: int | None = None
    """Input patches per microbatch and encoder replica (``max_patches_per_microbatch``)."""
    max_seq_len: int | None = None
    """Packed rows of this many tokens (``pack_sequences``); ``None``: unpacked."""

    def over_budget(self, lengths, patches: dict[str, int]) -> str | None:
        """:func:`over_budget` under this plan's budget."""
        return over_budget(lengths, patches, self.max_tokens, self.max_patches, self.max_seq_len)

    def filler(self, lengths, patches, max_samples: int, shape: tuple) -> BinFiller:
        cap = math.inf if self.max_patches is None else self.max_patches
        return BinFiller(
            lengths, patches, self.max_tokens, cap, max_samples, shape, self.max_seq_len
        )


@dataclass(frozen=True)
class BudgetPlan(BudgetedPlan):
    """A :class:`~ray_disagg.pipeline.assignment.BatchPlan` whose steps take the samples
    that fit a token budget per microbatch (:func:`fill_epoch`); ``global_batch_size`` is
    the most samples a step takes. The epochs have different numbers of steps when
    shuffled.

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

    def __post_init__(self) -> None:
        bins = self.dp_sizes[self.reader_group] * self.micro_batches
        if self.global_batch_size < bins:
            raise ValueError(
                f"global_batch_size={self.global_batch_size} is below the {bins} microbatches "
                f"of a step ({self.reader_group} data-parallel size x micro_batches): with "
                "max_tokens_per_microbatch every microbatch needs a sample; raise it."
            )
        if not self.epoch_steps(0):
            cap = f" and max_patches_per_microbatch={self.max_patches}" if self.max_patches else ""
            raise ValueError(
                f"No step of {bins} microbatches fits the {self.num_samples} training samples "
                f"within max_tokens_per_microbatch={self.max_tokens}{cap}: add samples, or "
                "raise the budget."
            )
        self.__dict__.pop("_epochs")  # the workers compute their own (not pickled)

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
            encoders = {g: n for g, n in self.dp_sizes.items() if g != self.reader_group}
            shape = (self.micro_batches, self.dp_sizes[self.reader_group], encoders)
            filler = self.filler(self.lengths, self.patches, self.global_batch_size, shape)
            self._epochs[key] = fill_steps(
                filler, range(self.num_samples) if order is None else order
            )
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
        return {(a, b) for a in range(self.dp_sizes[group]) for b in range(self.dp_sizes[other])}


def fixed_batch_size(cfg, dp_sizes: dict[str, int]) -> int:
    """The samples of a fixed-size batch under ``cfg``: ``global_batch_size``; with a
    token budget (where it need not divide evenly) the largest multiple of every group's
    data-parallel size x ``micro_batches`` up to it (validation batches and DPO's
    reference pass, both forward only).

    Example:
        >>> from types import SimpleNamespace as NS
        >>> fixed_batch_size(NS(global_batch_size=7, micro_batches=1,
        ...                     max_tokens_per_microbatch=512), {"vision": 2, "text": 3})
        6
    """
    b = cfg.global_batch_size
    if cfg.max_tokens_per_microbatch is None:
        return b
    unit = math.lcm(*dp_sizes.values()) * cfg.micro_batches
    return max(unit, b - b % unit)


@dataclass(frozen=True)
class StreamBudgetPlan(BudgetedPlan):
    """Token-budget batching of a conversation stream: each LLM leader fills its own
    ``micro_batches`` bins from its records (:class:`BinFiller`, its ``max_patches`` per
    bin), so the step's layout is known once read: ``assign(step, layout)`` with
    ``layout = {"counts": [[samples of microbatch j] per leader], "costs": {encoder part:
    the cost of each position}}`` (positions leader-major, then by microbatch); the
    encoder replicas share each microbatch balanced by cost. Before the read
    (``layout=None``) every share is empty."""

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
        for mb in out:
            union = sorted(p for share in mb[reader] for p in share)
            for part in self.dp_sizes:
                if part == reader:
                    continue
                costs = [float(step_costs["costs"][part][p]) for p in union]
                mb[part] = balanced_split(union, costs, self.dp_sizes[part], equal_counts=False)
        return out
