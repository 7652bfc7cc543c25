"""Qwen3.5's Gated DeltaNet layers under LLM context parallelism, split by heads.

Under context parallelism each ``cp`` rank holds a contiguous slice of the sequence
(:mod:`ray_disagg.parallel.context_parallel`). A Gated DeltaNet layer cannot run on a
slice: its causal convolution and its recurrence (the delta rule's state) run along the
whole row. Its heads, though, are independent until ``out_proj`` sums them (the gated
norm is per head, with one weight shared by all). So each such layer
(:func:`split_linear_attention_heads`) runs the whole sequence with this rank's share of
the heads:

1. the slice's hidden states ``(B, s_r, d)`` are all-gathered into ``(B, S, d)``
   (:class:`~ray_disagg.parallel.context_gather.GatherSequence`);
2. the layer's own forward (HF's, or packing's per-sample one: the spans of
   :mod:`ray_disagg.models.qwen3_5.packing` are whole-row coordinates, which the gathered
   rows are) runs with rank ``r`` of ``n``'s key heads ``[r K/n, (r+1) K/n)`` and the
   value heads HF's ``repeat_interleave`` groups with them, ``[r V/n, (r+1) V/n)``: while
   it runs (:func:`local_heads`, restored even on error) the module's parameters are
   differentiable slices of themselves (the ``[q | k | v]`` rows of ``in_proj_qkv`` and
   the same channels of ``conv1d``, the value heads' rows of ``in_proj_z``,
   ``in_proj_b``, ``in_proj_a``, ``dt_bias`` and ``A_log``, their columns of ``out_proj``;
   under LoRA the base weight and the factor on the same side, ``lora_B`` of the input
   projections, ``lora_A`` of ``out_proj``) and its sizes (``key_dim``, ``value_dim``,
   the head counts, ``conv_dim``) the local ones;
3. ``out_proj``'s output ``(B, S, d)``, this rank's heads' share of the sum, is summed
   over the ranks and cut to the slice
   (:class:`~ray_disagg.parallel.context_gather.ScatterSequence`).

That is exactly the layer's computation (with LoRA dropout, each rank draws its own
dropout mask for its heads' input factors, where one process draws one for all heads:
an equally distributed draw, not the same one). Each rank's parameter gradients land on its
heads' rows of the full tensors (the shared norm weight gets a partial sum), and the
gradients' existing sum over the ``cp`` ranks completes them. A call without a
``context`` runs the layer as before, with all heads.

Communication, over the ``cp`` group, per Gated DeltaNet layer: forward, one all-gather
and one reduce-scatter of ``(B, S, d)`` (the slices padded to the longest); backward, the
reverse (a reduce-scatter of the input's gradient, an all-gather of the output's), again
when activation checkpointing recomputes the layer. The softmax layers' Ulysses
all-to-alls move ``q, k, v`` and the output instead. Each rank holds the layer's input
and activations for the whole sequence, over ``1/n`` of the heads.

Why not pass the recurrent state from slice to slice: rank ``r + 1`` would wait for rank
``r``'s whole slice (the ranks run in turn, forward and again backward, in reverse), or
would need the delta rule's chunked state-transition form reimplemented outside HF's
kernels (and the convolution's last inputs exchanged, and packed samples' boundaries
tracked across slices). The head split keeps every rank busy with HF's own code, and is
exact.
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from ray_disagg.parallel.context_gather import GatherSequence, ScatterSequence

if TYPE_CHECKING:
    from ray_disagg.parallel.context_parallel import ContextSlice

__all__ = ["CONTEXT", "LocalHeads", "local_heads", "split_linear_attention_heads"]

CONTEXT = "context"
"""Keyword of HF's forward carrying the call's
:class:`~ray_disagg.parallel.context_parallel.ContextSlice`."""
INPUT_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


def split_linear_attention_heads(decoder: nn.Module) -> None:
    """Let every ``linear_attn`` layer of ``decoder`` run a call carrying a
    :data:`CONTEXT` on the whole sequence with this rank's heads (see the module
    docstring); a call without one runs as before. The layer's forward at this point
    (HF's, or packing's) is kept and called. ``ValueError`` for a layer whose
    projections are not plain (or LoRA) Linears without biases, e.g. under text TP."""
    for layer in decoder.layers:
        attn = getattr(layer, "linear_attn", None)
        if attn is not None:
            for name in (*INPUT_PROJECTIONS, "out_proj", "conv1d"):
                _check(getattr(attn, name), name)
            attn.forward = types.MethodType(_by_heads(attn.forward), attn)


def _check(module: nn.Module, name: str) -> None:
    base = getattr(module, "base_layer", module)
    if not isinstance(base._parameters.get("weight"), nn.Parameter):
        raise ValueError(
            f"linear_attn.{name} is a {type(module).__name__} without its own weight (text "
            "tensor parallelism); context parallelism splits the Gated DeltaNet's heads of "
            "whole weights: use ContextParallel(size=n, tp=1)"
        )
    if getattr(base, "bias", None) is not None:
        raise ValueError(
            f"linear_attn.{name} has a bias, which HF's Gated DeltaNet has not (its head "
            "split slices weights only): train this model without ContextParallel"
        )


def _by_heads(inner):
    """``inner`` (the layer's forward so far) on the gathered sequence, by heads."""

    def forward(self, hidden_states, *args, **kwargs):
        cp: ContextSlice | None = kwargs.pop(CONTEXT, None)
        if cp is None:
            return inner(hidden_states, *args, **kwargs)
        lens = cp.seq_lens
        whole = GatherSequence.apply(hidden_states, lens, cp.rank, cp.group)
        with local_heads(self, cp.rank, len(lens)):
            partial = inner(whole, *args, **kwargs)
        return ScatterSequence.apply(partial, lens, cp.rank, cp.group)

    return forward


@dataclass(frozen=True)
class LocalHeads:
    """Rank ``rank`` of ``n``'s share of a Gated DeltaNet layer: ``(start, length)``
    ranges of the full tensors' rows (or ``out_proj``'s columns) and the local sizes."""

    qkv: tuple[tuple[int, int], ...]
    """Its ``[q | k | v]`` channels (``in_proj_qkv`` rows, ``conv1d`` channels)."""
    value: tuple[int, int]
    """Its value channels (``in_proj_z`` rows, ``out_proj`` columns)."""
    heads: tuple[int, int]
    """Its value heads (``in_proj_b``/``in_proj_a`` rows, ``dt_bias``, ``A_log``)."""
    sizes: dict[str, int]
    """The module's size attributes with this rank's heads."""

    @classmethod
    def of(cls, attn: nn.Module, rank: int, n: int) -> LocalHeads:
        """The share of ``attn`` (its sizes with all heads); ``ValueError`` unless ``n``
        divides its key heads (the value heads are grouped with them)."""
        if attn.num_k_heads % n:
            raise ValueError(
                f"context-parallel degree {n} does not divide the Gated DeltaNet's "
                f"{attn.num_k_heads} key heads (linear_num_key_heads); use a "
                "ContextParallel size that divides them"
            )
        kd, vd, vh = attn.key_dim // n, attn.value_dim // n, attn.num_v_heads // n
        sizes = dict(
            num_k_heads=attn.num_k_heads // n,
            num_v_heads=vh,
            key_dim=kd,
            value_dim=vd,
            conv_dim=2 * kd + vd,
        )
        qkv = ((rank * kd, kd), (attn.key_dim + rank * kd, kd), (2 * attn.key_dim + rank * vd, vd))
        return cls(qkv=qkv, value=(rank * vd, vd), heads=(rank * vh, vh), sizes=sizes)


def _swaps(attn: nn.Module, h: LocalHeads) -> list[tuple[nn.Module, str, int, tuple]]:
    """``(module, parameter name, dim, ranges)`` of each tensor that ``h`` slices."""
    out = [(attn, "dt_bias", 0, (h.heads,)), (attn, "A_log", 0, (h.heads,))]
    out.append((getattr(attn.conv1d, "base_layer", attn.conv1d), "weight", 0, h.qkv))
    rows = {"in_proj_qkv": h.qkv, "in_proj_z": (h.value,)}
    for name in INPUT_PROJECTIONS:
        out += _linear(getattr(attn, name), rows.get(name, (h.heads,)), dim=0)
    return out + _linear(attn.out_proj, (h.value,), dim=1)


def _linear(module: nn.Module, ranges: tuple, dim: int) -> list:
    """A Linear's weight sliced on ``dim`` (0: output rows, 1: input columns); under LoRA
    its base weight and the factors on that side (``lora_B`` rows, ``lora_A`` columns)."""
    base = getattr(module, "base_layer", module)
    factors = getattr(module, "lora_B" if dim == 0 else "lora_A", None) or {}
    return [(m, "weight", dim, ranges) for m in (base, *factors.values())]


def _take(t: torch.Tensor, dim: int, ranges) -> torch.Tensor:
    """The ``(start, length)`` ranges of ``t`` on ``dim``, concatenated (differentiable:
    the gradient lands on those rows of ``t``)."""
    parts = [t.narrow(dim, start, length) for start, length in ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


@contextlib.contextmanager
def local_heads(attn: nn.Module, rank: int, n: int):
    """While the block runs, ``attn`` (a Gated DeltaNet) computes with rank ``rank`` of
    ``n``'s heads only: its parameters are slices of themselves (:class:`LocalHeads`),
    its sizes the local ones; both are put back afterwards, even on error, as
    :func:`~ray_disagg.parallel.row_blocks.read_local` does. The parameters are read
    when the block starts (FSDP2's unsharded ones inside a unit's forward)."""
    h = LocalHeads.of(attn, rank, n)
    swaps = _swaps(attn, h)
    held = [(m, name, m._parameters[name]) for m, name, _, _ in swaps]
    sizes = {a: getattr(attn, a) for a in h.sizes}
    try:
        for (m, name, dim, ranges), (_, _, full) in zip(swaps, held):
            m._parameters[name] = _take(full, dim, ranges)
        for a, value in h.sizes.items():
            setattr(attn, a, value)
        yield h
    finally:
        for m, name, full in held:
            m._parameters[name] = full
        for a, value in sizes.items():
            setattr(attn, a, value)
