"""Tiny Qwen2.5-Omni thinker configs for CPU tests."""

from __future__ import annotations

from typing import Any

from transformers import Qwen2_5OmniThinkerConfig

from ray_disagg.models.qwen_common.flavors import tiny_text_config, tiny_window_tower

__all__ = ["tiny_qwen2_5_omni_thinker_config"]


TOKEN_IDS = dict(
    image_token_index=100,
    video_token_index=101,
    vision_start_token_id=102,
    vision_end_token_id=103,
    audio_token_index=104,
    audio_start_token_id=105,
    audio_end_token_id=106,
)
"""The tiny thinker's special token ids."""


def tiny_qwen2_5_omni_thinker_config(
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
    audio_hidden: int = 32,
    audio_layers: int = 2,
    audio_heads: int = 4,
    num_mel_bins: int = 8,
    n_window: int = 4,
    **overrides: Any,
) -> Qwen2_5OmniThinkerConfig:
    """A tiny Qwen2.5-Omni thinker config for CPU tests (no download).

    Token ids: 100 image, 101 video, 102 / 103 vision start / end, 104 audio, 105 / 106
    audio start / end. ``vision_start_token_id`` is not a declared thinker field but HF's
    ``get_rope_index`` reads it, so it is set as an extra attribute. The audio tower
    attends in chunks of ``2 * n_window`` mel frames.

    Example:
        >>> cfg = tiny_qwen2_5_omni_thinker_config()
        >>> cfg.audio_token_id, cfg.vision_start_token_id, cfg.audio_config.num_mel_bins
        (104, 102, 8)
    """
    kwargs: dict[str, Any] = {**TOKEN_IDS, **overrides}
    return Qwen2_5OmniThinkerConfig(
        text_config=tiny_text_config(
            vocab_size=vocab_size,
            hidden=text_hidden,
            layers=text_layers,
            heads=text_heads,
            kv_heads=text_kv_heads,
        ),
        vision_config=tiny_window_tower(
            hidden=vision_hidden,
            depth=vision_depth,
            heads=vision_heads,
            out_hidden=text_hidden,
            patch_size=patch_size,
            window_size=window_size,
            fullatt=fullatt_block_indexes,
        ),
        audio_config=_audio(
            audio_hidden, audio_layers, audio_heads, num_mel_bins, n_window, text_hidden
        ),  # fmt: skip
        **kwargs,
    )


def _audio(hidden: int, layers: int, heads: int, mel_bins: int, n_window: int, out: int):
    return dict(
        num_mel_bins=mel_bins,
        encoder_layers=layers,
        encoder_attention_heads=heads,
        encoder_ffn_dim=2 * hidden,
        d_model=hidden,
        n_window=n_window,
        output_dim=out,
        max_source_positions=max(64, n_window),
    )
