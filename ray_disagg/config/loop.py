"""``TrainLoopConfig``: the hyper-parameters of the built-in training loop.

Validated in ``__post_init__`` so that a wrong setting fails on the driver, before any Ray
worker starts. (Also importable as ``ray_disagg.config.groups.TrainLoopConfig``.)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from ray_disagg.config.settings import check_settings, setting
from ray_disagg.objectives import Objective, objective_from_any

__all__ = ["TrainLoopConfig"]

# Keys of ``extra`` that were options two releases ago (refused, naming the fix).
REMOVED_EXTRA = {
    "report_sample_ids": "use TrainLoopConfig(report_sample_ids=...)",
    "report_placement": "use TrainLoopConfig(report_placement=...)",
    "inject_failure_once": "a fault drill is armed by the environment variable "
    "RAY_DISAGG_FAULT_DRILL (ray_disagg.testing.faults.fault_drill)",
}


@dataclass(kw_only=True)
class TrainLoopConfig:
    """Hyper-parameters of the built-in training loop (``train_loop_config=`` accepts a dict).

    Example:
        >>> TrainLoopConfig(max_steps=10, global_batch_size=4, lr=1e-3).lr
        0.001
    """

    max_steps: int = setting(ge=1)
    """Optimizer steps to run."""

    global_batch_size: int = setting(ge=1)
    """Samples per optimizer step, summed over all data-parallel replicas (with
    ``max_tokens_per_microbatch``: the most samples a step takes)."""

    lr: float = setting(1e-3, gt=0)
    """AdamW peak learning rate (after warmup; times each group's ``lr_multiplier``)."""

    lr_schedule: Literal["constant", "linear", "cosine"] = setting("constant")
    """``"constant"``, ``"linear"`` or ``"cosine"`` decay from ``lr`` after the warmup to
    ``min_lr_ratio * lr`` at the last step (see :func:`ray_disagg.lr_at`)."""

    warmup_steps: int = setting(0, ge=0)
    """Steps of linear warmup below ``lr``: step ``s < warmup_steps`` uses
    ``lr * (s + 1) / (warmup_steps + 1)``; step ``warmup_steps`` is the first at ``lr``."""

    min_lr_ratio: float = setting(0.0, ge=0, le=1)
    """The decayed learning rate at the last step, as a fraction of ``lr``."""

    weight_decay: float = setting(0.0, ge=0)
    """AdamW decoupled weight decay."""

    betas: tuple[float, float] = setting((0.9, 0.999), ge=0, lt=1, what="two floats in [0, 1)")
    """AdamW betas."""

    eps: float = setting(1e-8, gt=0)
    """AdamW epsilon."""

    max_grad_norm: float | None = setting(1.0, gt=0)
    """Clip the global gradient norm (over both groups) to this value; ``None`` disables."""

    seed: int = setting(0)
    """Seed of the per-epoch sample shuffle."""

    shuffle: bool = setting(True)
    """Shuffle the samples every epoch (deterministically from ``seed`` and the epoch)."""

    report_every: int = setting(1, ge=1)
    """Call ``ray.train.report`` with the step's metrics every N steps."""

    checkpoint_every: int | None = setting(None, ge=1)
    """Save a checkpoint every N steps; the last step is always checkpointed."""

    async_checkpoint: bool = setting(False)
    """Write checkpoints off the step's critical path: the checkpoint step only copies each
    rank's shard to host memory; the files are written in the background (DCP's
    ``async_save`` over a gloo group of its own) and uploaded asynchronously, and the
    checkpoint is reported (registered) at the end of the next step. A worker lost before
    then leaves it unregistered: a restart resumes from the previous one. The last step's
    checkpoint is written synchronously."""

    collective_timeout_s: float = setting(300.0, gt=0, what="seconds > 0")
    """Timeout of cross-group transfers and collectives: a stuck peer raises instead of hanging."""

    skip_nonfinite_steps: bool = setting(False)
    """A step whose loss or global gradient norm is not finite is never applied. By default
    it raises ``FloatingPointError`` naming the step and its samples; with ``True`` it is
    skipped (no optimizer step on any group) and counted in the ``skipped_steps`` metric."""

    bf16: bool = setting(False)
    """Run forward/backward under bf16 autocast with fp32 master weights (FSDP2 groups also
    all-gather bf16 parameters: ``MixedPrecisionPolicy(param_dtype=bf16,
    reduce_dtype=fp32)``)."""

    param_dtype: Literal["float32", "bfloat16"] = setting("float32")
    """dtype of the parameters and the AdamW state: ``"float32"`` (master weights) or
    ``"bfloat16"`` (pure bf16: half the memory, for the largest models)."""

    micro_batches: int = setting(1, ge=1)
    """Split each replica's share of the global batch into this many microbatches whose
    gradients accumulate into one optimizer step (the loss stays the mean over the global
    batch's label tokens)."""

    schedule: Literal["sequential", "1f1b"] | None = setting(None)
    """``"sequential"`` (each microbatch crosses encoder -> LLM -> encoder before the next)
    or ``"1f1b"`` (encoders run the forward of microbatch i+1 while the LLM runs i, and the
    backward of i as soon as its gradients return). ``None``: ``"1f1b"`` for separate
    placement with ``micro_batches > 1``, else ``"sequential"``."""

    max_in_flight: int | None = setting(None, ge=1)
    """1F1B: at most this many microbatches' encoder activations alive at once (default
    ``min(2, micro_batches)``: peak activation memory at most the sequential schedule's)."""

    assignment: Literal["auto", "contiguous", "balanced"] = setting("auto")
    """How a global batch's samples go to replicas: ``"contiguous"`` (replica d gets the
    d-th slice), ``"balanced"`` (encoder replicas by estimated encoder cost, LLM replicas by
    token count; greedy longest-processing-time with equal sample counts), or ``"auto"``
    (balanced for map-style datasets, contiguous for Ray Data)."""

    eval_every: int | None = setting(None, ge=1)
    """With ``datasets={"validation": ...}``: compute ``val_loss`` (mean over the label
    tokens of the validation set, no gradients, on the same groups) every N steps and at
    every checkpoint step (so ``checkpoint_score_attribute="val_loss"`` always has it).
    ``None``: at checkpoint steps only."""

    pack_sequences: bool = setting(False)
    """Pack several samples into each LLM row (no attention across samples, positions
    restarting per sample) instead of padding every row to the longest sample."""

    max_seq_len: int | None = setting(None, ge=2)
    """Packed row length (tokens); required with ``pack_sequences``. A longer sample is a
    ``ValueError`` naming it."""

    max_tokens_per_microbatch: int | None = setting(None, ge=1)
    """Token-budget batching (map-style data): each step takes the samples that fit
    ``micro_batches x`` LLM-data-parallel microbatches of at most this many LLM tokens
    (after media expansion; a preference pair's two sequences together), up to
    ``global_batch_size`` samples, instead of a fixed count; the loss stays the mean over
    the step's label tokens. A longer sample is a ``ValueError`` naming it. See
    :class:`ray_disagg.pipeline.budget.BudgetPlan`."""

    max_patches_per_microbatch: int | None = setting(None, ge=1)
    """With ``max_tokens_per_microbatch``: also at most this many input patches per
    microbatch on each encoder replica (Qwen: ``pixel_values`` rows; tile towers: tiles x
    patches per tile)."""

    loss_chunk_tokens: int | None = setting(None, ge=1)
    """Compute the LLM's logits and cross-entropy this many label positions at a time,
    recomputing each chunk in backward, so ``[tokens x vocab]`` logits never exist at
    once (long sequences, large vocabularies). ``None``: all label positions at once
    (logits are only ever computed where the next token is a label)."""

    objective: Objective | None = dataclasses.field(default=None)
    """What the LLM trains on: ``None``, the token cross-entropy of the labels (SFT); or a
    per-sequence :class:`~ray_disagg.objectives.Objective` such as
    ``ray_disagg.DPO(beta=0.1)`` (``{"type": "dpo", "beta": 0.1}`` in a dict or recipe),
    whose samples are preference pairs and whose ``global_batch_size`` counts pairs."""

    report_sample_ids: bool = setting(False)
    """Add the metric ``sample_ids``: the indices of the samples each step trained on, in
    order (an audit that no sample is repeated or dropped within an epoch)."""

    trace_steps: tuple[int, ...] = setting((), ge=1)
    """Steps (from 1, as reported) whose actions each group's rank 0 records with their
    start and end times into ``<run>/trace/<group>.jsonl``: the timeline that
    ``ray-disagg plot RUN_DIR`` draws (which group waits for which, the 1F1B overlap)."""

    peak_tflops: float | None = setting(None, gt=0)
    """Each worker's dense peak TFLOP/s in the run's dtype, for the ``mfu`` and
    ``<group>_mfu`` metrics. ``None``: a GPU's from ``ray_disagg.worker.mfu.PEAK_TFLOPS``
    (an unknown GPU warns and reports no MFU); a CPU reports MFU only with this set."""

    report_placement: bool = setting(False)
    """Add the metric ``placement``: each worker's ``[placement group id, bundle index]``
    per group (to check where ``placement="colocated"`` put the workers)."""

    extra: dict[str, Any] = setting(default_factory=dict)
    """Free-form values, passed through untouched (e.g. for callbacks)."""

    def __post_init__(self) -> None:
        check_settings(self, lambda name, value: f"train_loop_config[{name!r}]={value!r}")
        self.objective = objective_from_any(self.objective)
        for key, fix in REMOVED_EXTRA.items():
            if key in self.extra:
                raise ValueError(
                    f"train_loop_config extra[{key!r}] was an option of the previous release "
                    f"and is removed; {fix}."
                )
        if self.min_lr_ratio and self.lr_schedule == "constant":
            raise ValueError(
                f"train_loop_config['min_lr_ratio']={self.min_lr_ratio!r} applies to the "
                "'linear' and 'cosine' lr_schedule only; set lr_schedule or drop min_lr_ratio."
            )
        if self.pack_sequences and self.max_seq_len is None:
            raise ValueError(
                "train_loop_config['pack_sequences']=True needs 'max_seq_len' (tokens per "
                "packed row), e.g. 4096."
            )
        self._check_budget()
        late = [s for s in self.trace_steps if s > self.max_steps]
        if late:
            raise ValueError(
                f"train_loop_config['trace_steps'] has {late}, after the run's last step "
                f"(max_steps={self.max_steps}); trace steps 1..{self.max_steps}."
            )

    def _check_budget(self) -> None:
        budget = self.max_tokens_per_microbatch
        if self.max_patches_per_microbatch is not None and budget is None:
            raise ValueError(
                "train_loop_config['max_patches_per_microbatch'] caps the patches of a "
                "token-budget microbatch: set 'max_tokens_per_microbatch' too."
            )
        if budget is not None and self.pack_sequences and budget < self.max_seq_len:
            raise ValueError(
                f"train_loop_config['max_tokens_per_microbatch']={budget} is below "
                f"max_seq_len={self.max_seq_len}: a packed row of max_seq_len tokens would "
                "not fit a microbatch; use a budget of at least max_seq_len."
            )

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
