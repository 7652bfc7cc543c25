"""Qwen2.5-VL split into the parts that the vision and text groups train.

The parts wrap the real ``transformers`` submodules; their state-dict keys map 1:1 onto
``Qwen2_5_VLForConditionalGeneration`` keys (``model.visual.*``, ``model.language_model.*``,
``lm_head.*``), so checkpoints merge back into a Hugging Face model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

__all__ = ["Qwen2_5_VLSpec", "VisionPart", "TextPart", "tiny_qwen2_5_vl_config", "IGNORE_INDEX"]

IGNORE_INDEX = -100


def tiny_qwen2_5_vl_config(
    *,
    vocab_size: int = 128,
    text_hidden: int = 64,
    text_layers: int = 2,
    text_heads: int = 4,
    text_kv_heads: int = 2,
    vision_hidden: int = 32,
    vision_depth: int = 2,
    vision_heads: int = 4,
    patch_size: int = 4,
    window_size: int = 16,
    fullatt_block_indexes: tuple[int, ...] = (1,),
    **overrides: Any,
) -> Qwen2_5_VLConfig:
    """A randomly initialisable Qwen2.5-VL config small enough for CPU tests (no download).

    Token ids 100-103 are the image / video / vision-start / vision-end tokens.

    Example:
        >>> cfg = tiny_qwen2_5_vl_config()
        >>> cfg.vision_config.hidden_size, cfg.text_config.hidden_size
        (32, 64)
    """
    head_dim = text_hidden // text_heads
    if head_dim % 2:
        raise ValueError("text_hidden / text_heads must be even for rotary embeddings.")
    half = head_dim // 2
    mrope = [half - 2 * (half // 3), half // 3, half // 3]
    return Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=vocab_size,
            hidden_size=text_hidden,
            intermediate_size=2 * text_hidden,
            num_hidden_layers=text_layers,
            num_attention_heads=text_heads,
            num_key_value_heads=text_kv_heads,
            max_position_embeddings=1024,
            rope_parameters={"rope_type": "default", "mrope_section": mrope, "rope_theta": 1e4},
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=0,
        ),
        vision_config=dict(
            depth=vision_depth,
            hidden_size=vision_hidden,
            intermediate_size=2 * vision_hidden,
            num_heads=vision_heads,
            out_hidden_size=text_hidden,
            patch_size=patch_size,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=window_size,
            fullatt_block_indexes=list(fullatt_block_indexes),
            in_channels=3,
        ),
        image_token_id=100,
        video_token_id=101,
        vision_start_token_id=102,
        vision_end_token_id=103,
        **overrides,
    )


class VisionPart(nn.Module):
    """Vision tower + merger. ``forward(pixel_values, grid_thw)`` returns the merged image
    embeddings ``(num_image_tokens, text_hidden)`` in the order the LLM consumes them."""

    hf_prefix = "model."

    def __init__(self, visual: nn.Module):
        super().__init__()
        self.visual = visual

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        dtype = self.visual.patch_embed.proj.weight.dtype
        return self.visual(pixel_values.to(dtype), grid_thw=grid_thw).pooler_output


class _RopeIndex:
    """Borrows HF's multimodal rotary position computation without holding the vision tower."""

    get_rope_index = Qwen2_5_VLModel.get_rope_index
    get_vision_position_ids = Qwen2_5_VLModel.get_vision_position_ids

    def __init__(self, config: Qwen2_5_VLConfig):
        self.config = config


class TextPart(nn.Module):
    """Token embeddings, decoder, final norm and lm_head of the LLM, plus the loss.

    ``forward`` replaces image placeholder tokens by the received image embeddings (the
    same masked scatter as the HF model) and returns ``sum(token CE) / num_label_tokens``,
    so that summing over data-parallel ranks gives the mean over the global batch.
    """

    hf_prefix = {"language_model": "model.language_model", "lm_head": "lm_head"}

    def __init__(self, language_model: nn.Module, lm_head: nn.Module, config: Qwen2_5_VLConfig):
        super().__init__()
        self.language_model = language_model
        self.lm_head = lm_head
        self.image_token_id = config.image_token_id
        self._rope = _RopeIndex(config)
        self.tp_group = None  # set by tensor parallelism: the lm_head is vocab-sharded
        self.vocab_start = 0

    def embed_and_merge(
        self, input_ids: torch.Tensor, image_embeds: torch.Tensor | None
    ) -> torch.Tensor:
        embeds = self.language_model.embed_tokens(input_ids)
        if image_embeds is not None and image_embeds.shape[0] > 0:
            mask = (input_ids == self.image_token_id).unsqueeze(-1)
            embeds = embeds.masked_scatter(mask, image_embeds.to(embeds.dtype))
        return embeds

    def position_ids(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        image_grid_thw: torch.Tensor | None,
    ) -> torch.Tensor:
        mm_token_type_ids = (input_ids == self.image_token_id).int()
        pos, _ = self._rope.get_rope_index(
            input_ids,
            mm_token_type_ids=mm_token_type_ids,
            image_grid_thw=image_grid_thw,
            attention_mask=attention_mask,
        )
        return pos

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        image_embeds: torch.Tensor | None,
        image_grid_thw: torch.Tensor | None,
    ) -> torch.Tensor:
        embeds = self.embed_and_merge(input_ids, image_embeds)
        pos = self.position_ids(input_ids, attention_mask, image_grid_thw)
        out = self.language_model(
            inputs_embeds=embeds, attention_mask=attention_mask, position_ids=pos
        )
        return out.last_hidden_state

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        labels: torch.Tensor,
        image_embeds: torch.Tensor | None,
        image_grid_thw: torch.Tensor | None,
        num_label_tokens: int | torch.Tensor,
    ) -> torch.Tensor:
        hidden = self.hidden_states(input_ids, attention_mask, image_embeds, image_grid_thw)
        logits = self.lm_head(hidden[:, :-1]).float().flatten(0, 1)
        targets = labels[:, 1:].flatten()
        if self.tp_group is not None:  # logits hold this rank's vocab slice only
            from ray_disagg._internal.tensor_parallel import VocabParallelCrossEntropy

            per_token = VocabParallelCrossEntropy.apply(
                logits, targets, self.vocab_start, IGNORE_INDEX, self.tp_group
            )
            loss_sum = per_token.sum()
        else:
            loss_sum = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")
        return loss_sum / num_label_tokens


@dataclass(kw_only=True)
class Qwen2_5_VLSpec:
    """How to build the Qwen2.5-VL model on each worker.

    Give either a ``config`` (random init from ``seed``, no download) or a local
    ``pretrained_path`` (a ``save_pretrained`` directory).

    Example:
        >>> spec = Qwen2_5_VLSpec(config=tiny_qwen2_5_vl_config(), seed=0)
        >>> vision = spec.build_vision()
        >>> sorted(vision.state_dict())[0]
        'visual.blocks.0.attn.proj.bias'
    """

    config: Qwen2_5_VLConfig | dict | None = None
    """Model config (a ``Qwen2_5_VLConfig`` or its dict) for random initialisation."""

    pretrained_path: str | os.PathLike | None = None
    """Local directory with ``config.json`` + safetensors weights (``save_pretrained`` layout)."""

    seed: int = 0
    """Seed of the random initialisation (every group builds the same weights)."""

    attn_implementation: str = "sdpa"
    """Attention kernel passed to ``transformers`` (``"sdpa"`` or ``"eager"``)."""

    def __post_init__(self) -> None:
        if (self.config is None) == (self.pretrained_path is None):
            raise ValueError("Qwen2_5_VLSpec needs exactly one of config= or pretrained_path=.")
        if isinstance(self.config, dict):
            self.config = Qwen2_5_VLConfig(**self.config)
        if self.config is not None and not isinstance(self.config, Qwen2_5_VLConfig):
            raise ValueError(
                f"Qwen2_5_VLSpec.config must be a Qwen2_5_VLConfig, got {type(self.config)}."
            )
        if self.pretrained_path is not None:
            path = os.fspath(self.pretrained_path)
            if not os.path.isfile(os.path.join(path, "config.json")):
                raise ValueError(
                    f"pretrained_path={path!r} has no config.json; pass a local directory "
                    "written by save_pretrained (downloads are not supported)."
                )
            self.pretrained_path = path

    def load_config(self) -> Qwen2_5_VLConfig:
        if self.config is not None:
            return self.config
        return Qwen2_5_VLConfig.from_pretrained(self.pretrained_path)

    def build_full(self) -> Qwen2_5_VLForConditionalGeneration:
        """The whole HF model (the single-process reference, and the source of the parts)."""
        if self.pretrained_path is not None:
            model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
                self.pretrained_path,
                dtype=torch.float32,
                attn_implementation=self.attn_implementation,
                local_files_only=True,
            )
        else:
            config = Qwen2_5_VLConfig.from_dict(self.config.to_dict())
            config._attn_implementation = self.attn_implementation
            torch.manual_seed(self.seed)
            model = Qwen2_5_VLForConditionalGeneration(config)
        return model.float().train()

    def build_vision(self) -> VisionPart:
        return VisionPart(self.build_full().model.visual)

    def build_text(self) -> TextPart:
        full = self.build_full()
        return TextPart(full.model.language_model, full.lm_head, full.config)


def hf_key(part: nn.Module, name: str) -> str:
    """``Qwen2_5_VLForConditionalGeneration`` name of the part's parameter ``name``."""
    if isinstance(part, VisionPart):
        return VisionPart.hf_prefix + name
    head, _, rest = name.partition(".")
    return f"{TextPart.hf_prefix[head]}.{rest}"


def hf_state_dict(part: nn.Module) -> dict[str, torch.Tensor]:
    """The part's parameters under ``Qwen2_5_VLForConditionalGeneration`` key names."""
    return {hf_key(part, k): v for k, v in part.state_dict().items()}
