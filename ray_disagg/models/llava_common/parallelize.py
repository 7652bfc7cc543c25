"""The parallel plans of the LLaVA-shaped families: the decoder's TP plan (Llama-style
projection names) with vocab-parallel embedding and head (tied or not), and no plan for
the tower: its attention runs within fixed-size tiles, so it scales with data parallelism
(and FSDP2) and with tile sequence parallelism (``SequenceParallel``: the tiles of a
microbatch split across the SP ranks, :mod:`~ray_disagg.parallel.tile_parallel`; no
Ulysses all-to-all and no head split, so no head count to divide) instead of TP."""

from __future__ import annotations

from ray_disagg.models.qwen_common.parallelize import LLM_TP_PLAN

__all__ = ["LlavaParallelMixin"]


class LlavaParallelMixin:
    """The parallel-plan hooks of :class:`~ray_disagg.models.base.ModelAdapter` for the
    LLaVA-shaped families."""

    sp_parts = ("vision",)  # tile SP: whole tiles per rank (parallel.tile_parallel)
    tp_parts = ("text",)
    tp_refusals = {
        "vision": "no tensor-parallel plan for a tile tower: a tile of a few hundred to a "
        "few thousand patches fits one device, and the tower is small next to the LLM "
        "(SequenceParallel splits a microbatch's tiles)"
    }

    def sp_plan(self, part):
        """``None``: tile SP runs the tower unmodified on each rank's tiles (no Ulysses
        plan, no attention swapped)."""
        return None

    def llm_modules(self, module):
        return module.model.language_model, module.lm_head

    def llm_tp_plan(self):
        return dict(LLM_TP_PLAN)
