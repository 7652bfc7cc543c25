"""Qwen3-VL-MoE's parallel plans: the tower's are Qwen3-VL's; in the decoder TP shards the
attention and the dense MLPs of ``mlp_only_layers``. The routed experts and the router
stay whole on every tp rank (each rank routes the same full hidden states, so their
gradients agree across tp); expert parallelism is what shards them."""

from __future__ import annotations

from ray_disagg.models.qwen_common.parallelize import LLM_TP_PLAN

__all__ = ["MOE_LLM_TP_PLAN"]

MOE_LLM_TP_PLAN = dict(LLM_TP_PLAN)
"""Qwen's decoder plan; in an MoE layer its ``mlp.*_proj`` entries name nothing and are
skipped (:func:`~ray_disagg.parallel.tensor_parallel.parallelize_text` applies the
entries a layer has)."""
