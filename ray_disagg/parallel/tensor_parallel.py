"""Megatron-style tensor parallelism of a decoder with DTensor, plus a vocab-parallel
embedding, lm_head and cross-entropy (no rank ever holds full-vocab logits).

The per-layer plan comes from the family adapter (typically the attention's q/k/v and the
MLP's input projections column-wise, each rank holding a slice of the heads / of the MLP
width; the output projections row-wise, partial sums all-reduced); norms stay replicated.
A tower's blocks are sharded the same way with a :class:`BlockTPPlan`. A decoder layer
whose modules are more than Linears (Qwen3.5's Gated DeltaNet) has a :class:`LayerTPPlan`:
fused modules split into row blocks and parameters sharded on dim 0 that the module reads
as its local rows (:mod:`ray_disagg.parallel.row_blocks`).
The input embeddings enter the layers replicated; in backward, the column-wise layers'
``Replicate`` input turns their partial input gradients into the full sum, so the gradient
w.r.t. the image embeddings is complete on every tp rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from ray_disagg.parallel.row_blocks import LinearSplit, SplitConv1d, SplitLinear, local, shard_rows

__all__ = [
    "BlockTPPlan",
    "LayerTPPlan",
    "LinearSplit",
    "SplitLinear",
    "VocabParallelCrossEntropy",
    "parallelize_layer",
    "parallelize_text",
    "parallelize_vision",
    "grad_sq_norm",
    "all_reduce_partial_grads",
    "mark_partial_grads",
    "local",
]

_STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def mark_partial_grads(module, per_head_norms) -> None:
    """Mark the parameters of the modules named in ``per_head_norms``: a leaf name
    (``q_norm``) or the end of a dotted path (``linear_attn.norm``, where a bare ``norm``
    would also name the decoder's final norm); call again after anything that replaces
    parameters, e.g. FSDP2."""
    for name, mod in module.named_modules():
        if any(name == n or name.endswith(f".{n}") for n in per_head_norms):
            for p in mod.parameters():
                p._tp_partial_grad = True


def all_reduce_partial_grads(params, tp_group) -> None:
    """Sum over ``tp_group`` the gradients of tp-replicated parameters that see only this
    rank's heads (marked by :func:`mark_partial_grads`); with FSDP2 each rank reduces its
    dp shard, which is the same slice on every tp rank."""
    for p in params:
        if getattr(p, "_tp_partial_grad", False) and p.grad is not None:
            dist.all_reduce(local(p.grad), group=tp_group)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over vocab-sharded logits.

    Forward: ``logits`` ``(N, V_r)`` (this rank's vocab rows ``[start, start + V_r)``; the
    ranks' ``V_r`` may differ: :func:`vocab_rows`),
    ``target`` ``(N,)`` -> per-token loss ``(N,)`` (0 where ``target == ignore_index``),
    using an all-reduce MAX and two all-reduce SUMs over ``group`` of ``(N,)`` vectors.
    Backward: ``(softmax - onehot) * grad`` on the local vocab slice; no communication.
    """

    @staticmethod
    def forward(ctx, logits, target, vocab_start: int, ignore_index: int, group):
        logits = logits.float()
        n_local = logits.shape[-1]
        max_logit = logits.max(dim=-1).values
        dist.all_reduce(max_logit, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - max_logit.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)

        valid = target != ignore_index
        local_t = target - vocab_start
        mine = valid & (local_t >= 0) & (local_t < n_local)
        idx = torch.where(mine, local_t, torch.zeros_like(local_t))
        target_logit = shifted.gather(-1, idx.unsqueeze(-1)).squeeze(-1) * mine
        dist.all_reduce(target_logit, group=group)
        loss = (sum_exp.log() - target_logit) * valid

        softmax = exp / sum_exp.unsqueeze(-1)
        ctx.save_for_backward(softmax, idx, mine, valid)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, idx, mine, valid = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, idx.unsqueeze(-1), -mine.to(grad.dtype).unsqueeze(-1))
        grad *= (grad_loss * valid).unsqueeze(-1)
        return grad, None, None, None, None


def _is_lora(module: torch.nn.Module) -> bool:
    """PEFT's LoRA layer: the wrapped ``base_layer`` plus ``lora_A`` / ``lora_B`` dicts."""
    return hasattr(module, "base_layer") and hasattr(module, "lora_A")


def _lora_styles(root: torch.nn.Module, name: str, style: str) -> dict[str, str]:
    """The plan entries of module ``name`` of ``root``: itself, or for a LoRA layer its
    ``base_layer`` sharded as the plan says and the factor that meets the shard sharded
    with it: a column-wise base's ``lora_B`` by rows (``lora_A`` whole), a row-wise base's
    ``lora_A`` by columns (``lora_B`` whole). A piece of a split Linear under LoRA
    (``<fused>.<piece>``): that piece of the split base and of the split ``lora_B``."""
    owner, _, piece = name.rpartition(".")
    if owner and _has(root, owner) and _is_lora(root.get_submodule(owner)):  # a split piece
        keys = root.get_submodule(owner).lora_B
        return {f"{owner}.base_layer.{piece}": style} | {
            f"{owner}.lora_B.{key}.{piece}": style for key in keys
        }
    if not _has(root, name):
        return {}  # e.g. an MoE layer has no dense MLP
    mod = root.get_submodule(name)
    if not _is_lora(mod):
        return {name: style}
    factor = "lora_B" if style == "colwise" else "lora_A"
    return {f"{name}.base_layer": style} | {
        f"{name}.{factor}.{key}": style for key in getattr(mod, factor)
    }


def _plan(root: torch.nn.Module, styles: dict[str, str]) -> dict:
    """``parallelize_module``'s plan of ``styles`` (name -> ``"colwise"``/``"rowwise"``)
    for the modules ``root`` has, LoRA layers expanded (:func:`_lora_styles`)."""
    out = {}
    for name, style in styles.items():
        out.update(_lora_styles(root, name, style))
    return {n: _STYLES[s]() for n, s in out.items()}


def _split(blk: torch.nn.Module, path: str, split: LinearSplit) -> None:
    """Replace the fused module at ``path`` by its row blocks: a depthwise Conv1d by a
    :class:`SplitConv1d`, a Linear by a :class:`SplitLinear`; under LoRA the Linear's
    ``base_layer`` and ``lora_B`` (rows in the same blocks; ``lora_A`` is shared)."""
    mod, pieces, sizes = blk.get_submodule(path), split.pieces, split.sizes
    if isinstance(mod, torch.nn.Conv1d):
        _set(blk, path, SplitConv1d(mod, pieces, sizes))
        return
    if not _is_lora(mod):
        _set(blk, path, SplitLinear(mod, pieces, sizes))
        return
    mod.base_layer = SplitLinear(mod.base_layer, pieces, sizes)
    for key in list(mod.lora_B):
        mod.lora_B[key] = SplitLinear(mod.lora_B[key], pieces, sizes)


def _has(module: torch.nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


def parallelize_text(
    part, lm, lm_head, tp_mesh, layer_plan: dict[str, str] | LayerTPPlan, per_head_norms=()
) -> tuple[dist.ProcessGroup, int]:
    """Shard the LLM part in place over the 1-D ``tp_mesh``: each of the decoder ``lm``'s
    ``.layers`` with ``layer_plan`` (a :class:`LayerTPPlan`, or just its ``styles``:
    layer-relative module name -> ``"colwise"`` / ``"rowwise"``, from the family
    adapter; :func:`parallelize_layer`), ``lm.embed_tokens`` vocab-parallel and the
    ``lm_head`` module vocab-sharded (:func:`vocab_rows` rows a rank; any vocabulary
    size). Parameters of the modules named in ``per_head_norms`` (per-head norms of q and
    k) see only this rank's heads: their gradients are
    partial sums (see :func:`all_reduce_partial_grads`). Tied embeddings
    (``tie_word_embeddings``) stay one parameter: the embedding's rows and the head's
    output rows are the same vocabulary slice (both ``Shard(0)``), so the head takes the
    embedding's shard and both gradients add into it. Returns the tp group and the first
    vocab row of this rank's logits (for :class:`VocabParallelCrossEntropy`)."""
    tied = lm_head.weight is lm.embed_tokens.weight
    if not isinstance(layer_plan, LayerTPPlan):
        layer_plan = LayerTPPlan(styles=layer_plan)
    for layer in lm.layers:
        parallelize_layer(layer, layer_plan, tp_mesh)
    mark_partial_grads(lm, per_head_norms)
    # vocab-parallel embedding: row shards of the table, partial lookups summed
    parallelize_module(
        lm,
        tp_mesh,
        {"embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())},
    )
    # vocab-parallel lm_head: each rank produces only its slice of the logits
    head_name = next(n for n, m in part.named_modules() if m is lm_head)
    parallelize_module(
        part, tp_mesh, {head_name: ColwiseParallel(output_layouts=Shard(-1), use_local_output=True)}
    )
    if tied:
        lm_head.weight = lm.embed_tokens.weight
    vocab = lm_head.weight.shape[0]
    vocab_start = min(tp_mesh.get_local_rank() * vocab_rows(vocab, tp_mesh.size()), vocab)
    return tp_mesh.get_group(), vocab_start


def vocab_rows(vocab_size: int, tp: int) -> int:
    """Vocabulary rows of a rank's embedding and ``lm_head`` shard under ``tp``-way TP:
    ``ceil(vocab_size / tp)`` (torch's chunks), the last rank's shard shorter when ``tp``
    does not divide the vocabulary (InternVL3's 151674 under TP4: 3 x 37919 + 37917), so
    checkpoints and exports keep HF's shapes. Where the ranks' logits must be equally wide
    (the sampling's gathers) the short shard is padded with ``-inf`` logits, never drawn;
    the loss reads only real rows.

    Example:
        >>> vocab_rows(151674, 4), vocab_rows(135, 2)
        (37919, 68)
    """
    return -(-vocab_size // tp)


@dataclass(frozen=True, kw_only=True)
class LayerTPPlan:
    """Tensor-parallel plan of a decoder layer (from the family adapter). Paths are
    layer-relative; what a layer lacks is skipped (an MoE layer has no dense MLP, a
    full-attention layer no linear attention)."""

    styles: dict[str, str]
    """Module name -> ``"colwise"``/``"rowwise"`` (split blocks are named
    ``<fused path>.<piece>``)."""
    splits: dict[str, LinearSplit] = field(default_factory=dict)
    """Path of a fused Linear or depthwise Conv1d -> its :class:`LinearSplit` (with the
    blocks' ``sizes`` where they differ; split first)."""
    sharded: tuple[str, ...] = ()
    """Parameters outside the styles' Linears sharded on dim 0, which their module reads
    as this rank's rows (:func:`~ray_disagg.parallel.row_blocks.shard_rows`)."""
    divided: tuple[str, ...] = ()
    """Integer attributes (head counts, widths) the module sizes its local tensors with,
    divided by tp."""

    def fused_styles(self) -> dict[str, str]:
        """``styles`` by the modules of the unsplit HF layer (for estimates over the HF
        model, e.g. the planner's memory): a split module is sharded as its blocks, and a
        block whose weight is in ``sharded`` counts as ``"colwise"`` (rows sharded)."""
        out = dict(self.styles)
        for path, split in self.splits.items():
            first = f"{path}.{split.pieces[0]}"
            sharded = f"{first}.weight" in self.sharded
            style = out.get(first, "colwise" if sharded else None)
            if style is not None:
                out[path] = style
        return out


def parallelize_layer(layer: torch.nn.Module, plan: LayerTPPlan, tp_mesh) -> None:
    """Shard one decoder ``layer`` in place with ``plan``: the splits, then the styles
    (LoRA layers: see :func:`_lora_styles`), the dim-0 shards and the divided sizes."""
    for path, split in plan.splits.items():
        if _has(layer, path):
            _split(layer, path, split)
    parallelize_module(layer, tp_mesh, _plan(layer, plan.styles))
    shard_rows(layer, plan.sharded, tp_mesh)
    for path in plan.divided:
        owner, _, attr = path.rpartition(".")
        mod = layer.get_submodule(owner) if _has(layer, owner) else None
        if mod is not None and hasattr(mod, attr):
            setattr(mod, attr, getattr(mod, attr) // tp_mesh.size())


@dataclass(frozen=True, kw_only=True)
class BlockTPPlan:
    """Tensor-parallel plan of a tower's transformer blocks (from the family adapter)."""

    blocks: str
    """Dotted path, in the tower, of the ``ModuleList`` of blocks."""
    styles: dict[str, str]
    """Block-relative module name -> ``"colwise"``/``"rowwise"`` (split blocks are named
    ``<fused path>.<piece>``)."""
    heads: str
    """Block-relative dotted path of the attention's head-count attribute (divided by tp)."""
    splits: dict[str, LinearSplit] = field(default_factory=dict)
    """Block-relative path of a fused Linear -> its :class:`LinearSplit` (split first)."""


def _set(root: torch.nn.Module, path: str, value) -> None:
    owner, _, attr = path.rpartition(".")
    setattr(root.get_submodule(owner) if owner else root, attr, value)


def parallelize_vision(tower, plan: BlockTPPlan, tp_mesh) -> None:
    """Shard every block of ``tower`` in place with ``plan``: attention by heads, the MLP
    by its width; everything outside the blocks (patch embedding, merger) stays
    replicated. The plan's fused Linears are split first (:class:`SplitLinear`). LoRA
    layers: see :func:`_lora_styles`."""
    for blk in tower.get_submodule(plan.blocks):
        for path, split in plan.splits.items():
            _split(blk, path, split)
        parallelize_module(blk, tp_mesh, _plan(blk, plan.styles))
        owner, _, attr = plan.heads.rpartition(".")
        attn = blk.get_submodule(owner) if owner else blk
        setattr(attn, attr, getattr(attn, attr) // tp_mesh.size())


def grad_sq_norm(params, group=None, device="cpu") -> float:
    """Squared global grad norm of a group's parameters, whatever shards them (TP, FSDP2,
    both, or nothing): each rank adds ``|local|^2 * shards / world`` (a DTensor's distinct
    local pieces are ``shards`` = the product of its sharded mesh dims, each held by
    ``world / shards`` ranks of ``group``; plain tensors are identical on every rank) and the
    sum is all-reduced over ``group``."""
    world = dist.get_world_size(group) if group is not None else 1
    total = torch.zeros((), dtype=torch.float64, device=device)
    for p in params:
        if p.grad is None:
            continue
        g, shards = p.grad, 1
        if isinstance(g, DTensor):
            for dim, pl in enumerate(g.placements):
                if not pl.is_replicate():  # Shard, or FSDP2 x TP's _StridedShard
                    shards *= g.device_mesh.size(dim)
        # the norm of the local piece without a float64 copy of it (a large embedding's
        # gradient would briefly cost 4x its size); squared and summed in float64
        norm = torch.linalg.vector_norm(local(g)).double()
        total += norm * norm * (shards / world)
    if world > 1:
        dist.all_reduce(total, group=group)
    return float(total)
