"""The weight conversions of transformers' loader that sharded loading reproduces, one model
tensor at a time: Hub checkpoints of the MoE families store experts per expert
(``mlp.experts.<i>.gate_proj.weight``, merged into ``mlp.experts.gate_up_proj``) or
transposed (``(E, H, 2I)`` for ``(E, 2I, H)``). Supported operations: ``MergeModulelist``
(stack the experts), ``Concatenate`` and ``Transpose``; any other is named in a
``ValueError`` on the driver."""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

__all__ = ["Converted", "unsupported_operation"]

_SUPPORTED = ("MergeModulelist", "Concatenate", "Transpose")


def unsupported_operation(converter) -> str | None:
    """The name of the first operation of ``converter`` this module cannot run."""
    for op in converter.operations:
        if type(op).__name__ not in _SUPPORTED:
            return type(op).__name__
    return None


class Converted:
    """One model tensor built from checkpoint tensors by a transformers ``WeightConverter``."""

    def __init__(self, converter):
        self.converter = converter
        self.sources: dict[str, dict[int, str]] = {p: {} for p in converter.source_patterns}

    def add(self, pattern: str, ck_key: str) -> None:
        """Record checkpoint tensor ``ck_key``, matched by source ``pattern``."""
        index = 0
        if "*" in pattern:
            rx = re.escape(pattern).replace(r"\*", r"(\d+)")
            index = int(re.search(rx, ck_key).group(1))
        self.sources[pattern][index] = ck_key

    def source_keys(self) -> list[str]:
        return [k for p in self.sources.values() for _, k in sorted(p.items())]

    def build(self, load: Callable[[str], torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        """The model tensor of ``shape`` from ``load(ck_key)`` (a ``meta`` tensor when
        ``load`` gives ``meta`` tensors: the shape check reads only headers)."""
        pieces = [[load(k) for _, k in sorted(p.items())] for p in self.sources.values()]
        return self._apply(pieces, shape)

    def build_region(self, load, load_rows, shape: tuple[int, ...], region) -> torch.Tensor:
        """``build(load, shape)[region]``, reading only the experts (dim 0) in ``region``
        where the conversion keeps experts on dim 0: the per-expert tensors of those
        experts (``load``), or those rows of a stacked one (``load_rows(key, lo, hi)``)."""
        if not self._keeps_experts():
            return self.build(load, shape)[region]
        lo, hi, _ = region[0].indices(shape[0])
        pieces = []
        for pattern in self.sources.values():
            if len(pattern) > 1 or "MergeModulelist" in self._ops():
                pieces.append([load(k) for i, k in sorted(pattern.items()) if lo <= i < hi])
            else:
                pieces.append([load_rows(pattern[0], lo, hi)])
        out = self._apply(pieces, (hi - lo, *shape[1:]))
        return out[(slice(None), *region[1:])]

    def _ops(self) -> list[str]:
        return [type(op).__name__ for op in self.converter.operations]

    def _keeps_experts(self) -> bool:
        """Every operation leaves dim 0 as the expert index."""
        for op in self.converter.operations:
            name = type(op).__name__
            if name == "MergeModulelist" and op.dim != 0:
                return False
            if name == "Concatenate" and op.dim == 0:
                return False
            if name == "Transpose" and 0 in (op.dim0, op.dim1):
                return False
        return True

    def _apply(self, pieces: list[list[torch.Tensor]], shape) -> torch.Tensor:
        for op in self.converter.operations:
            name = type(op).__name__
            if name == "MergeModulelist":
                pieces = [[torch.stack(p, dim=op.dim)] for p in pieces]
            elif name == "Concatenate":
                pieces = [[torch.cat([p[0] for p in pieces], dim=op.dim)]]
            elif name == "Transpose":
                pieces = [[self._transpose(p[0], op, shape)] for p in pieces]
        (out,) = pieces[0]
        return out

    @staticmethod
    def _transpose(t: torch.Tensor, op, shape) -> torch.Tensor:
        if op.check_dims and tuple(t.shape) == tuple(shape):
            return t  # already in the model's layout (e.g. saved by transformers >= 5)
        return t.transpose(op.dim0, op.dim1).contiguous()
