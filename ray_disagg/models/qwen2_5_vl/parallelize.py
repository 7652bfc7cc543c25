"""Qwen2.5-VL's parallel plans: a window-order Ulysses tower; vision TP with the gated
MLP's ``gate_proj``/``up_proj`` column-wise and ``down_proj`` row-wise."""

from __future__ import annotations

from ray_disagg.models.qwen_common.parallelize import WindowOrderPlan

__all__ = ["TOWER_MLP", "TOWER_PLAN"]

TOWER_PLAN = WindowOrderPlan()
TOWER_MLP = (("gate_proj", "up_proj"), "down_proj")
