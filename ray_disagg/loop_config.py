"""``TrainLoopConfig``: the hyper-parameters of the built-in training loop.

Validated in ``__post_init__`` so that a wrong setting fails on the driver, before any Ray
worker starts. (Also importable as ``ray_disagg.config.TrainLoopConfig``.)
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

__all__ = ["TrainLoopConfig"]

PARAM_DTYPES = ("float32", "bfloat16")
SCHEDULES = ("sequential", "1f1b")
LR_SCHEDULES = ("constant", "linear", "cosine")
ASSIGNMENTS = ("auto", "contiguous", "balanced")
# Keys of ``extra`` that were options in the previous release (removed in the next one).
DEPRECATED_EXTRA = ("report_sample_ids", "report_placement")


def _check_float(name: str, value, ok, what: str) -> None:
    valid = isinstance(value, int | float) and not isinstance(value, bool)
    if not valid or not math.isfinite(value) or not ok(value):
        raise ValueError(f"train_loop_config[{name!r}]={value!r}: must be {what}.")


@dataclass(kw_only=True)
class TrainLoopConfig:
    """Hyper-parameters of the built-in training loop (``train_loop_config=`` accepts a dict).

    Example:
        >>> TrainLoopConfig(max_steps=10, global_batch_size=4, lr=1e-3).lr
        0.001
    """

    max_steps: int
    """Optimizer steps to run."""

    global_batch_size: int
    """Samples per optimizer step, summed over all data-parallel replicas."""

    lr: float = 1e-3
    """AdamW peak learning rate (after warmup; times each group's ``lr_multiplier``)."""

    lr_schedule: str = "constant"
    """``"constant"``, ``"linear"`` or ``"cosine"`` decay from ``lr`` after the warmup to
    ``min_lr_ratio * lr`` at the last step (see :func:`ray_disagg.lr_at`)."""

    warmup_steps: int = 0
    """Steps of linear warmup below ``lr``: step ``s < warmup_steps`` uses
    ``lr * (s + 1) / (warmup_steps + 1)``; step ``warmup_steps`` is the first at ``lr``."""

    min_lr_ratio: float = 0.0
    """The decayed learning rate at the last step, as a fraction of ``lr``."""

    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""

    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""

    eps: float = 1e-8
    """AdamW epsilon."""

    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm (over both groups) to this value; ``None`` disables."""

    seed: int = 0
    """Seed of the per-epoch sample shuffle."""

    shuffle: bool = True
    """Shuffle the samples every epoch (deterministically from ``seed`` and the epoch)."""

    report_every: int = 1
    """Call ``ray.train.report`` with the step's metrics every N steps."""

    checkpoint_every: int | None = None
    """Save a checkpoint every N steps; the last step is always checkpointed."""

    async_checkpoint: bool = False
    """Write checkpoints off the step's critical path: the checkpoint step only copies each
    rank's shard to host memory; the files are written in the background (DCP's
    ``async_save`` over a gloo group of its own) and uploaded asynchronously, and the
    checkpoint is reported (registered) at the end of the next step. A worker lost before
    then leaves it unregistered: a restart resumes from the previous one. The last step's
    checkpoint is written synchronously."""

    collective_timeout_s: float = 300.0
    """Timeout of cross-group transfers and collectives: a stuck peer raises instead of hanging."""

    skip_nonfinite_steps: bool = False
    """A step whose loss or global gradient norm is not finite is never applied. By default
    it raises ``FloatingPointError`` naming the step and its samples; with ``True`` it is
    skipped (no optimizer step on any group) and counted in the ``skipped_steps`` metric."""

    bf16: bool = False
    """Run forward/backward under bf16 autocast with fp32 master weights (FSDP2 groups also
    all-gather bf16 parameters: ``MixedPrecisionPolicy(param_dtype=bf16,
    reduce_dtype=fp32)``)."""

    param_dtype: str = "float32"
    """dtype of the parameters and the AdamW state: ``"float32"`` (master weights) or
    ``"bfloat16"`` (pure bf16: half the memory, for the largest models)."""

    micro_batches: int = 1
    """Split each replica's share of the global batch into this many microbatches whose
    gradients accumulate into one optimizer step (the loss stays the mean over the global
    batch's label tokens)."""

    schedule: str | None = None
    """``"sequential"`` (each microbatch crosses encoder -> LLM -> encoder before the next)
    or ``"1f1b"`` (encoders run the forward of microbatch i+1 while the LLM runs i, and the
    backward of i as soon as its gradients return). ``None``: ``"1f1b"`` for separate
    placement with ``micro_batches > 1``, else ``"sequential"``."""

    max_in_flight: int | None = None
    """1F1B: at most this many microbatches' encoder activations alive at once (default
    ``min(2, micro_batches)``: peak activation memory at most the sequential schedule's)."""

    assignment: str = "auto"
    """How a global batch's samples go to replicas: ``"contiguous"`` (replica d gets the
    d-th slice), ``"balanced"`` (encoder replicas by estimated encoder cost, LLM replicas by
    token count; greedy longest-processing-time with equal sample counts), or ``"auto"``
    (balanced for map-style datasets, contiguous for Ray Data)."""

    eval_every: int | None = None
    """With ``datasets={"validation": ...}``: compute ``val_loss`` (mean over the label
    tokens of the validation set, no gradients, on the same groups) every N steps and at
    every checkpoint step (so ``checkpoint_score_attribute="val_loss"`` always has it).
    ``None``: at checkpoint steps only."""

    pack_sequences: bool = False
    """Pack several samples into each LLM row (no attention across samples, positions
    restarting per sample) instead of padding every row to the longest sample."""

    max_seq_len: int | None = None
    """Packed row length (tokens); required with ``pack_sequences``. A longer sample is a
    ``ValueError`` naming it."""

    loss_chunk_tokens: int | None = None
    """Compute the LLM's logits and cross-entropy this many label positions at a time,
    recomputing each chunk in backward, so ``[tokens x vocab]`` logits never exist at
    once (long sequences, large vocabularies). ``None``: all label positions at once
    (logits are only ever computed where the next token is a label)."""

    report_sample_ids: bool = False
    """Add the metric ``sample_ids``: the indices of the samples each step trained on, in
    order (an audit that no sample is repeated or dropped within an epoch)."""

    report_placement: bool = False
    """Add the metric ``placement``: each worker's ``[placement group id, bundle index]``
    per group (to check where ``placement="colocated"`` put the workers)."""

    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form values, passed through untouched (e.g. for callbacks)."""

    def __post_init__(self) -> None:
        self._take_deprecated_extra()
        for name in ("max_steps", "global_batch_size", "report_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"train_loop_config[{name!r}]={v!r}: must be an int >= 1.")
        if not isinstance(self.async_checkpoint, bool):
            raise ValueError(
                f"train_loop_config['async_checkpoint']={self.async_checkpoint!r}: must be a bool."
            )
        if self.checkpoint_every is not None and (
            not isinstance(self.checkpoint_every, int) or self.checkpoint_every < 1
        ):
            raise ValueError(
                f"train_loop_config['checkpoint_every']={self.checkpoint_every!r}: "
                "must be None or an int >= 1."
            )
        _check_float("lr", self.lr, lambda v: v > 0, "a finite float > 0")
        _check_float("eps", self.eps, lambda v: v > 0, "a finite float > 0")
        _check_float("weight_decay", self.weight_decay, lambda v: v >= 0, "a finite float >= 0")
        if self.max_grad_norm is not None:
            _check_float("max_grad_norm", self.max_grad_norm, lambda v: v > 0, "> 0 or None")
        _check_float(
            "collective_timeout_s", self.collective_timeout_s, lambda v: v > 0, "seconds > 0"
        )
        self.collective_timeout_s = float(self.collective_timeout_s)
        betas = tuple(self.betas) if isinstance(self.betas, list | tuple) else ()
        if len(betas) != 2:
            raise ValueError(
                f"train_loop_config['betas']={self.betas!r}: must be two floats in [0, 1)."
            )
        for b in betas:
            _check_float("betas", b, lambda v: 0 <= v < 1, "two floats in [0, 1)")
        self.betas = betas
        if not isinstance(self.micro_batches, int) or self.micro_batches < 1:
            raise ValueError(
                f"train_loop_config['micro_batches']={self.micro_batches!r}: must be an int >= 1."
            )
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(
                f"train_loop_config['lr_schedule']={self.lr_schedule!r}: must be one of "
                f"{LR_SCHEDULES}."
            )
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(
                f"train_loop_config['warmup_steps']={self.warmup_steps!r}: must be an int >= 0."
            )
        _check_float("min_lr_ratio", self.min_lr_ratio, lambda v: 0 <= v <= 1, "in [0, 1]")
        if self.min_lr_ratio and self.lr_schedule == "constant":
            raise ValueError(
                f"train_loop_config['min_lr_ratio']={self.min_lr_ratio!r} applies to the "
                "'linear' and 'cosine' lr_schedule only; set lr_schedule or drop min_lr_ratio."
            )
        if self.eval_every is not None and (
            not isinstance(self.eval_every, int) or self.eval_every < 1
        ):
            raise ValueError(
                f"train_loop_config['eval_every']={self.eval_every!r}: must be None or an int >= 1."
            )
        if not isinstance(self.pack_sequences, bool):
            raise ValueError(
                f"train_loop_config['pack_sequences']={self.pack_sequences!r}: must be a bool."
            )
        if self.max_seq_len is not None and (
            not isinstance(self.max_seq_len, int) or self.max_seq_len < 2
        ):
            raise ValueError(
                f"train_loop_config['max_seq_len']={self.max_seq_len!r}: must be an int >= 2."
            )
        chunk = self.loss_chunk_tokens
        if chunk is not None and (
            not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1
        ):
            raise ValueError(
                f"train_loop_config['loss_chunk_tokens']={chunk!r}: must be an int >= 1 "
                "(label positions per chunk) or None."
            )
        if self.pack_sequences and self.max_seq_len is None:
            raise ValueError(
                "train_loop_config['pack_sequences']=True needs 'max_seq_len' (tokens per "
                "packed row), e.g. 4096."
            )
        if self.schedule not in (None, *SCHEDULES):
            raise ValueError(
                f"train_loop_config['schedule']={self.schedule!r}: must be one of {SCHEDULES}."
            )
        if self.max_in_flight is not None and (
            not isinstance(self.max_in_flight, int) or self.max_in_flight < 1
        ):
            raise ValueError(
                f"train_loop_config['max_in_flight']={self.max_in_flight!r}: must be an int >= 1."
            )
        if self.assignment not in ASSIGNMENTS:
            raise ValueError(
                f"train_loop_config['assignment']={self.assignment!r}: must be one of "
                f"{ASSIGNMENTS}."
            )
        for name in ("report_sample_ids", "report_placement"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"train_loop_config[{name!r}]={getattr(self, name)!r}: must be a bool."
                )
        if self.param_dtype not in PARAM_DTYPES:
            raise ValueError(
                f"train_loop_config['param_dtype']={self.param_dtype!r} is not supported; use "
                f"one of {sorted(PARAM_DTYPES)}."
            )

    def _take_deprecated_extra(self) -> None:
        """``extra={"report_sample_ids": ..., "report_placement": ...}`` (the previous
        release's spelling) set the typed fields, with a ``DeprecationWarning``;
        ``extra["inject_failure_once"]`` warns too (the trainer turns it into the
        ``RAY_DISAGG_FAULT_DRILL`` environment variable of its workers)."""
        if not isinstance(self.extra, dict):
            raise ValueError(f"train_loop_config['extra']={self.extra!r}: must be a dict.")
        if "inject_failure_once" in self.extra:
            warnings.warn(
                "ray_disagg: train_loop_config extra['inject_failure_once'] is deprecated and "
                "is removed in the next release; fault drills are armed by the environment "
                "variable RAY_DISAGG_FAULT_DRILL (ray_disagg.testing.faults.fault_drill), "
                "which the driver hands to its workers.",
                DeprecationWarning,
                stacklevel=4,
            )
        moved = [k for k in DEPRECATED_EXTRA if k in self.extra]
        if not moved:
            return
        self.extra = dict(self.extra)  # the caller's dict stays as it was
        for key in moved:
            warnings.warn(
                f"ray_disagg: train_loop_config extra[{key!r}] is deprecated and is removed in the "
                f"next release; use TrainLoopConfig({key}=...) (train_loop_config "
                f"{{{key!r}: ...}}) instead.",
                DeprecationWarning,
                stacklevel=4,
            )
            setattr(self, key, self.extra.pop(key))

    @classmethod
    def from_any(cls, value: TrainLoopConfig | dict[str, Any] | None) -> TrainLoopConfig:
        """Build from a ``TrainLoopConfig`` or a dict; unknown keys raise ``ValueError``."""
        if isinstance(value, cls):
            return value
        if value is None:
            raise ValueError(
                "train_loop_config is required, e.g. {'max_steps': 20, 'global_batch_size': 4}."
            )
        if not isinstance(value, dict):
            raise ValueError(f"train_loop_config must be a dict, got {type(value).__name__}.")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"Unknown train_loop_config keys {unknown}; known keys are {sorted(known)}. "
                "Put custom values under 'extra'."
            )
        missing = [k for k in ("max_steps", "global_batch_size") if k not in value]
        if missing:
            raise ValueError(f"train_loop_config is missing required keys {missing}.")
        return cls(**value)
