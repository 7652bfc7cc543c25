"""Settings a run accepts that cannot do what they say (a warm-up longer than the run,
an evaluation, report or checkpoint interval beyond it): :func:`run_warnings`, which
``ray-disagg plan`` prints and ``DisaggregatedTrainer`` emits as :class:`RunWarning`.

Example:
    >>> from ray_disagg.config.loop import TrainLoopConfig
    >>> loop = TrainLoopConfig(max_steps=10, global_batch_size=2, warmup_steps=20)
    >>> run_warnings(loop, validation=False)[0]  # doctest: +ELLIPSIS
    "train_loop_config['warmup_steps']=20 is not shorter than max_steps=10: the lr never ..."
"""

from __future__ import annotations

import warnings

from ray_disagg.config.loop import TrainLoopConfig

__all__ = ["RunWarning", "emit", "run_warnings"]


class RunWarning(UserWarning):
    """A setting of the run that cannot do what it says (the run goes on)."""


def run_warnings(loop: TrainLoopConfig, validation: bool) -> tuple[str, ...]:
    """What in ``loop`` cannot do what it says over ``max_steps`` steps (``validation``:
    a validation set is given)."""
    m, out = loop.max_steps, []
    if loop.warmup_steps >= m:
        peak = loop.lr * m / (loop.warmup_steps + 1)
        out.append(
            f"train_loop_config['warmup_steps']={loop.warmup_steps} is not shorter than "
            f"max_steps={m}: the lr never reaches lr={loop.lr:g} (the last step's is "
            f"{peak:.3g}); shorten the warm-up."
        )
    every = {"checkpoint_every": "checkpoints", "report_every": "reports metrics"}
    if validation:
        every["eval_every"] = "evaluates the validation set"
    for name, what in every.items():
        n = getattr(loop, name)
        if n is not None and n > m:
            where = "at its last step only"
            if name != "checkpoint_every" and (loop.checkpoint_every or m) < m:
                where = "only where it checkpoints (every checkpoint_every steps, the last)"
            out.append(
                f"train_loop_config['{name}']={n} is beyond max_steps={m}: the run {what} {where}."
            )
    return tuple(out)


def emit(messages: tuple[str, ...]) -> None:
    """Each message as a :class:`RunWarning` (shown once per message, as Python does)."""
    for message in messages:
        warnings.warn(message, RunWarning, stacklevel=3)
