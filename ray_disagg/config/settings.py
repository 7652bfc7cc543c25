"""Declared settings: each field of a config dataclass declares its type and bounds once
(:func:`setting`), and :func:`check_settings` checks every declared field of an instance
by that declaration in one loop. The recipe schema reads the same declarations for its
defaults (:func:`defaults`).

The type is the field's annotation: ``bool``, ``int``, ``float``, ``str``, a
``Literal[...]`` of allowed values (read with ``typing.get_args``), a fixed-length
``tuple[float, float]``, ``tuple[str, ...]``, ``tuple[int, ...]`` or ``dict``;
``... | None`` also allows ``None``. A ``bool`` is refused where an int or a float is
meant, a float where an int is (``1e3`` from YAML: "write 1000"); numpy integers and
floats are taken as Python ones.

Example:
    >>> from dataclasses import dataclass
    >>> @dataclass(kw_only=True)
    ... class Opts:
    ...     steps: int = setting(1, ge=1)
    ...     def __post_init__(self):
    ...         check_settings(self, lambda name, v: f"Opts({name}={v!r})")
    >>> Opts(steps=1e3)
    Traceback (most recent call last):
    ...
    ValueError: Opts(steps=1000.0): must be an int >= 1; write 1000 (an int, not a float).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import types
import typing
from collections.abc import Callable
from typing import Any, Literal

import numpy as np

__all__ = ["check_settings", "choices", "defaults", "setting"]

_KEY = "ray_disagg.setting"
_NOT_BOOL = " (a bool is not a number here)"


@dataclasses.dataclass(frozen=True)
class _Bounds:
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    what: str | None = None  # the description in messages, instead of the derived one

    def holds(self, v) -> bool:
        return not (
            (self.ge is not None and v < self.ge)
            or (self.gt is not None and v <= self.gt)
            or (self.le is not None and v > self.le)
            or (self.lt is not None and v >= self.lt)
        )

    def text(self) -> str:
        """`` >= 1``, `` in [0, 1)``, or nothing."""
        lo = (
            (">=", self.ge)
            if self.ge is not None
            else (">", self.gt)
            if self.gt is not None
            else None
        )
        hi = (
            ("<=", self.le)
            if self.le is not None
            else ("<", self.lt)
            if self.lt is not None
            else None
        )
        if lo and hi:
            left, right = "[" if lo[0] == ">=" else "(", "]" if hi[0] == "<=" else ")"
            return f" in {left}{lo[1]:g}, {hi[1]:g}{right}"
        op = lo or hi
        return f" {op[0]} {op[1]:g}" if op else ""


def setting(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING,
            ge=None, gt=None, le=None, lt=None, what: str | None = None) -> Any:  # fmt: skip
    """A dataclass field checked by :func:`check_settings`: its annotation is its type,
    ``ge``/``gt``/``le``/``lt`` bound a number (each element of a tuple of numbers),
    ``what`` replaces the derived description in error messages."""
    meta = {_KEY: _Bounds(ge, gt, le, lt, what)}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=meta)


def check_settings(obj, label: Callable[[str, Any], str]) -> None:
    """Check every declared field of ``obj`` (a dataclass instance) and store the
    normalized value (numpy numbers as Python ones, a list as a tuple); ``ValueError``
    ``"<label(name, value)>: must be <what>."`` on the first wrong one."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        if _KEY in f.metadata:
            value = getattr(obj, f.name)
            new = _check(value, hints[f.name], f.metadata[_KEY], label(f.name, value))
            if new is not value:
                object.__setattr__(obj, f.name, new)  # frozen dataclasses too


def defaults(cls, names=None) -> dict[str, Any]:
    """The declared defaults of ``cls``'s fields (``names``: only these, in that order);
    a required field is absent."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    out = {}
    for name in names or fields:
        f = fields[name]
        if f.default is not dataclasses.MISSING:
            out[name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[name] = f.default_factory()
    return out


def choices(cls, name: str) -> tuple:
    """The allowed values of ``cls``'s ``Literal`` field ``name`` (``None`` aside)."""
    return _literal(_hints(cls)[name])


@functools.cache
def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _literal(tp) -> tuple:
    args = _split(tp)[0]
    assert typing.get_origin(args) is Literal, args
    return typing.get_args(args)


def _split(tp) -> tuple[Any, bool]:
    """``(type without None, whether None is allowed)``."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        rest = args[0] if len(args) == 1 else typing.Union[tuple(args)]  # noqa: UP007
        return rest, len(args) < len(typing.get_args(tp))
    return tp, False


def _check(value, tp, bounds: _Bounds, label: str):
    tp, optional = _split(tp)
    if value is None and optional:
        return value
    what = bounds.what or _describe(tp, bounds)
    what = f"None or {what}" if optional and not bounds.what else what
    ok, new, hint = _convert(value, tp, bounds)
    if not ok:
        raise ValueError(f"{label}: must be {what}{hint}.")
    return new


def _describe(tp, bounds: _Bounds) -> str:
    origin = typing.get_origin(tp)
    if tp is bool:
        return "True or False"
    if tp is int:
        return "an int" + bounds.text()
    if tp is float:
        return "a finite float" + bounds.text()
    if origin is Literal:
        return f"one of {typing.get_args(tp)}"
    if origin is tuple and typing.get_args(tp)[-1] is not Ellipsis:
        n = len(typing.get_args(tp))
        return f"{n} numbers" + bounds.text()
    if origin is tuple and typing.get_args(tp)[0] is int:
        return "a list of ints" + bounds.text()
    if origin is tuple:
        return "a list of non-empty strings"
    if tp is str:
        return "a string"
    return f"a {getattr(origin or tp, '__name__', tp)}"


def _convert(value, tp, bounds: _Bounds) -> tuple[bool, Any, str]:
    """``(valid, normalized value, hint for the message)``."""
    origin = typing.get_origin(tp)
    if tp is bool:
        ok = isinstance(value, bool | np.bool_)
        return ok, bool(value) if ok else value, ""
    if tp is int:
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return bounds.holds(int(value)), int(value), ""
        if isinstance(value, float) and value.is_integer():
            return False, value, f"; write {int(value)} (an int, not a float)"
        return False, value, _NOT_BOOL if isinstance(value, bool) else ""
    if tp is float:
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
        ok = ok and math.isfinite(value) and bounds.holds(value)
        return ok, float(value) if ok else value, _NOT_BOOL if isinstance(value, bool) else ""
    if origin is Literal:
        return value in typing.get_args(tp), value, ""
    if origin is tuple:
        return _convert_tuple(value, typing.get_args(tp), bounds)
    return isinstance(value, origin or tp), value, ""


def _convert_tuple(value, args, bounds: _Bounds) -> tuple[bool, Any, str]:
    if args[-1] is Ellipsis and args[0] is int:  # tuple[int, ...]: each element bounded
        value = (value,) if isinstance(value, numbers.Integral) else value
        if not isinstance(value, list | tuple):
            return False, value, ""
        out = [_convert(v, int, bounds) for v in value]
        return all(ok for ok, _, _ in out), tuple(v for _, v, _ in out), ""
    if args[-1] is Ellipsis:  # tuple[str, ...]: one string is a tuple of one
        value = (value,) if isinstance(value, str) else value
        ok = isinstance(value, list | tuple) and all(isinstance(v, str) and v for v in value)
        return ok, tuple(value) if ok else value, ""
    if not isinstance(value, list | tuple) or len(value) != len(args):
        return False, value, ""
    out = [_convert(v, t, bounds) for v, t in zip(value, args)]
    return all(ok for ok, _, _ in out), tuple(v for _, v, _ in out), ""
