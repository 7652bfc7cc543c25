"""FLOPs of the plain ViT towers on fixed-size tiles (SigLIP: Gemma 3, LLaVA-OneVision;
InternViT: InternVL), counted by the conventions of :mod:`ray_disagg.models.flops`: a
convolutional patch embedding (data input), position embeddings added (gathers: none),
and per block the ``q``, ``k``, ``v`` and output projections, attention over each tile's
tokens and a two-matrix MLP. A block whose output does not reach the loss (after the
feature layer a family reads, or SigLIP's pooling head, whose output no family uses) runs
forward only (:func:`forward_only`).

Example:
    >>> from transformers import SiglipVisionConfig
    >>> v = SiglipVisionConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=2,
    ...     num_attention_heads=2, image_size=8, patch_size=4, vision_use_head=False)
    >>> one = vit_tower_flops(v, tiles=1)
    >>> vit_tower_flops(v, tiles=3).training == 3 * one.training
    True
"""

from __future__ import annotations

from ray_disagg.models.flops import Flops, attention, linear

__all__ = [
    "blocks_reaching_loss",
    "forward_only",
    "pair",
    "tile_patches",
    "vit_block_flops",
    "vit_tower_flops",
]


def pair(size) -> tuple[int, int]:
    """``(h, w)`` of a config's ``image_size`` / ``patch_size`` (an int or a pair)."""
    return (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))


def forward_only(flops: float) -> Flops:
    """``flops`` of forward whose output reaches no loss, so autograd runs no backward for
    them: ``training`` adds ``flops`` once."""
    return Flops(forward=flops, no_backward=flops)


def tile_patches(v) -> int:
    """Patches of one ``image_size`` tile of vision config ``v``."""
    (h, w), (ph, pw) = pair(v.image_size), pair(v.patch_size)
    return (h // ph) * (w // pw)


def blocks_reaching_loss(v, feature_layer=-1) -> int:
    """How many of ``v``'s blocks feed HF's ``hidden_states[feature_layer]`` (index 0 is
    the embeddings' output, ``i`` block ``i``'s; a list: the deepest), the rest of the
    blocks running forward only (HF runs every block; none is pruned)."""
    n = v.num_hidden_layers
    layers = [feature_layer] if isinstance(feature_layer, int) else list(feature_layer)
    return max(i % (n + 1) for i in layers)


def vit_block_flops(v, tiles: int, tokens: int) -> float:
    """One block over ``tiles`` tiles of ``tokens`` tokens each: the ``q``, ``k``, ``v``
    and output projections (``h -> h`` each), the MLP's ``fc1`` (``h -> i``) and ``fc2``
    (``i -> h``) per token, and attention's two products over each tile (width ``h``:
    heads x head dim)."""
    h, i = v.hidden_size, v.intermediate_size
    rows = tiles * tokens
    projections = linear(rows, h, 4 * h) + linear(rows, h, i) + linear(rows, i, h)
    return projections + attention([tokens] * tiles, h)


def _siglip_head_flops(v, tiles: int, patches: int) -> float:
    """SigLIP's attention-pooling head (``vision_use_head``) per tile: the probe's query
    (one row, ``h -> h``), keys and values of the patches (``h -> 2h``), attention of one
    query over the patches (``4 n h``), the output projection and the MLP on one row."""
    h, i = v.hidden_size, v.intermediate_size
    per_tile = linear(1, h, h) + linear(patches, h, 2 * h) + 4.0 * patches * h
    per_tile += linear(1, h, h) + linear(1, h, i) + linear(1, i, h)
    return tiles * per_tile


def vit_tower_flops(v, tiles: int, cls_tokens: int = 0, feature_layer=-1) -> Flops:
    """The tower of vision config ``v`` over ``tiles`` tiles: the patch embedding (a
    ``C p^2 -> h`` product per patch, data input), ``num_hidden_layers`` blocks
    (:func:`vit_block_flops`) over each tile's patches and ``cls_tokens`` (InternViT's
    CLS), the blocks after ``feature_layer`` (:func:`blocks_reaching_loss`) and SigLIP's
    pooling head (``vision_use_head``) forward only."""
    patches = tile_patches(v)
    ph, pw = pair(v.patch_size)
    embed = linear(tiles * patches, v.num_channels * ph * pw, v.hidden_size)
    block = vit_block_flops(v, tiles, patches + cls_tokens)
    used = blocks_reaching_loss(v, feature_layer)
    unused = (v.num_hidden_layers - used) * block
    if getattr(v, "vision_use_head", False):
        unused += _siglip_head_flops(v, tiles, patches)
    return Flops(forward=embed + used * block, data_input=embed) + forward_only(unused)
