"""Qwen3-VL: a natural-order vision tower with learned (interpolated) position embeddings
and DeepStack: the blocks in ``deepstack_visual_indexes`` feed extra mergers whose outputs
are added to the LLM's hidden states after its first decoder layers. Each DeepStack
feature crosses to the text part next to the embeddings, and its gradient comes back."""

from __future__ import annotations

from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

from ray_disagg.models.base import Crossing
from ray_disagg.models.qwen3_vl.context import slice_deepstack
from ray_disagg.models.qwen3_vl.flavors import tiny_qwen3_vl_config
from ray_disagg.models.qwen3_vl.parallelize import PER_HEAD_NORMS, TOWER_MLP, TOWER_PLAN
from ray_disagg.models.qwen3_vl.processing import Qwen3VLProcessing
from ray_disagg.models.qwen_common.adapter import MODALITIES, QwenVLAdapter

__all__ = ["Qwen3VLAdapter"]


class Qwen3VLAdapter(Qwen3VLProcessing, QwenVLAdapter):
    model_type = "qwen3_vl"
    config_class = Qwen3VLConfig
    hf_class = Qwen3VLForConditionalGeneration
    tower_plan = TOWER_PLAN
    tower_mlp = TOWER_MLP
    per_head_norms = PER_HEAD_NORMS
    tiny_config = staticmethod(tiny_qwen3_vl_config)
    cp_parts = ("text",)  # DeepStack's mask and rows sliced with the sequence

    @property
    def deepstack_levels(self) -> int:
        return len(self.config.vision_config.deepstack_visual_indexes)

    def crossings(self, part):
        width = self.config.text_config.hidden_size
        out = []
        for m in MODALITIES:
            out.append(Crossing(f"{m}_embeds", width))
            out += [Crossing(f"{m}_deepstack_{i}", width) for i in range(self.deepstack_levels)]
        return tuple(out)

    def placeholder_runs(self, modality, grid):
        return int(grid[:, 0].sum()) if modality == "video" else len(grid)

    def placeholder_tokens(self, modality, grid):
        if modality != "video":
            return super().placeholder_tokens(modality, grid)
        t, h, w = (int(x) for x in grid)  # each frame is its own group for get_rope_index
        frame = super().placeholder_tokens(modality, (1, h, w))
        return frame * t

    def prepare_context(self, decoder):
        """DeepStack's mask and rows are sliced with the sequence
        (:func:`~ray_disagg.models.qwen3_vl.context.slice_deepstack`)."""
        decoder.register_forward_pre_hook(slice_deepstack, with_kwargs=True)

    def encoder_output(self, received, modality):
        emb = received.get(f"{modality}_embeds")
        if emb is None:
            return None
        deep = [(received[f"{modality}_deepstack_{i}"],) for i in range(self.deepstack_levels)]
        return BaseModelOutputWithDeepstackFeatures(pooler_output=(emb,), deepstack_features=deep)
