"""Qwen2-VL's parallel plans: a natural-order Ulysses tower; vision TP with the
LayerNorm MLP's ``fc1`` column-wise and ``fc2`` row-wise."""

from __future__ import annotations

from ray_disagg.models.qwen_common.parallelize import NaturalOrderPlan

__all__ = ["TOWER_MLP", "TOWER_PLAN"]

TOWER_PLAN = NaturalOrderPlan()
TOWER_MLP = (("fc1",), "fc2")
