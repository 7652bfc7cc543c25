"""Rewards of a step's completions, each reward function called as TRL's
``GRPOTrainer`` calls it: once per function over every completion of the batch, with
keywords ``prompts`` (each completion's prompt), ``completions`` (the decoded text; for a
conversational prompt ``[{"role": "assistant", "content": text}]``), ``completion_ids``
and every other column of the prompt's record, one value per completion. TRL's
``trainer_state``, ``log_extra``, ``log_metric`` and ``environments`` are not passed (a
function takes them through ``**kwargs`` and must not need them).

A value is a number or ``None`` (the function does not apply to that completion). A
function that raises, returns another number of values or a value that is not a number
raises :class:`RewardError` naming the function and the prompts.

Example:
    >>> def short(prompts, completions, **kwargs):
    ...     return [float(len(c) < 5) for c in completions]
    >>> score([short], [{"id": 1, "prompt": "Say hi", "lang": "en"}],
    ...       [[[7, 8], [9, 9, 9, 9, 9, 9]]], decode=lambda ids: "x" * len(ids))
    [{'short': [1.0, 0.0]}]
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence

__all__ = ["RewardError", "score"]

NOT_COLUMNS = ("prompt", "completion", "completion_ids")


class RewardError(RuntimeError):
    """A reward function failed on a step's completions."""


def _conversational(prompt) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)


def _value(v, name: str, ids) -> float | None:
    if v is None:
        return None
    if isinstance(v, numbers.Real) and not isinstance(v, bool) and not math.isinf(float(v)):
        return float(v)
    raise RewardError(
        f"reward function {name} returned {v!r} for a completion of prompts {ids}; return "
        "a finite number, or None where it does not apply."
    )


def score(
    funcs: Sequence[Callable], records: Sequence[dict], completion_ids: Sequence[Sequence],
    decode: Callable[[list[int]], str], names: Sequence[str] | None = None,
) -> list[dict[str, list[float | None]]]:  # fmt: skip
    """Per record, ``{function name: one reward per completion}``: ``records`` the
    prompts' TRL records (``prompt`` and the other columns), ``completion_ids`` each
    record's completions (token ids), ``decode`` ids to text (the family's tokenizer,
    special tokens skipped as TRL's)."""
    names = list(names or [getattr(f, "__name__", repr(f)) for f in funcs])
    counts = [len(c) for c in completion_ids]
    ids = [r.get("id") for r in records]
    flat = [list(map(int, c)) for cs in completion_ids for c in cs]
    repeat = [r for r, n in zip(records, counts) for _ in range(n)]
    texts = [decode(c) for c in flat]
    prompts = [r.get("prompt") for r in repeat]
    completions = [
        [{"role": "assistant", "content": t}] if _conversational(p) else t
        for p, t in zip(prompts, texts)
    ]
    keys = [k for k in dict.fromkeys(k for r in records for k in r) if k not in NOT_COLUMNS]
    columns = {k: [r.get(k) for r in repeat] for k in keys}
    by_func = {}
    for f, name in zip(funcs, names):
        try:
            out = f(prompts=prompts, completions=completions, completion_ids=flat, **columns)
        except Exception as e:
            raise RewardError(f"reward function {name} raised on prompts {ids}: {e!r}") from e
        if out is None or len(out) != len(flat):
            got = "None" if out is None else f"{len(out)} values"
            raise RewardError(
                f"reward function {name} returned {got} for the {len(flat)} completions of "
                f"prompts {ids}; return one value (or None) per completion."
            )
        by_func[name] = [_value(v, name, ids) for v in out]
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return [{n: v[s : s + k] for n, v in by_func.items()} for s, k in zip(starts, counts)]
