"""Building blocks of the tiny Qwen configs (CPU-sized, random init, no download)."""

from __future__ import annotations

from ray_disagg.models.flavors import TINY_VISION_IDS, tiny_decoder

__all__ = [
    "TINY_VISION_IDS",
    "mrope_section",
    "tiny_text_config",
    "tiny_tower",
    "tiny_window_tower",
]


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
    return tiny_decoder(
        vocab_size=vocab_size,
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        rope_parameters=rope_parameters,
        **extra,
    )


def tiny_tower(*, hidden: int, depth: int, heads: int, out_hidden: int, patch_size: int, **extra):
    """The ``vision_config`` dict of a tiny Qwen tower after Qwen2-VL's (merge 2x2, two
    frames a temporal patch); ``extra``: the family's own fields."""
    block = dict(
        depth=depth,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_heads=heads,
        out_hidden_size=out_hidden,
        patch_size=patch_size,
        spatial_merge_size=2,
        temporal_patch_size=2,
        in_channels=3,
    )
    return {**block, **extra}


def tiny_window_tower(*, hidden, depth, heads, out_hidden, patch_size, window_size, fullatt):
    """The ``vision_config`` dict of a tiny windowed tower (Qwen2.5-VL, Omni)."""
    return tiny_tower(
        hidden=hidden,
        depth=depth,
        heads=heads,
        out_hidden=out_hidden,
        patch_size=patch_size,
        window_size=window_size,
        fullatt_block_indexes=list(fullatt),
    )
