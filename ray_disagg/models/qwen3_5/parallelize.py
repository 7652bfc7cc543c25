"""Qwen3.5's parallel plans: the tower is Qwen3-VL's without DeepStack (the same natural
order, position-embedding taps and MLP names). The decoder has no TP plan: its Gated
DeltaNet layers fuse q, k and v into one projection and one depthwise convolution whose
channels would have to be regrouped per head; FSDP2 shards it instead."""

from __future__ import annotations

from ray_disagg.models.qwen3_vl.parallelize import PER_HEAD_NORMS, TOWER_MLP, TOWER_PLAN

__all__ = ["LINEAR_ATTENTION", "PER_HEAD_NORMS", "TOWER_MLP", "TOWER_PLAN"]

LINEAR_ATTENTION = (
    "its linear_attention layers (Gated DeltaNet: a fused q/k/v projection and depthwise "
    "convolution) have no tensor-parallel plan"
)
