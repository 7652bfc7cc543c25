"""What a model's parts cost, for the planner (``ray_disagg.planner``): every adapter
answers through these hooks (:class:`CostHooks`, a base of ``ModelAdapter``), the way
torchtitan's model specs answer ``get_nparams_and_flops``. The defaults cover a decoder
LLM and a tower of full-attention blocks; a family overrides what differs (the Qwen
towers: the patch merger's activations, Qwen2.5's windowed attention), so a new family
needs no planner edit.

Units: FLOPs of one forward over one sample; activation bytes of one microbatch on one
rank (``a`` bytes per element), assuming a memory-efficient attention kernel (no
``seq^2`` term). The formulas are written out in ``ray_disagg.planner.memory``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ray_disagg.models.flops import Flops, decoder_flops, head_dim

__all__ = [
    "ActivationShape",
    "CostHooks",
    "decoder_forward_flops",
    "depth",
    "merger_tower_activation_bytes",
    "tower_attention_flops",
]


@dataclass(frozen=True)
class ActivationShape:
    """One microbatch of a part on one rank, as the activation formulas need it."""

    items: float
    """LLM: tokens (whole rows when packed); tower: patches on this rank (``/ sp``)."""
    a: int
    """Bytes per activation element (2 under bf16, else 4)."""
    tp: int = 1
    cp: int = 1
    checkpointed: bool = False
    loss_chunk: float = math.inf
    """LLM: label positions whose logits exist at once."""
    gated: bool = False
    """Tower: a gated MLP (gate, up, act, product)."""


def depth(v) -> int:
    """Blocks of a tower (Qwen's ``depth``, SigLIP's / InternViT's ``num_hidden_layers``)."""
    return getattr(v, "depth", None) or getattr(v, "num_hidden_layers", 1)


def decoder_forward_flops(t, params: float, tokens: float) -> float:
    """A decoder over ``tokens``: ``2 x params`` per token plus causal attention (half of
    ``4 d s^2`` per layer)."""
    d = t.num_attention_heads * head_dim(t)
    return 2 * params * tokens + 2 * d * tokens**2 * t.num_hidden_layers


def tower_attention_flops(v, patches: float, images: float, windowed: bool = False) -> float:
    """Attention of a tower over ``images`` images of ``patches`` patches in all: every
    block over each image's patches, or (``windowed``: Qwen2.5's) only the full-attention
    blocks, the others within windows."""
    h = getattr(v, "embed_dim", None) or v.hidden_size
    if not images:
        return 0.0
    p = patches / images
    if windowed:
        full, w = v.fullatt_block_indexes, (v.window_size // v.patch_size) ** 2
        per = len(full) * 4 * h * p * p + (depth(v) - len(full)) * 4 * h * p * min(w, p)
    else:
        per = depth(v) * 4 * h * p * p
    return per * images


def _mlp_width(t, tp: int) -> float:
    """Per token and layer, the MLP's activation width: ``4 i / tp`` for a dense one (gate,
    up, act, product, TP-sharded); for an MoE block the ``top_k`` chosen experts' (whole
    on every tp rank) plus a shared expert, and the dispatched rows (sent, received,
    returned: ``3 k h``)."""
    k = getattr(t, "num_experts_per_tok", None)
    if not getattr(t, "num_experts", None) or not k:
        return 4 * t.intermediate_size / tp
    shared = getattr(t, "shared_expert_intermediate_size", 0) or 0
    return 4 * (k * t.moe_intermediate_size + shared) + 3 * k * t.hidden_size


def decoder_activation_bytes(t, s: ActivationShape) -> float:
    """Per layer ``4h + (2 q + 2 kv) / tp`` plus the MLP's width, on ``1 / cp`` of the
    tokens (checkpointed: ``layers x h`` plus one layer); the final norm; the logits of
    one loss chunk, their fp32 copy and the saved log-softmax (``a + 8`` bytes)."""
    h, layers = t.hidden_size, t.num_hidden_layers
    d = head_dim(t)
    q, kv = t.num_attention_heads * d, t.num_key_value_heads * d
    layer = 4 * h + (2 * q + 2 * kv) / s.tp + _mlp_width(t, s.tp)
    kept = layers * h + layer if s.checkpointed else layers * layer
    tokens = s.items
    logit_rows = min(tokens / s.cp, s.loss_chunk)
    return (
        tokens / s.cp * kept * s.a
        + tokens * 2 * h * s.a
        + logit_rows * t.vocab_size / s.tp * (s.a + 8)
    )


def merger_tower_activation_bytes(v, s: ActivationShape) -> float:
    """A Qwen tower (temporal patches, a patch merger): per block ``4h + (9h + m i) / tp``
    (``m`` = 4 gated, else 2), x depth (checkpointed: ``depth x h`` + one block), plus the
    patch input (``3 t p^2``) and the merger (``5h + out / merge^2``)."""
    h = getattr(v, "embed_dim", None) or v.hidden_size
    i = getattr(v, "intermediate_size", None) or int(h * v.mlp_ratio)
    out = getattr(v, "out_hidden_size", None) or v.hidden_size
    block = 4 * h + (9 * h + (4 if s.gated else 2) * i) / s.tp
    kept = v.depth * h + block if s.checkpointed else v.depth * block
    outside = 3 * v.temporal_patch_size * v.patch_size**2 + 5 * h + out / v.spatial_merge_size**2
    return s.items * (kept + outside) * s.a


class CostHooks:
    """The planner's questions to a model adapter (see the module docstring); needs the
    adapter's ``config`` and ``llm_part``."""

    def forward_flops(self, part: str, params: float, tokens: float, patches: float,
                      images: float) -> float:  # fmt: skip
        """FLOPs of one forward of ``part`` (``params`` parameters) over one sample of
        ``tokens`` LLM tokens and ``images`` images of ``patches`` patches in all."""
        if part == self.llm_part:
            return decoder_forward_flops(_text(self.config), params, tokens)
        v = self.tower_config(part)
        if v is None:  # another encoder (audio): a small share
            return 2 * params * tokens * 0.1
        return 2 * params * patches + tower_attention_flops(v, patches, images)

    def sample_flops(self, part: str, sample: dict) -> Flops:
        """Model FLOPs of one forward of ``part`` over ``sample`` (a processed sample; see
        :mod:`ray_disagg.models.flops` for what counts): the LLM's decoder by default
        (:meth:`decoder_flops`); an encoder's from its family's :meth:`tower_flops`."""
        if part == self.llm_part:
            return self.decoder_flops(len(sample["input_ids"]), self.label_positions(sample))
        return self.tower_flops(part, sample)

    def decoder_flops(self, tokens: int, labels: int) -> Flops:
        """The LLM over one sample of ``tokens`` tokens with ``labels`` label positions."""
        return decoder_flops(_text(self.config), tokens, labels)

    def tower_flops(self, part: str, sample: dict) -> Flops:
        """Encoder ``part`` over ``sample``'s media (every family with encoders says)."""
        raise NotImplementedError(f"{type(self).__name__} counts no FLOPs of part {part!r}")

    def activation_bytes(self, part: str, shape: ActivationShape) -> float | None:
        """Bytes of activations ``part`` keeps for backward over one microbatch on one
        rank (``None``: not estimated; the default estimates the LLM only)."""
        if part == self.llm_part:
            return decoder_activation_bytes(_text(self.config), shape)
        return None

    def tower_config(self, part: str):
        """The vision tower's config of ``part`` (``None`` for other parts)."""
        return getattr(self.config, "vision_config", None) if part == "vision" else None

    def image_patches(self, image_size) -> tuple[int, tuple[int, int]]:
        """``(patches, (h, w))`` of one image of ``image_size = [H, W]`` px: each side
        rounded to a multiple of ``patch x merge``, as the Qwen processors do (the default
        for every tower)."""
        v = self.config.vision_config
        p, m = v.patch_size, getattr(v, "spatial_merge_size", 1)
        p = p[0] if isinstance(p, list | tuple) else p  # InternViT: (14, 14)
        f = p * m
        h, w = (max(f, round(s / f) * f) // p for s in image_size)
        return h * w, (h, w)

    def image_tokens(self, image_size) -> int:
        """LLM tokens of one image of ``image_size`` (its patches over ``merge^2``)."""
        merge = getattr(self.config.vision_config, "spatial_merge_size", 1) ** 2
        return self.image_patches(image_size)[0] // merge


def _text(config):
    return getattr(config, "text_config", config)
