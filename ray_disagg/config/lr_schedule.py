"""Learning-rate schedules: a pure function of the step, so a resumed run (which restores
the step from its checkpoint) continues the schedule bit-identically."""

from __future__ import annotations

import math

from ray_disagg.config.loop import TrainLoopConfig

__all__ = ["lr_at"]


def lr_at(cfg: TrainLoopConfig, step: int, multiplier: float = 1.0) -> float:
    """The learning rate of optimizer step ``step`` (0-based) under ``cfg``.

    Warmup: ``lr * (step + 1) / (warmup_steps + 1)`` for the first ``warmup_steps`` steps,
    so step ``warmup_steps`` is the first at ``lr``. From there ``constant`` keeps ``lr``;
    ``linear`` and ``cosine`` decay from ``lr`` to ``min_lr_ratio * lr`` at the last step
    (``max_steps - 1``).

    Example:
        >>> cfg = TrainLoopConfig(max_steps=5, global_batch_size=1, lr=1.0,
        ...                       lr_schedule="linear", warmup_steps=1)
        >>> [lr_at(cfg, s) for s in range(5)]
        [0.5, 1.0, 0.6666666666666667, 0.33333333333333337, 0.0]
    """
    w = cfg.warmup_steps
    if step < w:
        return cfg.lr * multiplier * (step + 1) / (w + 1)
    if cfg.lr_schedule == "constant":
        return cfg.lr * multiplier
    span = max(cfg.max_steps - 1 - w, 1)
    progress = min(max((step - w) / span, 0.0), 1.0)
    if cfg.lr_schedule == "linear":
        decay = 1.0 - progress
    else:
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    floor = cfg.min_lr_ratio
    return cfg.lr * multiplier * (floor + (1.0 - floor) * decay)
