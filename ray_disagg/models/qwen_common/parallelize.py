"""The parallel plans of the Qwen VL families, the only place that names their modules for
parallelism: the Ulysses tower plans (natural and window order), the vision-TP block plan
(with the fused ``attn.qkv`` split into ``q``/``k``/``v``), the decoder TP plan, and the
sizes a model-parallel degree must divide."""

from __future__ import annotations

import torch
from transformers.vision_utils import (
    get_vision_attention_seqlens,
    get_vision_position_ids,
    get_vision_window_index,
)

from ray_disagg.parallel.tensor_parallel import BlockTPPlan, LinearSplit, SplitLinear
from ray_disagg.parallel.ulysses import TowerPlan

__all__ = [
    "LLM_TP_PLAN",
    "NaturalOrderPlan",
    "QKV_SPLIT",
    "QwenParallelMixin",
    "SplitQKV",
    "WindowOrderPlan",
    "tower_tp_plan",
]

QKV_SPLIT = LinearSplit(module="qkv", pieces=("q", "k", "v"))
"""The vision attention's fused ``qkv`` as the row blocks ``qkv.q``/``qkv.k``/``qkv.v``
(the vision-TP checkpoint names)."""

LLM_TP_PLAN = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}


class SplitQKV(SplitLinear):
    """The vision attention's fused ``qkv`` Linear as ``q``/``k``/``v`` Linears; with
    sharded q/k/v the output ``[q_r | k_r | v_r]`` of this rank's heads is what HF's
    reshape reads as ``(seq, 3, local_heads, head_dim)``."""

    def __init__(self, qkv: torch.nn.Linear):
        super().__init__(qkv, QKV_SPLIT.pieces)


def tower_tp_plan(mlp_cols: tuple[str, ...], mlp_row: str) -> BlockTPPlan:
    """q/k/v (split) and the MLP's ``mlp_cols`` column-wise, the attention output and the
    MLP's ``mlp_row`` row-wise; heads divided on ``attn.num_heads``."""
    styles = {f"attn.qkv.{w}": "colwise" for w in QKV_SPLIT.pieces}
    styles["attn.proj"] = "rowwise"
    styles.update({f"mlp.{c}": "colwise" for c in mlp_cols})
    styles[f"mlp.{mlp_row}"] = "rowwise"
    return BlockTPPlan(
        blocks="blocks", styles=styles, heads="attn.num_heads", splits={"attn.qkv": QKV_SPLIT}
    )


class NaturalOrderPlan(TowerPlan):
    """Every block attends over whole images/frames in natural patch order (Qwen2-VL)."""

    def merge_unit(self, tower):
        return tower.config.spatial_merge_size**2

    def outputs(self, out):
        return [out.pooler_output, *(getattr(out, "deepstack_features", None) or [])]

    def full_attention_modules(self, tower):
        return [blk.attn for blk in tower.blocks]

    def full_cu_seqlens(self, tower, grid_thw):
        return get_vision_attention_seqlens(grid_thw, tower.config)[0]

    def local_kwargs(self, tower, grid_thw, index, lo, hi):
        pos = get_vision_position_ids(grid_thw, tower.spatial_merge_size)
        return {
            "position_ids": pos[index],
            "cu_seqlens": torch.tensor([0, hi - lo], dtype=torch.int32),
        }


class WindowOrderPlan(NaturalOrderPlan):
    """Qwen2.5-VL: the tower attends in window order (which keeps each image's and frame's
    patches together, so the full-attention segments are the natural ones); windowed blocks
    stay local (slices are cut on window boundaries), the ``fullatt_block_indexes`` blocks
    are all-to-all."""

    def _windows(self, tower, grid_thw):
        return get_vision_window_index(
            grid_thw, tower.spatial_merge_size, tower.window_size, tower.patch_size
        )

    def full_attention_modules(self, tower):
        return [tower.blocks[i].attn for i in tower.fullatt_block_indexes]

    def order(self, tower, grid_thw):
        window_index, _ = self._windows(tower, grid_thw)
        unit = self.merge_unit(tower)
        return (window_index[:, None] * unit + torch.arange(unit)).reshape(-1)

    def cuts(self, tower, grid_thw):
        return [int(c) for c in self._windows(tower, grid_thw)[1].tolist()]

    def local_kwargs(self, tower, grid_thw, index, lo, hi):
        cuts = self.cuts(tower, grid_thw)
        local = sorted({lo, hi} | {c for c in cuts if lo <= c <= hi})
        return {
            **super().local_kwargs(tower, grid_thw, index, lo, hi),
            "window_index": torch.arange((hi - lo) // self.merge_unit(tower)),
            "cu_window_seqlens": torch.tensor([c - lo for c in local], dtype=torch.int32),
        }

    def restore(self, tower, grid_thw):
        return torch.argsort(self._windows(tower, grid_thw)[0])


class QwenParallelMixin:
    """The parallel-plan hooks of :class:`~ray_disagg.models.base.ModelAdapter` for the
    Qwen VL families; a family sets ``tower_plan`` and ``tower_mlp``."""

    sp_parts = ("vision",)
    tp_parts = ("vision", "text")
    param_splits = (QKV_SPLIT,)
    tower_plan: TowerPlan = NaturalOrderPlan()
    tower_mlp: tuple[tuple[str, ...], str] | None = None
    """The tower MLP's column-wise linears and its row-wise one, for the uniform-TP
    baseline (``None``: the family has no vision TP plan)."""

    def tower_tp_plan(self, part):
        if self.tower_mlp is None:
            return None
        return tower_tp_plan(*self.tower_mlp)

    def llm_modules(self, module):
        return module.model.language_model, module.lm_head

    def llm_tp_plan(self):
        return dict(LLM_TP_PLAN)

    def sp_plan(self, part):
        return self.tower_plan

    def head_counts(self, part):
        if part == "vision":
            v = self.config.vision_config
            width = getattr(v, "intermediate_size", None) or int(v.embed_dim * v.mlp_ratio)
            return {"vision num_heads": v.num_heads, "vision MLP width": width}
        return super().head_counts(part)
