"""Direct Preference Optimization (:class:`DPO`): on each pair's summed log-probabilities
of the chosen and the rejected answer (the prompt's images encoded once for both).

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

from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np
import torch
import torch.nn.functional as F

from ray_disagg.config.settings import check_settings, setting
from ray_disagg.models.base import IGNORE_INDEX, SampleError, sample_name
from ray_disagg.objectives.base import Objective, TokenLogps

__all__ = ["ANSWERS", "DPO", "PAIR_KEYS", "same_prompt"]


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
    sequences_per_sample: ClassVar[int] = 2

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

    def loss(self, logps: TokenLogps) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        policy = logps.totals("policy").view(-1, 2)
        ref = logps.totals("reference").view(-1, 2)
        tokens = logps.tokens.view(-1, 2)
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
        sums = {
            "rewards/chosen": rewards[:, 0].sum(),
            "rewards/rejected": rewards[:, 1].sum(),
            "rewards/accuracies": (rewards[:, 0] > rewards[:, 1]).float().sum(),
            "rewards/margins": (rewards[:, 0] - rewards[:, 1]).sum(),
            "logps/chosen": policy[:, 0].detach().sum(),
            "logps/rejected": policy[:, 1].detach().sum(),
        }
        share = logps.whole / logps.global_samples  # means over the global batch's pairs
        return losses.sum() * share, {k: v * share for k, v in sums.items()}
