"""The trainer's refusals in a recipe's words: key paths (``train_loop_config.eval_every``,
``data.validation``, ``groups.vision``) and YAML (``{type: data, fsdp: true}``) instead of
Python (``train_loop_config['eval_every']``, ``datasets['validation']``,
``DataParallel(fsdp=True)``). A :class:`~ray_disagg.config.refusals.Refusal` that carries
its recipe message gives it as is; the others are translated spelling by spelling.

Example:
    >>> print(in_recipe_words(ValueError(
    ...     "train_loop_config['pack_sequences']=True: use DataParallel(fsdp=True) for "
    ...     "'text', HFModelSpec(attn_implementation='sdpa') or drop datasets['validation'].")))
    train_loop_config.pack_sequences=true: use {type: data, fsdp: true} for groups.text, \
model.attn_implementation=sdpa or set data.validation: null.
"""

from __future__ import annotations

import dataclasses
import re

from ray_disagg.config.loop import TrainLoopConfig
from ray_disagg.config.refusals import refusals_of
from ray_disagg.recipes.sections import LORA, PARALLELISM

__all__ = ["in_recipe_words", "recipe_message", "translate"]

_PARALLELISM = {cls.__name__: kind for kind, (cls, _) in PARALLELISM.items() if kind != "none"}
"""A parallelism class's name -> the recipe's ``type`` (``DataParallel`` -> ``data``)."""
_LOOP_KEYS = sorted(
    (f.name for f in dataclasses.fields(TrainLoopConfig) if "_" in f.name), key=len, reverse=True
)
"""The loop settings named bare in messages (those with ``_``: not English words)."""
_ARGS = r"\(((?:[^()]|\([^()]*\))*)\)"  # a call's arguments, one level of parentheses inside


def _yaml(value: str) -> str:
    value = value.strip()
    value = {"True": "true", "False": "false", "None": "null"}.get(value, value)
    return value[1:-1] if re.fullmatch(r"'[^']*'|\"[^\"]*\"", value) else value


def _pairs(args: str) -> list[str]:
    """``a=1, b='x'`` as ``["a: 1", "b: x"]`` (commas inside parentheses kept)."""
    parts = re.split(r",\s*(?![^()]*\))", args) if args.strip() else []
    out = []
    for part in parts:
        key, eq, value = part.partition("=")
        out.append(f"{key.strip()}: {_yaml(value)}" if eq else part.strip())
    return out


def _mapping(kind: str, args: str) -> str:
    """A call's arguments as the recipe's mapping ``{type: kind, ...}`` (a positional one
    is a parallelism's ``size``: ``SequenceParallel(2)``)."""
    pairs = [p if ": " in p else f"size: {p}" for p in _pairs(args)]
    return "{" + ", ".join([f"type: {kind}", *pairs]) + "}"


def _loop_setting(m: re.Match) -> str:
    return f"train_loop_config.{m[1]}={_yaml(m[2])}"


def _setting(prefix: str):
    """``Name(a=1, b=2)`` as ``prefix.a=1, prefix.b=2`` (overrides: the key path, YAML)."""
    return lambda m: ", ".join(f"{prefix}{p.replace(': ', '=', 1)}" for p in _pairs(m[1]))


_RULES: list[tuple[str, object]] = [
    (r"drop datasets\[['\"]validation['\"]\]", "set data.validation: null"),
    (r"datasets=\{\"train\": \.\.\., \"validation\": \.\.\.\}", "data.validation"),
    (r"datasets=\{\"train\": \.\.\.\}", "data.train"),
    (r"datasets\[['\"](\w+)['\"]\]", r"data.\1"),
    (r"train_loop_config\[['\"](\w+)['\"]\]=([\w.'\"-]+)", _loop_setting),
    (r"train_loop_config\[['\"](\w+)['\"]\]", r"train_loop_config.\1"),
    (r"groups\[['\"](\w+)['\"]\]", r"groups.\1"),
    (r"for '(\w+)'", r"for groups.\1"),
    (r"\bModuleGroup" + _ARGS + r" on the '(\w+)' group", lambda m: _setting(f"groups.{m[2]}.")(m)),
    (r"the '(\w+)' group", r"groups.\1"),
    (r"restart_failed_group=True, ", ""),  # a recipe's run always restarts a failed group
    (r"\bModuleGroup" + _ARGS, _setting("")),
    (r"\bpeft_config\b", "lora"),
    *((rf"\b{field}\b", key) for key, (field, _) in LORA.items() if key != field),
    (r"parallelism=", "parallelism: "),
    (rf"\b({'|'.join(_PARALLELISM)})" + _ARGS, lambda m: _mapping(_PARALLELISM[m[1]], m[2])),
    (r"(?:ray_disagg\.)?\b(DPO|GRPO)" + _ARGS, lambda m: _mapping(m[1].lower(), m[2])),
    (r"\bScalingConfig" + _ARGS, _setting("")),
    (r"\bHFModelSpec" + _ARGS, _setting("model.")),
    (r"\bRunConfig" + _ARGS, _setting("run_config.")),
    (r"checkpoint_score_attribute", "run_config.checkpoint.score_attribute"),
    (rf"(?<![\w.'\[/-])({'|'.join(_LOOP_KEYS)})\b", r"train_loop_config.\1"),
    (r"=(True|False|None)\b", lambda m: "=" + _yaml(m[1])),
    (r"\bTrue or False\b", "true or false"),
    (r"^(\w+): (?=\1\.)", ""),  # "train_loop_config: train_loop_config.x ...": once
]  # fmt: skip


def in_recipe_words(error: ValueError) -> str:
    """One refusal's message as a recipe's author reads it."""
    recipe = getattr(error, "recipe", None)
    return recipe if recipe is not None else translate(str(error))


def translate(text: str) -> str:
    """``text`` (a message in the trainer's words) with each Python spelling translated."""
    for pattern, repl in _RULES:
        text = re.sub(pattern, repl, text)
    return text


def recipe_message(name: str, error: ValueError) -> str:
    """The message ``ray-disagg plan|train`` prints for ``error`` (one refusal, or several
    independent ones together) of the recipe ``name``."""
    errors = refusals_of(error)
    if len(errors) == 1:
        return f"recipe {name}: {in_recipe_words(errors[0])}"
    lines = "\n".join(f"  - {in_recipe_words(e)}" for e in errors)
    return f"recipe {name}: {len(errors)} settings to change:\n{lines}"
