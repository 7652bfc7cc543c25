"""Expert parallelism for mixture-of-experts decoders (HF's 3-D expert tensors:
``experts.gate_up_proj`` ``(E, 2I, H)``, ``experts.down_proj`` ``(E, H, I)``).

The ``ep`` ranks of an expert group are data-parallel replicas of everything else: each
holds ``E / ep`` experts (a ``Shard(0)`` DTensor on the ``ep`` mesh) and its own tokens.
Routing is HF's, unchanged (same softmax, top-k and renormalised weights, computed on
the token's own rank; no token is dropped). In each MoE layer a rank sends every
(token, chosen expert) pair to the expert's owner (all-to-all), the owner runs its
experts on what it received, and a second all-to-all brings the results back, where
they are weighted and summed per token as HF does. Gradients flow back through the
same all-to-alls (in reverse), so an expert's gradient holds every ep rank's tokens;
ranks holding the same experts (``dp / ep`` of them) then sum theirs
(:func:`expert_parameters`, reduced by the step).

The split sizes of the token all-to-all are read on the host: one small device-to-host
copy per MoE layer (and again when activation checkpointing recomputes the layer), as in
every dropless EP implementation; ``all_to_all_single`` takes its splits as host ints.
It is the step's only host sync before the loss; the cross-group transfers it follows are
already waited on by then. Under autocast the tokens cross in the autocast dtype (the
experts' linears would cast them anyway), half the bytes of fp32."""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

__all__ = ["AllToAll", "expert_modules", "expert_parameters", "parallelize_experts"]

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


class AllToAll(torch.autograd.Function):
    """Rows exchanged between the ranks of ``group``.

    Forward: ``x`` ``(sum(send), ...)`` -> ``(sum(recv), ...)``: the ``send[j]`` rows
    after ``sum(send[:j])`` go to rank ``j``; the ``recv[j]`` rows from rank ``j`` arrive
    in rank order. Backward: the gradient goes the reverse way (``recv`` rows sent back,
    ``send`` rows received)."""

    @staticmethod
    def forward(ctx, x, recv: list[int], send: list[int], group):
        ctx.recv, ctx.send, ctx.group = recv, send, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None


def expert_modules(decoder: nn.Module) -> list[nn.Module]:
    """The expert collections (modules with 3-D ``gate_up_proj``/``down_proj``)."""
    return [
        m
        for m in decoder.modules()
        if all(isinstance(getattr(m, n, None), nn.Parameter) for n in EXPERT_WEIGHTS)
    ]


def expert_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The expert-sharded parameters of ``module`` (those :func:`parallelize_experts`
    sharded; found by their module, as materializing replaces the parameter objects)."""
    return [
        getattr(m, n) for m in module.modules() if hasattr(m, "ep_group") for n in EXPERT_WEIGHTS
    ]


def parallelize_experts(decoder: nn.Module, ep_mesh: DeviceMesh) -> int:
    """Shard every expert collection of ``decoder`` (on ``meta`` or materialized) over the
    1-D ``ep_mesh`` along the expert dimension and route its tokens by all-to-all;
    returns the number of collections. The experts' HF ``forward`` is replaced by
    :func:`_forward` on each instance."""
    mods = expert_modules(decoder)
    for m in mods:
        for name in EXPERT_WEIGHTS:
            full = getattr(m, name)
            shard = distribute_tensor(full.data, ep_mesh, [Shard(0)])
            setattr(m, name, nn.Parameter(shard, requires_grad=full.requires_grad))
        m.forward = types.MethodType(_forward, m)
        m.ep_group = ep_mesh.get_group()
    return len(mods)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _run_experts(m: nn.Module, blocks: list[torch.Tensor], ep: int) -> list[torch.Tensor]:
    """Each local expert on its rows from every source rank (``blocks`` in (source,
    expert) order); the outputs in the same order. Experts without rows still run (on 0
    rows) so that every parameter gets a gradient."""
    gate_up, down = _local(m.gate_up_proj), _local(m.down_proj)
    n_local = gate_up.shape[0]
    out: list[torch.Tensor | None] = [None] * len(blocks)
    for e in range(n_local):
        ids = [s * n_local + e for s in range(ep)]
        rows = torch.cat([blocks[i] for i in ids])
        gate, up = F.linear(rows, gate_up[e]).chunk(2, dim=-1)
        y = F.linear(m.act_fn(gate) * up, down[e])
        for i, piece in zip(ids, y.split([blocks[i].shape[0] for i in ids])):
            out[i] = piece
    return out


def _forward(m, hidden_states, top_k_index, top_k_weights):
    """HF's experts forward ``(N, H)`` -> ``(N, H)`` with the experts spread over
    ``m.ep_group`` (see the module docstring)."""
    group = m.ep_group
    ep, k = dist.get_world_size(group), top_k_index.shape[-1]
    n_experts = _local(m.gate_up_proj).shape[0] * ep
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
    token = order // k
    counts = torch.zeros(n_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would sync (its max)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)  # [source, local expert]
    both = torch.cat([counts.view(ep, -1).sum(1), recv_counts]).tolist()  # the host read
    send, per_block = both[:ep], both[ep:]
    n_local = n_experts // ep
    recv = [sum(per_block[s * n_local : (s + 1) * n_local]) for s in range(ep)]
    rows = hidden_states[token]
    device = rows.device.type
    if torch.is_autocast_enabled(device):  # the experts' linears cast to it anyway
        rows = rows.to(torch.get_autocast_dtype(device))
    x = AllToAll.apply(rows, recv, send, group)
    y = torch.cat(_run_experts(m, list(x.split(per_block)), ep))
    back = AllToAll.apply(y, send, recv, group)
    weights = top_k_weights.reshape(-1)[order, None]
    out = torch.zeros_like(hidden_states)
    return out.index_add_(0, token, (back * weights).to(out.dtype))
