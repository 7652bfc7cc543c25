"""Building blocks of the tiny Qwen configs (CPU-sized, random init, no download)."""

from __future__ import annotations

__all__ = ["mrope_section", "tiny_text_config", "tiny_window_tower"]


def mrope_section(head_dim: int) -> list[int]:
    """An ``mrope_section`` (t, h, w) summing to ``head_dim / 2``."""
    half = head_dim // 2
    return [half - 2 * (half // 3), half // 3, half // 3]


def tiny_text_config(
    *, vocab_size: int, hidden: int, layers: int, heads: int, kv_heads: int, rope=None, **extra
) -> dict:
    """The ``text_config`` dict of the tiny Qwen configs (mrope over ``hidden / heads``)."""
    head_dim = hidden // heads
    if head_dim % 2:
        raise ValueError("text_hidden / text_heads must be even for rotary embeddings.")
    rope_parameters = {
        "rope_type": "default",
        "mrope_section": mrope_section(head_dim),
        "rope_theta": 1e4,
        **(rope or {}),
    }
    return dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=1024,
        rope_parameters=rope_parameters,
        pad_token_id=0,
        **extra,
    )


def tiny_window_tower(*, hidden, depth, heads, out_hidden, patch_size, window_size, fullatt):
    """The ``vision_config`` dict of a tiny windowed tower (Qwen2.5-VL, Omni)."""
    return dict(
        depth=depth,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_heads=heads,
        out_hidden_size=out_hidden,
        patch_size=patch_size,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=window_size,
        fullatt_block_indexes=list(fullatt),
        in_channels=3,
    )
