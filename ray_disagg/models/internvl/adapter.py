"""InternVL (2.5 / 3 / 3.5 in transformers' ``internvl``): an InternViT tower on fixed-size
tiles (an image is split into up to ``max_patches`` tiles plus a thumbnail; all of an
image's tiles share one placeholder run), the CLS row dropped and a pixel shuffle that
folds 2x2 patches into one row before the MLP projector (both in HF's own
``get_image_features``, run by the vision part), and a Qwen2/Qwen3 decoder with 1-D rope.
Embeddings and ``lm_head`` are tied by default.

The model has no video input: as ``InternVLProcessor`` does, each video frame is one tile
of ``pixel_values`` (images' tiles and videos' frames in media order) with its own
``Frame{i}: <img>...</img>`` placeholder run, so frames cross as ``image_embeds`` and
split across SP ranks like any tile."""

from __future__ import annotations

from transformers import InternVLConfig, InternVLForConditionalGeneration

from ray_disagg.models.flops import Flops, linear
from ray_disagg.models.internvl.flavors import tiny_internvl_config
from ray_disagg.models.internvl.processing import InternVLProcessing
from ray_disagg.models.llava_common import LlavaAdapter

__all__ = ["InternVLAdapter"]


class InternVLAdapter(InternVLProcessing, LlavaAdapter):
    model_type = "internvl"
    config_class = InternVLConfig
    hf_class = InternVLForConditionalGeneration
    tiles_per_image_run = True
    media = ("images", "videos")  # a video's frames are tiles (one run each)
    video_field_refusal = (
        "has no separate video input: put each frame in pixel_values as one tile (images' "
        "tiles and videos' frames in media order) with its own placeholder run, as "
        "InternVLProcessor does"
    )
    per_head_norms = ("q_norm", "k_norm")  # InternVL3.5's Qwen3 decoders (none in Qwen2)
    tiny_config = staticmethod(tiny_internvl_config)
    cp_parts = ("text",)  # 1-D rope: the slice of each row, packed or padded
    tower_cls_tokens = 1  # InternViT's CLS, dropped before the pixel shuffle

    def projector_flops(self, tiles):
        """The pixel shuffle (no FLOPs) folds ``k = (1 / downsample_ratio)^2`` patches
        into one row of ``k`` x the tower's width; the projector's ``linear_1`` (that
        width -> LLM width) and ``linear_2`` (LLM width -> LLM width) on each row."""
        c = self.config
        k = int(1 / c.downsample_ratio) ** 2
        rows, t = tiles * self._tile_patches() // k, c.text_config.hidden_size
        flops = linear(rows, k * c.vision_config.hidden_size, t) + linear(rows, t, t)
        return Flops(forward=flops)

    @property
    def tokens_per_tile(self):
        return self.config.image_seq_length

    def image_features(self, inner, pixels):
        c = self.config
        return inner.get_image_features(
            pixel_values=pixels,
            vision_feature_layer=c.vision_feature_layer,
            vision_feature_select_strategy=c.vision_feature_select_strategy,
            return_dict=True,
        ).pooler_output
