"""Qwen3.5's parallel plans. The tower is Qwen3-VL's without DeepStack (the same natural
order, position-embedding taps and MLP names). The decoder's tensor-parallel plan
(:func:`llm_tp_plan`) is Qwen's for the gated full-attention layers (``q_proj``, twice
as wide, holds each head's query and gate together, so it shards by heads like the
others) and the MLPs, plus one for the Gated DeltaNet ``linear_attention`` layers, sharded
by key heads (each rank holds ``linear_num_key_heads / tp`` key heads and the
``linear_num_value_heads / tp`` value heads that HF's ``repeat_interleave`` groups with
them, so tp must divide the key heads):

- ``in_proj_qkv`` fuses ``[q | k | v]`` rows of unequal sizes (``key_dim, key_dim,
  value_dim``): it is split into ``in_proj_qkv.q/.k/.v``
  (:class:`~ray_disagg.parallel.row_blocks.SplitLinear`), each column-wise, so the local
  output is ``[q_r | k_r | v_r]`` of this rank's heads; ``in_proj_z``, ``in_proj_b``
  and ``in_proj_a`` are column-wise (value heads);
- the depthwise ``conv1d`` runs over the same ``[q | k | v]`` channels and HF hands its
  weight to ``causal_conv1d_fn`` as a plain tensor: it is split the same way
  (:class:`~ray_disagg.parallel.row_blocks.SplitConv1d`) with each block sharded by
  channels, and its ``weight`` is the concatenation of the local blocks;
- ``A_log`` and ``dt_bias`` (one per value head) are sharded on dim 0 and read by the
  module as its local rows (:func:`~ray_disagg.parallel.row_blocks.shard_rows`);
- ``key_dim``, ``value_dim`` (HF's split sizes) and the head counts are divided by tp;
- the gated RMSNorm's weight (``linear_attn.norm``, one per value-head dimension) is
  shared by all heads: each rank's gradient is a partial sum, all-reduced over tp like
  the per-head ``q_norm``/``k_norm``;
- ``out_proj`` is row-wise: the partial outputs are all-reduced (DTensor), as ``o_proj``.

Collectives (all over the tp group, run by the Linears' DTensor layouts; the convolution,
the delta rule and the norm are local): forward, one all-reduce of the layer's output
after ``out_proj``; backward, each of the six column-wise Linears (``q``, ``k``, ``v``,
``z``, ``b``, ``a``) all-reduces its input gradient, as the attention's q/k/v do; once a
step, the gated norm's gradient. Checkpoints keep HF's fused names and rows for the split
blocks (:data:`IN_PROJ_QKV_SPLIT`, :data:`CONV1D_SPLIT`; the adapter's ``hf_param_name``).
In Qwen3.5-MoE the experts, the router and the shared expert stay whole on every tp rank
(as in Qwen3-VL-MoE)."""

from __future__ import annotations

from ray_disagg.models.qwen3_vl.parallelize import PER_HEAD_NORMS as QWEN3_PER_HEAD_NORMS
from ray_disagg.models.qwen3_vl.parallelize import TOWER_MLP, TOWER_PLAN
from ray_disagg.models.qwen_common.parallelize import LLM_TP_PLAN
from ray_disagg.parallel.tensor_parallel import LayerTPPlan, LinearSplit

__all__ = [
    "CONV1D_SPLIT",
    "IN_PROJ_QKV_SPLIT",
    "PER_HEAD_NORMS",
    "TOWER_MLP",
    "TOWER_PLAN",
    "linear_attention_counts",
    "llm_tp_plan",
]

QKV = ("q", "k", "v")
IN_PROJ_QKV_SPLIT = LinearSplit(module="in_proj_qkv", pieces=QKV)
"""The Gated DeltaNet's fused ``in_proj_qkv`` as the row blocks ``in_proj_qkv.q/.k/.v``
(the text-TP checkpoint names; the sizes come from the config, :func:`llm_tp_plan`)."""
CONV1D_SPLIT = LinearSplit(module="conv1d", pieces=QKV)
"""Its depthwise ``conv1d`` as the channel blocks ``conv1d.q/.k/.v``."""

PER_HEAD_NORMS = (*QWEN3_PER_HEAD_NORMS, "linear_attn.norm")

LINEAR_ATTENTION_STYLES = {
    **{f"linear_attn.in_proj_qkv.{w}": "colwise" for w in QKV},
    "linear_attn.in_proj_z": "colwise",
    "linear_attn.in_proj_b": "colwise",
    "linear_attn.in_proj_a": "colwise",
    "linear_attn.out_proj": "rowwise",
}
SHARDED = (
    *(f"linear_attn.conv1d.{w}.weight" for w in QKV),
    "linear_attn.A_log",
    "linear_attn.dt_bias",
)
DIVIDED = tuple(
    f"linear_attn.{a}" for a in ("key_dim", "value_dim", "conv_dim", "num_k_heads", "num_v_heads")
)


def llm_tp_plan(text_config) -> LayerTPPlan:
    """The decoder layers' TP plan (see the module docstring); entries a layer lacks
    (the linear attention in a full-attention layer, the dense MLP in an MoE layer) are
    skipped."""
    t = text_config
    key_dim = t.linear_num_key_heads * t.linear_key_head_dim
    sizes = (key_dim, key_dim, t.linear_num_value_heads * t.linear_value_head_dim)
    splits = {
        f"linear_attn.{s.module}": LinearSplit(module=s.module, pieces=QKV, sizes=sizes)
        for s in (IN_PROJ_QKV_SPLIT, CONV1D_SPLIT)
    }
    return LayerTPPlan(
        styles={**LLM_TP_PLAN, **LINEAR_ATTENTION_STYLES},
        splits=splits,
        sharded=SHARDED,
        divided=DIVIDED,
    )


def linear_attention_counts(text_config) -> dict[str, int]:
    """The sizes a text TP degree must divide in the linear-attention layers: the key
    heads (the value heads are grouped with them, so they divide too)."""
    return {"linear_num_key_heads": text_config.linear_num_key_heads}
