"""The interface of a training objective on the LLM's per-token log-probabilities
(:class:`Objective`) and what it gets for each microbatch (:class:`TokenLogps`).

Without an objective (``train_loop_config["objective"]`` unset) the LLM trains on the
token cross-entropy (SFT). With one, each sample of the dataset holds one or more
sequences (:meth:`Objective.sequences`: DPO's chosen and rejected answer, GRPO's
completions of one prompt), whose media the encoders encode once. For every microbatch
the LLM group computes the log-probability of each label token (the logits divided by
:attr:`Objective.temperature`) through the same label-position, chunked, vocab-parallel,
packed and context-parallel path as the SFT loss, the reference model's when the
objective asks for one, and hands them to :meth:`Objective.loss`. The loops know nothing
else about the objective: a new one is a subclass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ray_disagg.models.base import SampleError, sample_name
from ray_disagg.parallel.context_parallel import AllReduceOverContext

__all__ = ["Objective", "TokenLogps", "objective_from_any"]


@dataclass(frozen=True, kw_only=True)
class TokenLogps:
    """What :meth:`Objective.loss` gets for one LLM microbatch on one rank of a replica
    (tensors on the LLM's device).

    Under context parallelism each rank holds a slice of every sequence's tokens, and
    the replica's loss (and each metric) is the **sum of what its ranks return**: a term
    over tokens is this rank's tokens' share as it is; a term computed from per-sequence
    totals (:meth:`sequence_sum`, :meth:`totals`) is the same on every rank and is
    multiplied by :attr:`whole` (1 on one rank, 0 on the others; multiply, never branch
    on it: every rank must run the same backward). Without context parallelism
    :attr:`whole` is 1 and the sums are plain."""

    policy: torch.Tensor
    """``(n,)`` float32: the log-probability of each label token this rank holds under the
    trained model, with gradients (its logits divided by the objective's temperature)."""
    reference: torch.Tensor | None
    """``(n,)`` float32, no gradients: the same under the reference model, or ``None``
    when the objective needs none (or the reference's totals were precomputed)."""
    old: torch.Tensor | None
    """``(n,)`` float32, no gradients: the policy's before its first update on this
    step's samples (an objective with ``num_iterations > 1``, after the first iteration),
    else ``None`` (the policy's own values, detached, are the old ones)."""
    sequence: torch.Tensor
    """``(n,)`` int64: the sequence of each label token (an index into :attr:`tokens`)."""
    tokens: torch.Tensor
    """``(S,)`` float32: each sequence's label tokens (over all context-parallel ranks);
    sequences in sample order, each sample's :meth:`Objective.sequences` together."""
    samples: list[dict]
    """The microbatch's samples: ``id`` and the keys of :attr:`Objective.fields`."""
    positions: list[int]
    """Each sample's position in the step's global batch (its index in the batch that
    :meth:`Objective.prepare_step` got)."""
    global_samples: float
    """Samples in the step's global batch (over every data-parallel replica)."""
    global_sequences: float
    """Sequences in the step's global batch."""
    global_tokens: float
    """Label tokens in the step's global batch."""
    step: Any = None
    """What :meth:`Objective.prepare_step` returned for this step (``None`` without)."""
    whole: float = 1.0
    """1.0 on the rank that adds the terms computed from per-sequence totals, else 0.0."""
    group: Any = None
    """The replica's context-parallel process group (``None``: no context parallelism)."""
    reference_totals: torch.Tensor | None = None
    """``(S,)``: each sequence's reference log-probability when it was computed before
    training (``DPO(reference="precompute")``), else ``None``."""

    def sequence_sum(self, values: torch.Tensor) -> torch.Tensor:
        """``(S,)``: ``values`` (one per label token of this rank) summed per sequence and
        over the context-parallel ranks, with gradients to every rank's tokens."""
        sums = values.new_zeros(len(self.tokens)).index_add(0, self.sequence, values)
        return sums if self.group is None else AllReduceOverContext.apply(sums, self.group)

    def totals(self, which: str = "policy") -> torch.Tensor:
        """``(S,)``: each sequence's summed log-probability of its label tokens under the
        ``"policy"`` or the ``"reference"``."""
        if which == "reference" and self.reference_totals is not None:
            return self.reference_totals
        return self.sequence_sum(getattr(self, which))


class Objective:
    """The interface of an objective on per-token log-probabilities.

    A subclass says how a sample splits into sequences (:meth:`sequences`), which sample
    keys the LLM needs (:attr:`sequence_keys`, :attr:`fields`), whether it needs the
    reference model's log-probabilities (:attr:`needs_reference`), and computes the loss
    and metrics of one microbatch (:meth:`loss`). The loss of the step is the sum of its
    microbatches' losses (over replicas and context-parallel ranks too); the gradients
    are those of that sum. So is each metric: a microbatch returns its share of the
    step's value (e.g. a sum over its samples divided by
    :attr:`TokenLogps.global_samples`). Values of the whole step (from every sample of
    the global batch, e.g. group statistics of rewards) come from :meth:`prepare_step`.

    Example (a REINFORCE-style objective on a per-sample ``advantage``):
        >>> class Reinforce(Objective):
        ...     fields = ("advantage",)
        ...     metric_names = ("advantage",)
        ...     def loss(self, logps):
        ...         adv = torch.tensor([s["advantage"] for s in logps.samples])
        ...         adv = adv.to(logps.policy.device, non_blocking=True)
        ...         per_token = adv[logps.sequence] * logps.policy
        ...         loss = -per_token.sum() / logps.global_samples
        ...         return loss, {"advantage": logps.whole * adv.sum() / logps.global_samples}
    """

    sequence_keys: ClassVar[tuple[str, ...]] = ("input_ids", "labels")
    """Sample keys holding the sequences' tokens (read by the LLM group)."""
    fields: ClassVar[tuple[str, ...]] = ()
    """Further sample keys the loss reads (handed over in :attr:`TokenLogps.samples`)."""
    step_keys: ClassVar[tuple[str, ...]] = ()
    """Sample keys :meth:`prepare_step` reads, of every sample of the global batch."""
    generates: ClassVar[bool] = False
    """The training groups generate each step's sequences (GRPO's rollouts)."""
    metric_names: ClassVar[tuple[str, ...]] = ()
    """Metrics :meth:`loss` returns as shares of the step's value (summed over the
    step's microbatches, replicas and ranks), under these names."""
    step_metric_names: ClassVar[tuple[str, ...]] = ()
    """Metrics :meth:`prepare_step` returns (the step's values)."""
    needs_reference: bool = False
    """Whether :meth:`loss` needs :attr:`TokenLogps.reference`."""
    reference: str = "copy"
    """How the reference model is held (see :attr:`DPO.reference`)."""
    temperature: float = 1.0
    """The log-probabilities are those of the logits divided by this."""
    num_iterations: int = 1
    """Consecutive optimizer steps on each global batch (the first one's log-probs are
    :attr:`TokenLogps.old` in the others)."""
    sequences_per_sample: int = 1
    """Sequences in each sample (for estimates)."""

    def sequences(self, sample: dict) -> list[dict]:
        """The sample's sequences (each a dict with ``input_ids`` and ``labels``, plus the
        sample's other keys), in the order of :attr:`TokenLogps.tokens`."""
        return [sample]

    def check_sample(self, sample: dict, index: int | None = None) -> None:
        """Raise :class:`~ray_disagg.SampleError` naming a sample this objective cannot
        train on (called on the driver for map-style data, before the run)."""
        missing = [k for k in (*self.sequence_keys, *self.fields) if sample.get(k) is None]
        if missing:
            raise SampleError(f"{sample_name(sample, index)} has no {missing}.")

    def prepare_step(self, batch: list[dict]) -> tuple[Any, dict[str, float]]:
        """``(what every microbatch's loss gets as TokenLogps.step, the step's metrics
        named in step_metric_names)`` from ``batch``: the :attr:`step_keys` and ``id`` of
        every sample of the global batch, in batch order (the same on every LLM rank;
        :attr:`TokenLogps.positions` index it)."""
        return None, {}

    def loss(self, logps: TokenLogps) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The microbatch's share of the step's loss (a scalar with gradients) and
        ``{metric: share of the step's value}`` (0-d tensors, no gradients)."""
        raise NotImplementedError


def objective_from_any(value: Any, known: dict[str, type]) -> Objective | None:
    """An :class:`Objective`, or one of the classes ``known`` by type name from a dict
    such as ``{"type": "dpo", "beta": 0.1}`` (the recipe form); ``None`` (SFT) stays
    ``None``."""
    if value is None or isinstance(value, Objective):
        return value
    if isinstance(value, dict) and value.get("type") in known:
        cls = known[value["type"]]
        kwargs = {k: v for k, v in value.items() if k != "type"}
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(
                f"train_loop_config['objective']: unknown keys {unknown} for "
                f"type={value['type']!r}; known keys are {sorted(names)}."
            )
        return cls(**kwargs)
    raise ValueError(
        f"train_loop_config['objective']={value!r}: give an Objective (e.g. "
        f"ray_disagg.DPO(beta=0.1)), a dict with 'type' one of {sorted(known)}, "
        "or None for SFT."
    )
