"""Parameters that a tensor-parallel plan stores or reads differently from the HF module
that owns them (used by :mod:`ray_disagg.parallel.tensor_parallel`):

- a fused Linear (:class:`SplitLinear`) or depthwise ``Conv1d`` (:class:`SplitConv1d`)
  whose output rows / channels concatenate blocks of different roles (e.g. ``[q | k | v]``)
  is stored as one module per row block (:class:`LinearSplit` names them), so that each
  block is sharded on its own: a contiguous row shard of the fused tensor would mix
  blocks. Blocks may differ in size (Gated DeltaNet's ``key_dim, key_dim, value_dim``).
  On disk a block keeps its place in the fused HF tensor (``hf_param_name`` of the
  family's adapter maps the names; loading and export re-join the rows);
- a parameter sharded on dim 0 that its module's own code reads directly (not through a
  Linear's forward, e.g. a per-head decay ``A_log``, or a convolution weight handed to a
  kernel as a plain tensor): :func:`shard_rows` makes it a ``Shard(0)`` DTensor and
  :func:`read_local` lets the module read this rank's rows as a plain tensor.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

__all__ = [
    "LinearSplit",
    "SplitConv1d",
    "SplitLinear",
    "block_rows",
    "local",
    "read_local",
    "shard_rows",
]


@dataclass(frozen=True, kw_only=True)
class LinearSplit:
    """A fused Linear or depthwise Conv1d (leaf module name ``module``) that a plan stores
    as row blocks ``pieces`` (:class:`SplitLinear`, :class:`SplitConv1d`): its parameters
    ``*.<module>.<piece>.<leaf>`` are rows of the fused ``*.<module>.<leaf>``, the blocks
    in ``pieces`` order."""

    module: str
    """Leaf name of the fused module."""
    pieces: tuple[str, ...]
    """Names of the row blocks, in row order."""
    sizes: tuple[int, ...] | None = None
    """Rows of each block (``None``: equal blocks). Only splitting a module needs them
    (a plan's split, built from the config); the names never do, and loading reads a
    block's rows from the shapes of the model's blocks."""

    def fused_name(self, name: str) -> tuple[str, int | None]:
        """``(fused name, row block index)`` of a block's parameter ``name``;
        ``(name, None)`` for any other name. Under LoRA the blocks sit inside PEFT's
        layer: ``<module>.base_layer.<piece>.<leaf>`` and
        ``<module>.lora_B.<adapter>.<piece>.<leaf>`` are rows of the same names without
        ``<piece>``."""
        head, sep, tail = name.rpartition(f".{self.module}.")
        parts = tail.split(".") if sep else []
        if len(parts) < 2 or parts[-2] not in self.pieces:
            return name, None
        inner = parts[:-2]
        if inner in ([], ["base_layer"]) or (len(inner) == 2 and inner[0] == "lora_B"):
            return ".".join([head, self.module, *inner, parts[-1]]), self.pieces.index(parts[-2])
        return name, None


def _sizes(total: int, pieces: tuple[str, ...], sizes) -> list[int]:
    """Rows of each block of a fused tensor of ``total`` rows."""
    rows = list(sizes) if sizes is not None else [total // len(pieces)] * len(pieces)
    if len(rows) != len(pieces) or sum(rows) != total:
        raise ValueError(f"row blocks {rows} of {list(pieces)} do not make {total} rows")
    return rows


def _copy_rows(dst: nn.Module, src: nn.Module, start: int, rows: int) -> None:
    """``dst``'s weight (and bias) from rows ``[start, start + rows)`` of ``src``'s, with
    their ``requires_grad`` (frozen stays frozen)."""
    for leaf in ("weight", "bias"):
        full = getattr(src, leaf)
        if full is None:
            continue
        p = getattr(dst, leaf)
        with torch.no_grad():
            p.copy_(full[start : start + rows])
        p.requires_grad_(full.requires_grad)


def block_rows(module: nn.Module, hf_name) -> dict[str, tuple[int, int, int]]:
    """``name -> (first row, rows, fused rows)`` of each parameter of ``module`` that is a
    row block of a fused HF tensor (``hf_name``: the family's ``hf_param_name``): the
    blocks' global rows stacked in block order, so blocks may differ in size.
    ``ValueError`` if the module holds only some blocks of a fused tensor."""
    blocks: dict[str, dict[int, tuple[str, int]]] = {}
    counts: dict[str, int] = {}
    for name, p in module.named_parameters():
        fused, index, counts[fused] = hf_name(name)
        if index is not None:
            blocks.setdefault(fused, {})[index] = (name, p.shape[0])
    out = {}
    for fused, held in blocks.items():
        if sorted(held) != list(range(counts[fused])):
            raise ValueError(f"{fused}: the model holds only row blocks {sorted(held)}")
        total, start = sum(rows for _, rows in held.values()), 0
        for index in range(counts[fused]):
            name, rows = held[index]
            out[name] = (start, rows, total)
            start += rows
    return out


class SplitLinear(nn.Module):
    """A fused Linear as one Linear per row block ``pieces`` (``sizes`` rows each, equal
    by default), so that each can be sharded column-wise on its own. ``forward`` returns
    the concatenation like the fused layer; with sharded blocks that is each block's
    local rows in turn."""

    def __init__(self, fused: nn.Linear, pieces: tuple[str, ...], sizes=None):
        super().__init__()
        self.pieces = tuple(pieces)
        start, bias, device = 0, fused.bias is not None, fused.weight.device
        dtype = fused.weight.dtype  # a bf16 model (param_dtype) keeps bf16 blocks
        for name, rows in zip(self.pieces, _sizes(fused.out_features, self.pieces, sizes)):
            lin = nn.Linear(fused.in_features, rows, bias=bias, device=device, dtype=dtype)
            _copy_rows(lin, fused, start, rows)
            setattr(self, name, lin)
            start += rows

    def forward(self, x):
        return torch.cat([getattr(self, name)(x) for name in self.pieces], dim=-1)


class SplitConv1d(nn.Module):
    """A depthwise ``Conv1d`` (one filter per channel) as one depthwise Conv1d per block
    of channels ``pieces`` (``sizes`` channels each), so that each can be sharded by
    channels on its own (:func:`shard_rows`). ``weight`` (and ``bias``) is the
    concatenation of the blocks' (local) ones, a plain tensor, as HF's modules hand it to
    their convolution kernels; ``forward`` convolves with it."""

    def __init__(self, fused: nn.Conv1d, pieces: tuple[str, ...], sizes=None):
        super().__init__()
        channels = fused.out_channels
        if not fused.in_channels == channels == fused.groups:
            raise ValueError(f"SplitConv1d splits a depthwise Conv1d; got {fused}")
        self.pieces, self.padding = tuple(pieces), fused.padding
        self.stride, self.dilation = fused.stride, fused.dilation
        start, bias, device = 0, fused.bias is not None, fused.weight.device
        dtype = fused.weight.dtype  # a bf16 model (param_dtype) keeps bf16 blocks
        for name, rows in zip(self.pieces, _sizes(channels, self.pieces, sizes)):
            conv = nn.Conv1d(
                rows, rows, fused.kernel_size, groups=rows, bias=bias, device=device, dtype=dtype
            )
            _copy_rows(conv, fused, start, rows)
            setattr(self, name, conv)
            start += rows

    def _cat(self, leaf: str) -> torch.Tensor | None:
        parts = [getattr(getattr(self, name), leaf) for name in self.pieces]
        return None if parts[0] is None else torch.cat([local(p) for p in parts])

    @property
    def weight(self) -> torch.Tensor:
        return self._cat("weight")

    @property
    def bias(self) -> torch.Tensor | None:
        return self._cat("bias")

    def forward(self, x):
        w = self.weight
        return F.conv1d(x, w, self.bias, self.stride, self.padding, self.dilation, w.shape[0])


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (any other tensor as it is)."""
    return t.to_local() if isinstance(t, DTensor) else t


def read_local(module: nn.Module, names) -> None:
    """Let ``module``'s forward read its parameters ``names`` as plain tensors of this
    rank's shard: while its (HF) forward runs, they are replaced by their ``to_local()``
    views and put back afterwards, even on error, as ``torch.func.functional_call`` swaps
    parameters (the instance's ``forward`` wraps the one it had: :func:`_local_forward`).
    Outside the forward they are the DTensor parameters (``named_parameters``,
    checkpoints, FSDP2, the optimizer and grad norms see the sharded tensor); ``to_local``
    is differentiable, so the gradient of what the module computed reaches the DTensor's
    gradient."""
    module.forward = types.MethodType(_local_forward(module.forward, tuple(names)), module)


def _local_forward(inner, names: tuple[str, ...]):
    """``inner`` (the module's forward so far) with the parameters ``names`` read locally."""

    def forward(self, *args, **kwargs):
        held = {n: self._parameters[n] for n in names}
        try:
            self._parameters.update({n: local(p) for n, p in held.items()})
            return inner(*args, **kwargs)
        finally:
            self._parameters.update(held)

    return forward


def shard_rows(root: nn.Module, paths, tp_mesh) -> None:
    """Shard the parameters at ``paths`` (relative to ``root``; those it lacks skipped)
    on dim 0 over the 1-D ``tp_mesh`` (``Shard(0)`` DTensors: rank ``r`` holds rows
    ``[r n / tp, (r + 1) n / tp)``) and let their modules read the local rows
    (:func:`read_local`). On ``meta`` or materialized; a frozen parameter stays frozen."""
    owners: dict[str, list[str]] = {}
    for path in paths:
        owner, _, name = path.rpartition(".")
        try:
            mod = root.get_submodule(owner)
        except AttributeError:
            continue
        if isinstance(mod._parameters.get(name), nn.Parameter):
            owners.setdefault(owner, []).append(name)
    for owner, names in owners.items():
        mod = root.get_submodule(owner)
        for name in names:
            full = mod._parameters[name]
            shard = distribute_tensor(full.data, tp_mesh, [Shard(0)])
            setattr(mod, name, nn.Parameter(shard, requires_grad=full.requires_grad))
        read_local(mod, names)
