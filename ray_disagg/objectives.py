"""Training objectives that take per-sequence log-probabilities: the interface the loops
call (:class:`Objective`) and Direct Preference Optimization (:class:`DPO`).

Without an objective (``train_loop_config["objective"]`` unset) the LLM trains on the
token cross-entropy (SFT). With one, each sample of the dataset holds one or more
sequences (:meth:`Objective.sequences`; DPO: the chosen and the rejected answer to one
prompt, whose images the encoders encode once); the LLM group computes, for every
microbatch, each sequence's summed log-probability of its label tokens through the same
label-position, chunked, vocab-parallel, packed and context-parallel path as the SFT loss,
and the reference model's when the objective asks for one, and hands them to
:meth:`Objective.loss`. The loops know nothing else about the objective: a new one (e.g.
per-sample advantages for GRPO-style training, read from a sample field listed in
:attr:`Objective.fields`) is a subclass.

Example:
    >>> from ray_disagg import DPO
    >>> DPO(beta=0.1).loss_type
    'sigmoid'
    >>> DPO(beta=0.0)
    Traceback (most recent call last):
    ...
    ValueError: train_loop_config['objective'] DPO(beta=0.0): must be a finite float > 0.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np
import torch
import torch.nn.functional as F

from ray_disagg.models.base import IGNORE_INDEX, SampleError, sample_name
from ray_disagg.settings import check_settings, setting

__all__ = ["DPO", "Objective", "SequenceLogps", "objective_from_any"]


@dataclass(frozen=True)
class SequenceLogps:
    """What :meth:`Objective.loss` gets for one LLM microbatch (on every rank of the
    replica; tensors on the LLM's device)."""

    policy: torch.Tensor
    """``(n,)`` float32: each sequence's summed log-probability of its label tokens under
    the trained model, with gradients; sequences in sample order, each sample's
    :meth:`Objective.sequences` together."""
    reference: torch.Tensor | None
    """``(n,)`` float32, no gradients: the same under the reference model, or ``None``
    when the objective needs none."""
    tokens: torch.Tensor
    """``(n,)`` float32: each sequence's number of label tokens."""
    samples: list[dict]
    """The microbatch's samples: ``id`` and the keys of :attr:`Objective.fields`."""
    global_samples: float
    """Samples in the step's global batch (over every data-parallel replica): a loss that
    is a mean over the global batch sums its samples' terms divided by this."""


class Objective:
    """The interface of a per-sequence objective.

    A subclass says how a sample splits into sequences (:meth:`sequences`), which sample
    keys the LLM needs (:attr:`sequence_keys`, :attr:`fields`), whether it needs the
    reference model's log-probabilities (:attr:`needs_reference`), and computes the loss
    and metrics of one microbatch (:meth:`loss`). The loss of the step is the sum of its
    microbatches' losses (over replicas too); the gradients are those of that sum.

    Example (a REINFORCE-style objective on a per-sample ``advantage``):
        >>> class Reinforce(Objective):
        ...     fields = ("advantage",)
        ...     metric_names = ("advantage",)
        ...     def loss(self, logps):
        ...         adv = [s["advantage"] for s in logps.samples]
        ...         adv = torch.tensor(adv, device=logps.policy.device)
        ...         loss = -(adv * logps.policy).sum() / logps.global_samples
        ...         return loss, {"advantage": adv.sum()}
    """

    sequence_keys: ClassVar[tuple[str, ...]] = ("input_ids", "labels")
    """Sample keys holding the sequences' tokens (read by the LLM group)."""
    fields: ClassVar[tuple[str, ...]] = ()
    """Further sample keys the loss reads (handed over in :attr:`SequenceLogps.samples`)."""
    metric_names: ClassVar[tuple[str, ...]] = ()
    """Metrics :meth:`loss` returns as sums over its samples; reported per step as means
    over the global batch, under these names."""
    needs_reference: bool = False
    """Whether :meth:`loss` needs :attr:`SequenceLogps.reference`."""
    reference: str = "copy"
    """How the reference model is held (see :attr:`DPO.reference`)."""

    def sequences(self, sample: dict) -> list[dict]:
        """The sample's sequences (each a dict with ``input_ids`` and ``labels``, plus the
        sample's other keys), in the order of :attr:`SequenceLogps.policy`."""
        return [sample]

    def check_sample(self, sample: dict, index: int | None = None) -> None:
        """Raise :class:`~ray_disagg.SampleError` naming a sample this objective cannot
        train on (called on the driver for map-style data, before the run)."""
        missing = [k for k in (*self.sequence_keys, *self.fields) if sample.get(k) is None]
        if missing:
            raise SampleError(f"{sample_name(sample, index)} has no {missing}.")

    def loss(self, logps: SequenceLogps) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The microbatch's share of the step's loss (a scalar with gradients) and
        ``{metric: sum over the microbatch's samples}`` (0-d tensors, no gradients)."""
        raise NotImplementedError


LossType = Literal["sigmoid", "hinge", "ipo", "robust"]
Reference = Literal["auto", "copy", "adapters_disabled", "precompute"]
ANSWERS = ("chosen", "rejected")
PAIR_KEYS = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")


def same_prompt(pair: dict) -> bool:
    """Whether a pair's two sequences start with the same prompt: the same tokens before
    each one's first label."""
    prompts = []
    for a in ANSWERS:
        labels = np.asarray(pair[f"{a}_labels"])
        prompts.append(np.asarray(pair[f"{a}_input_ids"])[: int(np.argmax(labels != IGNORE_INDEX))])
    return prompts[0].shape == prompts[1].shape and bool((prompts[0] == prompts[1]).all())


@dataclass(kw_only=True)
class DPO(Objective):
    """Direct Preference Optimization on (chosen, rejected) answer pairs, with TRL's
    (``trl.DPOTrainer``) meanings and formulas.

    A sample is one pair: the prompt's media fields (encoded once for both answers) and
    ``chosen_input_ids`` / ``chosen_labels`` / ``rejected_input_ids`` /
    ``rejected_labels``, the two full sequences (prompt + answer) with labels on the
    answer only. ``global_batch_size`` counts pairs.

    Example:
        >>> train_loop_config = {"max_steps": 10, "global_batch_size": 4,
        ...                      "objective": DPO(beta=0.1, loss_type="ipo")}
    """

    beta: float = setting(0.1, gt=0)
    """How far the policy may move from the reference (TRL's ``beta``; IPO's ``tau``)."""

    loss_type: LossType = setting("sigmoid")
    """``"sigmoid"`` (DPO), ``"hinge"`` (SLiC), ``"ipo"`` (IPO, on the log-ratios averaged
    over each answer's label tokens, as TRL) or ``"robust"`` (Robust DPO with
    ``label_smoothing`` the flip probability)."""

    label_smoothing: float = setting(0.0, ge=0, lt=0.5)
    """The probability that a preference label is flipped (``loss_type="robust"`` only)."""

    reference: Reference = setting("auto")
    """The reference model: ``"adapters_disabled"``, the trained model with its LoRA
    adapters off (no extra memory; when every trained part has a fresh LoRA adapter with
    ``lora_B`` at zero and no ``modules_to_save``, so that it is the initial model);
    ``"copy"``, a frozen copy of the trained parts' initial weights held by the same
    workers with the same sharding (parameters only); ``"precompute"``: one forward-only
    pass with the initial weights over every training pair before the first step, its
    log-probs kept by each pair's ``id`` (saved with every checkpoint: a resumed run does
    not recompute them); ``"auto"``: the first of ``"adapters_disabled"`` and ``"copy"``
    that applies (decided on the driver). A frozen part is its own reference."""

    sequence_keys: ClassVar[tuple[str, ...]] = PAIR_KEYS
    metric_names: ClassVar[tuple[str, ...]] = (
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
    )
    needs_reference: ClassVar[bool] = True

    def __post_init__(self) -> None:
        check_settings(self, self._where)
        if self.label_smoothing and self.loss_type != "robust":
            raise ValueError(
                f"{self._where('label_smoothing', self.label_smoothing)}: label smoothing "
                f"applies to loss_type='robust' only (TRL's meaning); set "
                f"loss_type='robust' or label_smoothing=0."
            )

    @staticmethod
    def _where(name: str, value) -> str:
        return f"train_loop_config['objective'] DPO({name}={value!r})"

    def sequences(self, sample: dict) -> list[dict]:
        rest = {k: v for k, v in sample.items() if k not in PAIR_KEYS}
        return [
            {**rest, "input_ids": sample[f"{a}_input_ids"], "labels": sample[f"{a}_labels"]}
            for a in ANSWERS
        ]

    def check_sample(self, sample: dict, index: int | None = None) -> None:
        name = sample_name(sample, index)
        missing = [k for k in PAIR_KEYS if sample.get(k) is None]
        if missing:
            sft = (
                " (an SFT sample: train it without the DPO objective)"
                if "input_ids" in sample
                else ""
            )
            raise SampleError(
                f"{name} has no {missing}{sft}; a DPO sample is a pair {list(PAIR_KEYS)}."
            )
        chosen, rejected = (
            np.asarray(sample[k]) for k in ("chosen_input_ids", "rejected_input_ids")
        )
        for answer in ANSWERS:
            if not (np.asarray(sample[f"{answer}_labels"]) != IGNORE_INDEX).any():
                raise SampleError(f"{name}: the {answer} answer is empty (no label token).")
        key = sample.get("id")
        if self.reference == "precompute" and not isinstance(key, (int, str, np.integer)):
            raise SampleError(
                f"{name} has no int or str 'id' (got {key!r}): DPO(reference='precompute') "
                "keeps each pair's reference log-probs by its id; give every pair a unique "
                "'id' (e.g. its row number)."
            )
        if chosen.shape == rejected.shape and (chosen == rejected).all():
            raise SampleError(f"{name}: chosen and rejected are identical; drop the pair.")
        if not same_prompt(sample):
            raise SampleError(
                f"{name}: the prompt (the tokens before the first label) differs between "
                "chosen and rejected; both answers must follow the same prompt tokens."
            )

    def loss(self, logps: SequenceLogps) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        policy, ref, tokens = (t.view(-1, 2) for t in (logps.policy, logps.reference, logps.tokens))
        chosen_ratio, rejected_ratio = (policy - ref).unbind(1)
        delta = chosen_ratio - rejected_ratio
        b = self.beta
        if self.loss_type == "sigmoid":
            losses = -F.logsigmoid(b * delta)
        elif self.loss_type == "hinge":
            losses = torch.relu(1 - b * delta)
        elif self.loss_type == "ipo":  # TRL: the log-ratios averaged over the answer's tokens
            avg = (policy - ref) / tokens.clamp(min=1.0)
            losses = (avg[:, 0] - avg[:, 1] - 1 / (2 * b)) ** 2
        else:  # robust
            e = self.label_smoothing
            losses = (-(1 - e) * F.logsigmoid(b * delta) + e * F.logsigmoid(-b * delta)) / (
                1 - 2 * e
            )
        rewards = b * (policy - ref).detach()
        metrics = {
            "rewards/chosen": rewards[:, 0].sum(),
            "rewards/rejected": rewards[:, 1].sum(),
            "rewards/accuracies": (rewards[:, 0] > rewards[:, 1]).float().sum(),
            "rewards/margins": (rewards[:, 0] - rewards[:, 1]).sum(),
            "logps/chosen": policy[:, 0].detach().sum(),
            "logps/rejected": policy[:, 1].detach().sum(),
        }
        return losses.sum() / logps.global_samples, metrics


OBJECTIVES = {"dpo": DPO}


def objective_from_any(value: Any) -> Objective | None:
    """An :class:`Objective`, or one from a dict such as ``{"type": "dpo", "beta": 0.1}``
    (the recipe form); ``None`` (SFT) stays ``None``."""
    if value is None or isinstance(value, Objective):
        return value
    if isinstance(value, dict) and value.get("type") in OBJECTIVES:
        cls = OBJECTIVES[value["type"]]
        kwargs = {k: v for k, v in value.items() if k != "type"}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(
                f"train_loop_config['objective']: unknown keys {unknown} for "
                f"type={value['type']!r}; known keys are {sorted(known)}."
            )
        return cls(**kwargs)
    raise ValueError(
        f"train_loop_config['objective']={value!r}: give an Objective (e.g. "
        f"ray_disagg.DPO(beta=0.1)), a dict with 'type' one of {sorted(OBJECTIVES)}, "
        "or None for SFT."
    )
