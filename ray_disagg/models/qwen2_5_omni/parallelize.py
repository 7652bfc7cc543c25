"""Qwen2.5-Omni thinker's parallel plans: the vision part as Qwen2.5-VL's (window-order
Ulysses tower; no vision TP plan), the audio part neither SP nor TP, the text part TP."""

from __future__ import annotations

from ray_disagg.models.qwen_common.parallelize import WindowOrderPlan

__all__ = ["TOWER_PLAN", "OmniParallelMixin"]

TOWER_PLAN = WindowOrderPlan()


class OmniParallelMixin:
    """The thinker's overrides of the Qwen VL plan hooks (put before the Qwen adapter)."""

    sp_parts = ("vision",)
    sp_refusals = {
        "audio": "its encoder attends within chunks of 2 x n_window mel frames (a few "
        "seconds of audio each), which need no sequence split"
    }
    tp_parts = ("text",)
    tp_refusals = {
        "vision": "no tensor-parallel plan for the Omni tower's separate q/k/v projections "
        "(the vision TP plans cover the fused-qkv towers); SequenceParallel scales it",
        "audio": "no tensor-parallel plan for the audio encoder, which is small next to the LLM",
    }

    def sp_plan(self, part):
        if part != "vision":
            raise ValueError(f"part {part!r} does not support sequence parallelism.")
        return self.tower_plan

    def head_counts(self, part):
        if part == "audio":
            return {
                "audio encoder_attention_heads": self.config.audio_config.encoder_attention_heads
            }
        return super().head_counts(part)
