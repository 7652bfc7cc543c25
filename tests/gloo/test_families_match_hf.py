"""Tier 2, per model family: the groups' workers (without Ray, ``testing.local``) equal the family's
own single-process ``...ForConditionalGeneration(..., labels=...)`` with AdamW (losses of 3
steps and parameters afterwards, fp32, 1e-5 relative), on samples mixing several images
of different aspect ratios, videos, text-only samples (and audio for Qwen2.5-Omni), for an
SP layout of the tower (Ulysses for the Qwen towers, whole tiles per rank for the tile
towers), a TP layout of the LLM and an M:N layout."""

import os

import pytest
import torch

from ray_disagg import (
    ADAPTERS,
    DataParallel,
    ExpertParallel,
    HFModelSpec,
    SequenceParallel,
    TensorParallel,
    export_hf,
)
from ray_disagg.data.examples import synthetic_samples
from tests.helpers import assert_matches_reference, checkpoint_state, group, run_layout

LOOP = {"max_steps": 3, "global_batch_size": 4, "lr": 1e-3, "eps": 1e-6, "seed": 3}
VISION = [
    {"images": [(1, 4, 4), (1, 8, 4)]},
    None,
    {"videos": [(2, 4, 8)], "images": [(1, 4, 8)]},
    (1, 8, 8),
    {"videos": [(2, 8, 4)]},
    {"images": [(1, 4, 12), (1, 8, 8), (1, 4, 4)]},
]
# InternVL and LLaVA-OneVision: videos of 3 frames (InternVL: a tile and a run each;
# LLaVA-OneVision: pooled, one newline row each; HF's reference takes a batch's videos as
# one tensor, so one frame count), beside images, alone and two in a sample
TILE_VIDEOS = [
    *VISION[:2],
    {"videos": [(3, 4, 8)], "images": [(1, 4, 8)]},
    VISION[3],
    {"videos": [(3, 8, 4), (3, 4, 4)]},
    VISION[5],
]
AUDIO = [
    {"images": [(1, 4, 8)], "audios": [40]},
    {"audios": [24, 17]},
    None,
    {"videos": [(2, 4, 4)], "audios": [30]},
    {"images": [(1, 8, 4), (1, 4, 4)]},
    {"audios": [33]},
]


def sp_tp(parts, ac: bool = False):
    def one(p):
        if p == "vision":
            return group(2, SequenceParallel(size=2), ac=ac)
        if p == "text":
            return group(2, TensorParallel(size=2), ac=ac)
        return group(1)

    return {p: one(p) for p in parts}


def sp_tp_ac(parts):  # activation checkpointing must not change the numbers
    return sp_tp(parts, ac=True)


def sp_fsdp(parts):  # vision SP2 + text FSDP2(2)
    def one(p):
        if p == "vision":
            return group(2, SequenceParallel(size=2))
        return group(2, DataParallel(fsdp=True))

    return {p: one(p) for p in parts}


def ep2(parts, fsdp: bool = False):  # vision SP2 + text expert parallel 2
    def one(p):
        if p == "vision":
            return group(2, SequenceParallel(size=2))
        return group(2, ExpertParallel(size=2, fsdp=fsdp))

    return {p: one(p) for p in parts}


def ep2_fsdp(parts):  # experts over ep, dense weights FSDP2 over dp
    return ep2(parts, fsdp=True)


def ep2_tp2(parts):  # vision 1 + text: 2 replicas split the experts, attention TP2
    return {
        p: group(1) if p == "vision" else group(4, ExpertParallel(size=2, tp=2), 0.25)
        for p in parts
    }


def fsdp_tp_ac(parts):  # vision 1 + text FSDP2(2) x TP2, activation checkpointing
    return {
        p: group(1) if p == "vision" else group(4, TensorParallel(size=2, fsdp=True), 0.25, True)
        for p in parts
    }


def dp_tp(parts):  # vision 2 + text TP2
    return {p: group(2) if p == "vision" else group(2, TensorParallel(size=2)) for p in parts}


def dp_fsdp(parts):  # vision 2 + text FSDP2(2)
    return {p: group(2) if p == "vision" else group(2, DataParallel(fsdp=True)) for p in parts}


def tile_sp_fsdp(parts):  # tile towers: vision SP2 x FSDP2, one sample per microbatch
    return {
        p: group(2, SequenceParallel(size=2, fsdp=True)) if p == "vision" else group(1)
        for p in parts
    }


# a text-only sample's microbatch runs FSDP2's stand-in sample: Gemma 3's one image (one
# tile) on SP rank 0, a stand-in tile cut to 0 rows on rank 1
tile_sp_fsdp.loop = {"micro_batches": 4}


def m_to_n(parts):
    return {p: group(2) if p == "vision" else group(1) for p in parts}


CASES = [
    ("qwen2_vl", sp_tp),
    ("qwen2_vl", m_to_n),
    ("qwen3_vl", sp_tp_ac),  # DeepStack through SP, TP and recomputation
    ("qwen3_vl", m_to_n),
    ("qwen2_5_vl", sp_tp),  # videos (second_per_grid_ts) through window-order SP
    ("qwen2_5_omni_thinker", sp_tp),  # three groups: vision SP2, audio 1, text TP2
    ("qwen2_5_omni_thinker", m_to_n),
    # 2026: MoE with the router's auxiliary loss over the global batch; linear attention
    ("qwen3_vl_moe", sp_tp),  # experts whole on every tp rank
    ("qwen3_vl_moe", sp_fsdp),
    ("qwen3_5", sp_fsdp),
    ("qwen3_5", sp_tp),  # Gated DeltaNet by key heads: split in_proj_qkv and conv1d
    ("qwen3_5", fsdp_tp_ac),  # ... under FSDP2 x TP2 and recomputation
    ("qwen3_5_moe", sp_fsdp),
    ("qwen3_5_moe", sp_tp),  # experts, router and shared expert whole on every tp rank
    ("qwen3_vl_moe", ep2),
    ("qwen3_vl_moe", ep2_fsdp),
    ("qwen3_5_moe", ep2_fsdp),
    ("qwen3_vl_moe", ep2_tp2),
    ("qwen3_5_moe", ep2_tp2),  # Gated DeltaNet TP2 beside the experts' EP2
    # beyond Qwen: tower + projector, 1-D rope, tied embeddings (vocab-parallel under TP)
    ("gemma3", dp_tp),  # image blocks bidirectional in the sliding-window mask
    ("gemma3", tile_sp_fsdp),  # tile SP: images (one tile each) split; stand-in tiles
    ("gemma3", dp_fsdp),
    ("internvl", dp_tp),  # tiles, pixel shuffle
    ("internvl", sp_tp),  # tile SP: an image's tiles and a video's frames split
    ("internvl", dp_fsdp),
    ("llava_onevision", dp_tp),  # any-resolution crops, image_newline in the vision part
    ("llava_onevision", dp_fsdp),
    ("llava_onevision", sp_tp),  # tile SP: crops packed, frames pooled after the gather
    ("llava_onevision", tile_sp_fsdp),  # SP2 x FSDP2, a microbatch per sample: videos alone
]


@pytest.mark.parametrize("model_type,layout", CASES, ids=[f"{m}-{f.__name__}" for m, f in CASES])
def test_family_layout_matches_hf(tmp_path, model_type, layout):
    cfg = ADAPTERS[model_type].tiny_config()
    spec = HFModelSpec(config=cfg, seed=7)
    grids = AUDIO if "audio" in spec.adapter.parts else VISION
    if model_type in ("internvl", "llava_onevision"):
        grids = TILE_VIDEOS
    data = synthetic_samples(cfg, 12, grids=grids)
    groups = layout(spec.adapter.parts)
    loop = dict(LOOP, **getattr(layout, "loop", {}))
    result = run_layout(spec, data, loop, groups, tmp_path, "fam", local=True)
    assert_matches_reference(result, spec, data, loop)
    for part in spec.adapter.parts:  # metrics are named by the group
        assert f"{part}_compute_s" in result.metrics and f"{part}_grad_norm" in result.metrics
    if spec.adapter.router is not None:  # MoE: how evenly the experts got the tokens
        top, mean = result.metrics["text_expert_load_max"], result.metrics["text_expert_load_mean"]
        assert 1.0 <= mean <= top <= cfg.text_config.num_experts
    assert sorted(os.listdir(result.checkpoint.path)) == sorted(
        [*spec.adapter.parts, "config.json"]
    )
    split = model_type.startswith("qwen3_5") and isinstance(
        groups["text"].parallelism, TensorParallel
    )
    if split or any(isinstance(g.parallelism, ExpertParallel) for g in groups.values()):
        _assert_export_round_trips(result, spec, tmp_path)


def _assert_export_round_trips(result, spec, tmp_path):
    """Expert shards and row blocks (Qwen3.5's split ``in_proj_qkv``/``conv1d`` under
    text TP) come back whole: ``export_hf`` writes the HF layout that the family's
    ``from_pretrained`` (with its own weight conversions) loads unchanged."""
    out = export_hf(result.checkpoint, tmp_path / "hf")
    loaded = spec.adapter.hf_class.from_pretrained(out).state_dict()
    state = checkpoint_state(result.checkpoint)
    assert set(loaded) == set(state)
    for key, value in state.items():
        torch.testing.assert_close(loaded[key], value, rtol=0, atol=0, msg=key)
