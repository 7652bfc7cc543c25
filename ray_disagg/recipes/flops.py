"""Training FLOPs of a layout's parts for the planner's cost model
(:mod:`ray_disagg.recipes.cost`, whose docstring gives the formulas)."""

from __future__ import annotations

from ray_disagg.recipes.memory_model import _depth

__all__: list[str] = []


def _passes(r, part: str, facts) -> int:
    """Forward-sized passes of a part per microbatch: 1 forward, 2 backward, 1 more
    forward under activation checkpointing; 1 when frozen."""
    if not facts.parts[part].trainable:
        return 1
    return 4 if r.groups[part].activation_checkpointing else 3


def _flops(r, facts, work) -> dict[str, float]:
    """Training FLOPs of one global batch per part."""
    b, out = r.loop.global_batch_size, {}
    for part, pf in facts.parts.items():
        passes = _passes(r, part, facts)
        if part == facts.llm_part:
            t = facts.text
            d = t.num_attention_heads * (
                getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
            )
            attn = 2 * d * work.tokens**2 * t.num_hidden_layers  # causal: half of 4 d s^2
            fwd = 2 * pf.params * work.tokens + attn
        elif part == "vision" and facts.vision is not None:
            fwd = 2 * pf.params * work.patches + _tower_attention(facts.vision, work)
        else:
            fwd = 2 * pf.params * work.tokens * 0.1  # other encoders: a small share
        out[part] = passes * fwd * b
    return out


def _tower_attention(v, work) -> float:
    h = getattr(v, "embed_dim", None) or v.hidden_size
    if not work.images:
        return 0.0
    p = work.patches / work.images
    full = getattr(v, "fullatt_block_indexes", None)
    window = getattr(v, "window_size", None)
    if full is not None and window:
        w = (window // v.patch_size) ** 2
        per = len(full) * 4 * h * p * p + (_depth(v) - len(full)) * 4 * h * p * min(w, p)
    else:
        per = _depth(v) * 4 * h * p * p
    return per * work.images
