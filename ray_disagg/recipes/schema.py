"""The small schema toolkit of recipes: errors that name the key path, mapping checks,
and YAML (with ``1e-4`` read as a float) for files and ``key=value`` overrides.

Example:
    >>> apply_overrides({"a": {"b": 1}}, ["a.b=2", "a.c=[1, 2]", "lr=1e-4"])
    {'a': {'b': 2, 'c': [1, 2]}, 'lr': 0.0001}
"""

from __future__ import annotations

import contextlib
import re

import yaml

__all__ = [
    "REQUIRED",
    "RecipeError",
    "apply_overrides",
    "at",
    "check",
    "choice",
    "fail",
    "load_yaml",
    "section",
]

REQUIRED = object()
"""Schema default of a key that must be given."""


class RecipeError(ValueError):
    """A recipe is wrong; the message names the key path and what is allowed."""


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads ``1e-4`` as a string; read it (and ``3E5``) as a float."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def load_yaml(text: str):
    return yaml.load(text, _Loader)


def fail(msg: str):
    raise RecipeError(msg)


@contextlib.contextmanager
def at(path: str):
    """Re-raise a library ``ValueError``/``TypeError`` as a RecipeError prefixed by ``path``."""
    try:
        yield
    except RecipeError:
        raise
    except (ValueError, TypeError) as e:
        raise RecipeError(f"{path}: {e}") from None


def section(value, path: str, schema: dict) -> dict:
    if value is None:
        value = {}
    if not isinstance(value, dict):
        fail(f"{path}: must be a mapping with keys {sorted(schema)}, got {value!r}.")
    unknown = sorted(set(value) - set(schema))
    if unknown:
        fail(f"{path}: unknown key(s) {unknown}; allowed keys: {sorted(schema)}.")
    missing = sorted(k for k, d in schema.items() if d is REQUIRED and k not in value)
    if missing:
        fail(f"{path}: missing required key(s) {missing}; allowed keys: {sorted(schema)}.")
    return {**schema, **value}


def check(value, path: str, kind: type, what: str):
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        fail(f"{path}={value!r}: must be {what}.")
    return value


def choice(value, path: str, allowed) -> str:
    if value not in allowed:
        fail(f"{path}={value!r}: must be one of {list(allowed)}.")
    return value


def apply_overrides(raw: dict, overrides) -> dict:
    """Set each ``"dotted.key=yaml value"`` of ``overrides`` in (a copy of) ``raw``."""
    raw = load_yaml(yaml.safe_dump(raw)) or {}  # a deep copy
    for item in overrides:
        key, eq, text = item.partition("=")
        if not eq or not key or any(not k for k in key.split(".")):
            fail(f"override {item!r}: must be key=value with a dotted key, e.g. a.b=1.")
        try:
            value = load_yaml(text)
        except yaml.YAMLError as e:
            fail(f"override {item!r}: the value is not valid YAML ({e}).")
        node, parts = raw, key.split(".")
        for i, k in enumerate(parts[:-1]):
            if node.get(k) is None:  # an absent or empty (null) section
                node[k] = {}
            node = node[k]
            if not isinstance(node, dict):
                fail(f"override {item!r}: {'.'.join(parts[: i + 1])} is {node!r}, not a mapping.")
        node[parts[-1]] = value
    return raw
