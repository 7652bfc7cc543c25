"""Group Relative Policy Optimization (:class:`GRPO`) and its variants (Dr. GRPO, DAPO,
BNPO, GSPO), with TRL's (``trl.GRPOConfig`` / ``GRPOTrainer``) names, defaults and
formulas, on the LLM's per-token log-probabilities of each prompt's completions.

A sample is one prompt with its ``num_generations`` completions: the prompt's media
fields (encoded once for all of them), ``prompt_input_ids`` (the prompt after the chat
template with the generation prompt), ``completion_ids`` (each completion's tokens,
its end-of-turn token included when it stopped), ``rewards`` (``{reward function name:
one value per completion}``, ``None`` where a function does not apply) and
``truncated`` (per completion: it reached ``max_completion_length`` without stopping).
``global_batch_size`` counts prompts; with ``num_iterations > 1`` each batch's reward and
length metrics are reported at each of its steps.

Where TRL's normalisers depend on the process layout (``bnpo`` over each process's
batch, ``grpo`` divided by the accumulation steps) they are taken over the global batch
here, so every layout trains the same model: ``grpo`` is the mean over the global
batch's completions of each completion's mean token loss, ``bnpo`` equals ``dapo`` (the
global batch's completion tokens), ``dr_grpo`` divides by the completions times
``max_completion_length``; the metrics are means over the global batch.

Example:
    >>> def exact(prompts, completions, solution, **kwargs):
    ...     return [float(c[0]["content"] == s) for c, s in zip(completions, solution)]
    >>> GRPO(reward_funcs=[exact], num_generations=4).metric_names[:3]
    ('clip_ratio/low_mean', 'clip_ratio/high_mean', 'clip_ratio/region_mean')
    >>> GRPO(reward_funcs=[exact], num_generations=1)
    Traceback (most recent call last):
    ...
    ValueError: train_loop_config['objective'] GRPO(num_generations=1): must be an int >= 2.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from ray_disagg.config.settings import check_settings, setting
from ray_disagg.models.base import IGNORE_INDEX, SampleError, sample_name
from ray_disagg.models.packing import host_to_device
from ray_disagg.objectives.base import Objective, TokenLogps
from ray_disagg.objectives.reward_funcs import (
    check_reward_func,
    missing_columns,
    resolve,
    reward_means,
    reward_name,
    reward_sums,
)

__all__ = ["GRPO", "ROLLOUT_KEYS", "GRPOStep", "nanstd", "reward_name"]

ROLLOUT_KEYS = ("prompt_input_ids", "completion_ids")
"""A replayed rollout's token keys."""
LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo"]
CLIPS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
LENGTHS = ("mean_length", "min_length", "max_length", "clipped_ratio", "mean_terminated_length",
           "min_terminated_length", "max_terminated_length")  # fmt: skip


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The standard deviation ignoring NaNs, with Bessel's correction (NaN where fewer
    than two values), as TRL's."""
    keep = dim is not None
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=keep)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=keep)
    var = torch.where(count > 1, var * count / (count - 1), torch.full_like(var, float("nan")))
    return var.sqrt()


@dataclass(frozen=True)
class GRPOStep:
    """A step's values from its whole global batch (:meth:`GRPO.prepare_step`)."""

    advantages: list[list[float]]
    """Per batch position, each completion's advantage."""
    kept: list[list[float]]
    """Per batch position, 1.0 for each completion in the loss (0.0: a truncated one
    masked)."""
    sequences: float
    """Completions in the global batch."""
    tokens: float
    """Completion tokens in the loss over the global batch."""


@dataclass(kw_only=True)
class GRPO(Objective):
    """Group Relative Policy Optimization with TRL's meanings (see the module)."""

    reward_funcs: tuple = dataclasses.field(default=())
    """Reward functions as TRL calls them (``fn(prompts=, completions=, completion_ids=,
    **columns) -> list[float | None]``), or ``"module:function"``; metrics under their
    ``__name__``."""
    reward_weights: tuple[float, ...] | None = None
    """Each reward function's weight in the summed reward (``None``: 1.0 each)."""
    num_generations: int = setting(8, ge=2)
    """Completions per prompt (a group)."""
    max_completion_length: int = setting(512, ge=1)
    """Most tokens per completion (``dr_grpo``'s normaliser)."""
    temperature: float = setting(1.0, gt=0)
    """Sampling temperature; the log-probabilities of the loss divide the logits by it."""
    top_p: float = setting(1.0, gt=0, le=1)
    """Nucleus sampling's probability mass (1.0: off)."""
    top_k: int = setting(0, ge=0)
    """Sample among the ``top_k`` most likely tokens (0: off)."""
    beta: float = setting(0.0, ge=0)
    """The KL penalty's coefficient (k3 estimator); > 0 runs the reference model."""
    epsilon: float = setting(0.2, gt=0)
    """The ratio's lower clipping bound ``1 - epsilon``."""
    epsilon_high: float | None = setting(None, gt=0)
    """The upper bound ``1 + epsilon_high`` (``None``: ``epsilon``; DAPO: 0.28)."""
    loss_type: LossType = setting("dapo")
    """How token losses are aggregated: ``"grpo"``, ``"bnpo"``, ``"dr_grpo"``, ``"dapo"``."""
    scale_rewards: Literal["group", "batch", "none"] = setting("group")
    """Advantages divided by the group's reward std, the batch's, or not at all (TRL's
    ``True`` / ``False``: ``"group"`` / ``"none"``)."""
    importance_sampling_level: Literal["token", "sequence"] = setting("token")
    """The importance ratio per token, or per completion (GSPO)."""
    num_iterations: int = setting(1, ge=1)
    """Optimizer steps on each batch of completions (TRL's mu)."""
    mask_truncated_completions: bool = setting(False)
    """Leave completions that reached ``max_completion_length`` out of the loss."""
    reference: Literal["auto", "copy", "adapters_disabled"] = setting("auto")
    """The reference model when ``beta > 0`` (see :attr:`DPO.reference`)."""
    rollouts: Literal["auto", "generate", "recorded"] = setting("auto")
    """Where a step's completions come from: ``"generate"``: the training groups sample
    them from the prompts (each sample a prompt: ``input_ids`` after the chat template
    with the generation prompt, its media fields and the columns the reward functions
    read); ``"recorded"``: the samples carry them (``prompt_input_ids``,
    ``completion_ids``, ``rewards``, ``truncated``: a replay); ``"auto"``: recorded when
    the first sample of a map-style dataset has ``completion_ids``, else generated."""
    reward_workers: int = setting(0, ge=0)
    """Score each replica's completions in this many Ray tasks (one CPU each; for slow
    verifiers) instead of on the LLM group's leaders (0)."""
    tokenizer: object = None
    """What decodes completions for the reward functions: a local tokenizer directory or
    a loaded tokenizer (``None``: the model's ``pretrained_path``)."""

    sequence_keys = ROLLOUT_KEYS
    fields = ("rewards", "truncated")
    step_keys = ("rewards", "truncated", "completion_ids")

    def __post_init__(self) -> None:
        if isinstance(self.scale_rewards, bool):  # TRL's True / False
            self.scale_rewards = "group" if self.scale_rewards else "none"
        if callable(self.reward_funcs) or isinstance(self.reward_funcs, str):
            self.reward_funcs = (self.reward_funcs,)
        self.reward_funcs = tuple(self.reward_funcs or ())
        if not self.reward_funcs:
            raise ValueError(f"{self._where('reward_funcs', [])}: give at least one function.")
        for fn in self.reward_funcs:
            check_reward_func(fn)
        check_settings(self, self._where)
        n, weights = len(self.reward_funcs), self.reward_weights
        if weights is None:
            return
        if isinstance(weights, (str, bytes)) or not hasattr(weights, "__len__"):
            weights = [weights]
        ok = all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in weights)
        if not ok or len(weights) != n or not all(math.isfinite(w) for w in weights):
            raise ValueError(
                f"{self._where('reward_weights', self.reward_weights)}: one finite number "
                f"per reward function ({n}), or None (1.0 each)."
            )
        self.reward_weights = tuple(float(w) for w in weights)

    @staticmethod
    def _where(name: str, value) -> str:
        return f"train_loop_config['objective'] GRPO({name}={value!r})"

    @property
    def reward_names(self) -> tuple[str, ...]:
        return tuple(reward_name(f) for f in self.reward_funcs)

    def reward_callables(self) -> list:
        """The reward functions as callables (``"module:function"`` imported)."""
        return [resolve(f) for f in self.reward_funcs]

    def check_columns(self, sample: dict, index: int | None = None) -> None:
        """A prompt ``sample`` has every column a reward function names without a default
        (TRL passes the record's columns as keywords); ``SampleError`` naming both."""
        for fn, name in zip(self.reward_callables(), self.reward_names):
            needed = missing_columns(fn, sample)
            if needed:
                raise SampleError(
                    f"{sample_name(sample, index)} has no column {needed} that reward "
                    f"function {name} takes: add it to every prompt record, or give the "
                    "parameter a default."
                )

    @property
    def needs_reference(self) -> bool:
        return self.beta > 0

    @property
    def sequences_per_sample(self) -> int:
        return self.num_generations

    @property
    def metric_names(self) -> tuple[str, ...]:
        return CLIPS + (("kl",) if self.beta > 0 else ())

    @property
    def step_metric_names(self) -> tuple[str, ...]:
        per_func = [f"rewards/{n}/{s}" for n in self.reward_names for s in ("mean", "std")]
        lengths = [f"completions/{k}" for k in LENGTHS]
        return ("reward", "reward_std", *per_func, "frac_reward_zero_std", *lengths)

    @property
    def generates(self) -> bool:
        """The training groups generate the completions (``rollouts`` resolved on the
        driver to ``"generate"``)."""
        return self.rollouts == "generate"

    @property
    def eval_width(self) -> int:
        """Length of :meth:`eval_sums`."""
        return 2 + 2 * len(self.reward_funcs)

    def eval_sums(self, rewards: list[dict]) -> list[float]:
        """Validation completions' ``[summed reward, completions scored, per function:
        its summed values, their count]`` (``rewards``: per prompt, per function, one
        value or ``None`` per completion), summed over ranks into :meth:`eval_metrics`."""
        return reward_sums(self.reward_names, self.reward_weights, rewards)

    def eval_metrics(self, sums: list[float]) -> dict[str, float]:
        """``eval_reward`` and ``eval_rewards/<name>/mean`` (TRL's evaluation names)."""
        return reward_means(self.reward_names, sums)

    def sequences(self, sample: dict) -> list[dict]:
        if self.generates and "completion_ids" not in sample:  # a prompt: its longest
            ids = np.asarray(sample["input_ids"], dtype=np.int64)  # sequence (checks, costs)
            ids = np.concatenate([ids, np.zeros(self.max_completion_length, np.int64)])
            return [{**sample, "input_ids": ids, "labels": np.full(len(ids), IGNORE_INDEX)}]
        rest = {k: v for k, v in sample.items() if k not in (*ROLLOUT_KEYS, *self.fields)}
        prompt = np.asarray(sample["prompt_input_ids"], dtype=np.int64)
        out = []
        for c in sample["completion_ids"]:
            c = np.asarray(c, dtype=np.int64)
            labels = np.concatenate([np.full(len(prompt), IGNORE_INDEX, dtype=np.int64), c])
            out.append({**rest, "input_ids": np.concatenate([prompt, c]), "labels": labels})
        return out

    def check_sample(self, sample: dict, index: int | None = None) -> None:
        name, g = sample_name(sample, index), self.num_generations
        if self.generates:
            if sample.get("input_ids") is None or not len(sample["input_ids"]):
                raise SampleError(
                    f"{name} has no input_ids: GRPO generates from prompts, each its "
                    "input_ids after the chat template with the generation prompt."
                )
            labels = sample.get("labels")
            if labels is not None and (np.asarray(labels) != IGNORE_INDEX).any():
                raise SampleError(
                    f"{name} has labelled tokens (an answer): GRPO completes prompts; pass "
                    "TRL prompt records through PromptProcessor, or train answers with SFT."
                )
            return
        missing = [k for k in (*ROLLOUT_KEYS, "rewards", "truncated") if sample.get(k) is None]
        if missing:
            raise SampleError(
                f"{name} has no {missing}: GRPO trains on rollouts, each a prompt's "
                "prompt_input_ids, its completion_ids, their rewards and whether each was "
                "truncated (see ray_disagg.GRPO)."
            )
        completions = sample["completion_ids"]
        if len(completions) != g:
            raise SampleError(f"{name} has {len(completions)} completions; num_generations={g}.")
        for i, c in enumerate(completions):
            if not 0 < len(c) <= self.max_completion_length:
                raise SampleError(
                    f"{name}: completion {i} has {len(c)} tokens; each needs 1 to "
                    f"max_completion_length={self.max_completion_length}."
                )
        rewards = sample["rewards"]
        for fn in self.reward_names:
            if not isinstance(rewards, dict) or len(rewards.get(fn) or ()) != g:
                raise SampleError(
                    f"{name}: rewards[{fn!r}] must hold one value (or None) per completion "
                    f"({g}); got {rewards.get(fn) if isinstance(rewards, dict) else rewards!r}."
                )
        if len(sample["truncated"]) != g:
            raise SampleError(f"{name}: truncated must hold one bool per completion ({g}).")

    def prepare_step(self, batch: list[dict]) -> tuple[GRPOStep, dict[str, float]]:
        """Advantages from the global batch's rewards (TRL's ``sum_then_normalize``) and
        the step's reward and length metrics."""
        g, names = self.num_generations, self.reward_names
        values = [[np.nan if v is None else float(v) for v in s["rewards"][n]]
                  for s in batch for n in names]  # fmt: skip
        per_func = torch.tensor(values, dtype=torch.float32).view(len(batch), len(names), g)
        per_func = per_func.transpose(1, 2).reshape(-1, len(names))  # (completions, funcs)
        weights = torch.tensor(self.reward_weights or [1.0] * len(names), dtype=torch.float32)
        unscorable = torch.isnan(per_func).all(dim=1)
        rewards = (per_func * weights).nansum(dim=1)
        rewards[unscorable] = torch.nan
        mean = torch.nanmean(rewards.view(-1, g), dim=1).repeat_interleave(g)
        if self.scale_rewards == "batch":
            std = nanstd(rewards).expand_as(rewards)
        else:
            std = nanstd(rewards.view(-1, g), dim=1).repeat_interleave(g)
        advantages = rewards - mean
        if self.scale_rewards != "none":
            advantages = advantages / (std + 1e-4)
        advantages = torch.nan_to_num(advantages, nan=0.0).view(-1, g).tolist()
        metrics = {"reward": float(torch.nanmean(rewards)), "reward_std": float(nanstd(rewards))}
        for i, n in enumerate(names):
            metrics[f"rewards/{n}/mean"] = float(torch.nanmean(per_func[:, i]))
            metrics[f"rewards/{n}/std"] = float(nanstd(per_func[:, i]))
        zero = torch.isclose(std, torch.zeros_like(std))
        metrics["frac_reward_zero_std"] = float(zero.float().mean())
        truncated = [[bool(t) for t in s["truncated"]] for s in batch]
        lengths = torch.tensor([[len(c) for c in s["completion_ids"]] for s in batch]).float()
        metrics.update(_length_metrics(lengths.flatten(), torch.tensor(truncated).flatten()))
        kept = [
            [0.0 if (t and self.mask_truncated_completions) else 1.0 for t in ts]
            for ts in truncated
        ]
        return GRPOStep(
            advantages=advantages,
            kept=kept,
            sequences=float(len(batch) * g),
            tokens=float((lengths * torch.tensor(kept)).sum()),
        ), metrics

    def loss(self, logps: TokenLogps) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        st: GRPOStep = logps.step
        device, seq, at = logps.policy.device, logps.sequence, logps.positions
        adv = host_to_device(torch.tensor([a for p in at for a in st.advantages[p]]), device)
        kept = host_to_device(torch.tensor([k for p in at for k in st.kept[p]]), device)
        mask, a = kept[seq], adv[seq]
        lengths = (logps.tokens * kept).clamp(min=1.0)  # tokens in the loss per completion
        old = logps.policy.detach() if logps.old is None else logps.old
        log_ratio = logps.policy - old
        per_sequence = self.importance_sampling_level == "sequence"
        if per_sequence:  # GSPO: the completion's mean log-ratio (over every cp rank's tokens)
            seq_weights = logps.sequence_sum(log_ratio * mask) / lengths
            log_weights = seq_weights[seq]
        else:
            log_weights = log_ratio
        ratio = torch.exp(log_weights)
        high = self.epsilon if self.epsilon_high is None else self.epsilon_high
        clipped = torch.clamp(ratio, 1 - self.epsilon, 1 + high)
        per_token = -torch.min(ratio * a, clipped * a)
        metrics = {}
        tokens = max(st.tokens, 1.0)
        if self.beta > 0:
            d = logps.reference - logps.policy
            kl = torch.exp(d) - d - 1
            per_token = per_token + self.beta * kl
            metrics["kl"] = (kl.detach() * mask).sum() / tokens
        masked = per_token * mask
        if self.loss_type == "grpo":
            loss = (masked / lengths[seq]).sum() / st.sequences
        elif self.loss_type == "dr_grpo":
            loss = masked.sum() / (st.sequences * self.max_completion_length)
        else:  # dapo, bnpo: over the global batch's completion tokens in the loss
            loss = masked.sum() / tokens
        if per_sequence:  # one value per completion, the same on every cp rank
            w, sa = torch.exp(seq_weights.detach()), adv
            scale = logps.whole / st.sequences
            low, up = (w < 1 - self.epsilon) & (sa < 0), (w > 1 + high) & (sa > 0)
            metrics.update(
                _clips(low.float().sum(), up.float().sum(), (low | up).float().sum(), scale)
            )
        else:
            w = ratio.detach()
            low, up = (w < 1 - self.epsilon) & (a < 0), (w > 1 + high) & (a > 0)
            sums = [(x.float() * mask).sum() for x in (low, up, low | up)]
            metrics.update(_clips(*sums, 1.0 / tokens))
        return loss, metrics


def _clips(low, high, region, scale) -> dict[str, torch.Tensor]:
    return dict(zip(CLIPS, (low * scale, high * scale, region * scale)))


def _length_metrics(lengths: torch.Tensor, truncated: torch.Tensor) -> dict[str, float]:
    """TRL's ``completions/*`` metrics of the global batch's completion lengths."""
    done = lengths[~truncated]
    done = done if len(done) else torch.zeros(1)
    out = {"mean_length": lengths.mean(), "min_length": lengths.min(),
           "max_length": lengths.max(), "clipped_ratio": truncated.float().mean(),
           "mean_terminated_length": done.mean(), "min_terminated_length": done.min(),
           "max_terminated_length": done.max()}  # fmt: skip
    return {f"completions/{k}": float(v) for k, v in out.items()}
