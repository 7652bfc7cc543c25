"""The parallel plans of the LLaVA-shaped families: the decoder's TP plan (Llama-style
projection names) with vocab-parallel embedding and head (tied or not), and no plan for
the tower: its attention runs over fixed-size tiles, so it scales with data parallelism
(and FSDP2) instead of Ulysses SP or TP."""

from __future__ import annotations

from ray_disagg.models.qwen_common.parallelize import LLM_TP_PLAN

__all__ = ["LlavaParallelMixin"]


class LlavaParallelMixin:
    """The parallel-plan hooks of :class:`~ray_disagg.models.base.ModelAdapter` for the
    LLaVA-shaped families."""

    sp_parts = ()
    sp_refusals = {
        "vision": "its tower attends within fixed-size tiles of a few hundred to a few "
        "thousand patches each, which need no sequence split (Ulysses SP would only "
        "add all-to-alls)"
    }
    tp_parts = ("text",)

    def llm_modules(self, module):
        return module.model.language_model, module.lm_head

    def llm_tp_plan(self):
        return dict(LLM_TP_PLAN)
