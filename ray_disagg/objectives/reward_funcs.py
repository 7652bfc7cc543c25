"""GRPO's reward functions as TRL calls them: ``fn(prompts=, completions=,
completion_ids=, **columns) -> list[float | None]``, given as callables or as
``"module:function"`` (imported where they run), checked on the driver."""

from __future__ import annotations

import importlib
import inspect

__all__ = [
    "check_reward_func",
    "missing_columns",
    "resolve",
    "reward_means",
    "reward_name",
    "reward_sums",
]

TRL_KEYWORDS = ("prompts", "completions", "completion_ids")
"""The keywords TRL passes besides the record's columns."""


def reward_name(fn) -> str:
    """TRL's name of a reward function: its ``__name__`` (``"module:function"``: the
    function)."""
    return fn.rsplit(":", 1)[-1] if isinstance(fn, str) else getattr(fn, "__name__", repr(fn))


def resolve(fn):
    """The callable of a reward function given as ``"module:function"``."""
    if not isinstance(fn, str):
        return fn
    module, _, name = fn.partition(":")
    if not name:
        raise ValueError(
            f"train_loop_config['objective'] GRPO(reward_funcs=[{fn!r}]): name a function "
            "as 'module:function' (importable where the run starts)."
        )
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(
            f"train_loop_config['objective'] GRPO(reward_funcs=[{fn!r}]): cannot import it "
            f"({e}); give a function importable where the run starts."
        ) from None


def check_reward_func(fn) -> None:
    """A reward function TRL can call: ``fn(prompts=, completions=, completion_ids=,
    **columns)``."""
    f = resolve(fn)
    where = f"train_loop_config['objective'] GRPO(reward_funcs=[{reward_name(fn)}])"
    if not callable(f):
        raise ValueError(f"{where}: {f!r} is not callable; give a function.")
    try:
        sig = inspect.signature(f)
    except (TypeError, ValueError):
        return  # a builtin: not checkable
    params = sig.parameters.values()
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        raise ValueError(
            f"{where}: TRL calls a reward function with keywords prompts, completions, "
            "completion_ids and every other column of the record; add **kwargs to its "
            f"signature {sig}."
        )
    try:
        sig.bind_partial(prompts=[], completions=[], completion_ids=[])
    except TypeError as e:
        raise ValueError(f"{where}: not callable as TRL calls it ({e}).") from None


def missing_columns(fn, sample: dict) -> list[str]:
    """The parameters of reward function ``fn`` without a default that neither TRL's
    keywords nor ``sample``'s columns give."""
    try:
        params = inspect.signature(resolve(fn)).parameters.values()
    except (TypeError, ValueError):
        return []
    have = {*sample, *TRL_KEYWORDS}
    return [
        p.name for p in params
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and p.default is p.empty and p.name not in have
    ]  # fmt: skip


def reward_sums(names, weights, rewards: list[dict]) -> list[float]:
    """``[summed weighted reward, completions with any reward, per function: its summed
    values, their count]`` of ``rewards`` (per prompt, per function name in ``names``,
    one value or ``None`` per completion; ``weights`` per function, ``None``: 1.0)."""
    weights = weights or (1.0,) * len(names)
    out = [0.0] * (2 + 2 * len(names))
    for per_prompt in rewards:
        for values in zip(*(per_prompt[n] for n in names)):
            scored = [(w, v) for w, v in zip(weights, values) if v is not None]
            if scored:
                out[0] += sum(w * v for w, v in scored)
                out[1] += 1
            for i, v in enumerate(values):
                if v is not None:
                    out[2 + 2 * i] += v
                    out[3 + 2 * i] += 1
    return out


def reward_means(names, sums: list[float]) -> dict[str, float]:
    """``eval_reward`` and ``eval_rewards/<name>/mean`` of :func:`reward_sums` (summed
    over ranks; NaN where nothing was scored)."""

    def mean(total, n):
        return total / n if n else float("nan")

    out = {"eval_reward": mean(sums[0], sums[1])}
    for i, name in enumerate(names):
        out[f"eval_rewards/{name}/mean"] = mean(sums[2 + 2 * i], sums[3 + 2 * i])
    return out
