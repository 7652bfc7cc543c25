"""Tier 2: Ulysses context parallelism of the LLM over 2 gloo processes equals the
single-process model: the loss (summed over the ranks) and every gradient, for padded
rows of different lengths and for packed rows (fp32, 1e-5); bad degrees are refused."""

import pytest
import torch

from tests.dist_utils import run_distributed


def _batch(adapter, cfg, packed: bool):
    from ray_disagg.data.examples import synthetic_samples

    samples = synthetic_samples(cfg, 3, grids=[(1, 4, 4), None, (1, 8, 4)])
    if packed:
        return adapter.collate_llm_packed(samples, 200)
    return adapter.collate_llm(samples)


def _cp_text(rank, world, packed):
    import torch.distributed as dist

    from ray_disagg import HFModelSpec, tiny_qwen2_5_vl_config
    from ray_disagg.models.base import IGNORE_INDEX
    from ray_disagg.models.loss import lm_loss
    from ray_disagg.parallel.context_parallel import (
        ContextSlice,
        enable_context_parallel,
        local_targets,
        slice_bounds,
    )

    cfg = tiny_qwen2_5_vl_config()
    spec = HFModelSpec(config=cfg, seed=2)
    adapter = spec.adapter
    batch = _batch(adapter, cfg, packed)
    n_img = int((batch["input_ids"] == cfg.image_token_id).sum())
    g = torch.Generator().manual_seed(1)
    received = {
        c.name: torch.randn(n_img if c.name.startswith("image") else 0, c.width, generator=g)
        for c in adapter.crossings("vision")
    }
    n_labels = float((batch["labels"][:, 1:] != IGNORE_INDEX).sum())

    def run(part, context=None):
        got = {k: v.clone().requires_grad_() for k, v in received.items() if v.shape[0]}
        hidden = adapter.llm_hidden(part, batch, got, context=context)
        lm_head = adapter.llm_modules(part)[1]
        if context is None:
            loss = lm_loss(hidden, lm_head, batch["labels"], n_labels)
        else:
            lo, hi = context.bounds[context.rank]
            targets = local_targets(batch["labels"], lo, hi)
            loss = lm_loss(hidden, lm_head, targets, n_labels, shifted=True)
        loss.backward()
        grads = {n: p.grad for n, p in part.named_parameters() if p.grad is not None}
        return loss.detach(), {k: v.grad for k, v in got.items()}, grads

    dense = run(spec.build_part("text"))
    part = spec.build_part("text")
    enable_context_parallel(adapter.llm_modules(part)[0])
    bounds = tuple(slice_bounds(batch["input_ids"].shape[1], world))
    cp = run(part, ContextSlice(dist.group.WORLD, rank, bounds, packed=packed))
    loss, crossing_grads, grads = cp
    dist.all_reduce(loss)
    for t in [*crossing_grads.values(), *grads.values()]:
        dist.all_reduce(t)
    torch.testing.assert_close(loss, dense[0], rtol=1e-5, atol=1e-7)
    for k, v in dense[1].items():
        torch.testing.assert_close(crossing_grads[k], v, rtol=1e-5, atol=1e-6)
    assert grads.keys() == dense[2].keys()
    for k, v in dense[2].items():
        torch.testing.assert_close(grads[k], v, rtol=1e-5, atol=1e-6, msg=k)
    return True


@pytest.mark.parametrize("packed", [False, True])
def test_cp2_equals_the_single_process_llm(packed):
    assert run_distributed(_cp_text, 2, packed) == [True, True]


def test_context_parallel_degrees_and_short_sequences_are_checked():
    from ray.train import ScalingConfig

    from ray_disagg import (
        ContextParallel,
        ModuleGroup,
        tiny_gemma3_config,
        tiny_qwen2_5_vl_config,
        tiny_qwen3_5_config,
        tiny_qwen3_vl_config,
    )
    from ray_disagg.launch.checks import validate_layout
    from ray_disagg.models import get_adapter
    from ray_disagg.parallel.context_parallel import slice_bounds

    assert slice_bounds(5, 2) == [(0, 3), (3, 5)]
    with pytest.raises(ValueError, match="shorter than the context-parallel degree 4"):
        slice_bounds(3, 4)

    def groups(size, n=None):
        text = ModuleGroup(
            scaling_config=ScalingConfig(num_workers=n or size),
            parallelism=ContextParallel(size=size),
        )
        return {"vision": ModuleGroup(scaling_config=ScalingConfig(num_workers=1)), "text": text}

    adapter = get_adapter(tiny_qwen2_5_vl_config())
    validate_layout(adapter, groups(2, 4))
    heads = adapter.config.text_config.num_attention_heads
    with pytest.raises(ValueError, match=f"size=3.* does not divide num_attention_heads={heads}"):
        validate_layout(adapter, groups(3))
    validate_layout(get_adapter(tiny_qwen3_5_config()), groups(2))  # DeltaNet by heads
    validate_layout(get_adapter(tiny_gemma3_config()), groups(2))  # image blocks masked
    validate_layout(get_adapter(tiny_qwen3_vl_config()), groups(2))  # DeepStack sliced
    with pytest.raises(ValueError, match=r"ContextParallel\(size=0\): must be an int"):
        ContextParallel(size=0)


@pytest.mark.parametrize(
    "workers,cp,extra",
    [
        (2, {}, {}),  # cp2
        (4, {}, {"pack_sequences": True, "max_seq_len": 200}),  # dp2 x cp2, packed rows
        (2, {"fsdp": True}, {"loss_chunk_tokens": 3}),  # cp2 x FSDP2, chunked loss
        (4, {"tp": 2}, {"loss_chunk_tokens": 4}),  # cp2 x tp2 (mesh dp x cp x tp)
        (4, {"tp": 2, "fsdp": True}, {"pack_sequences": True, "max_seq_len": 200}),
    ],
    ids=["cp2", "dp2xcp2-packed", "cp2-fsdp2-chunked", "cp2xtp2", "cp2xtp2-fsdp2-packed"],
)
def test_cp_layouts_train_like_the_single_process_model(workers, cp, extra, tmp_path):
    """The real workers (without Ray): losses and parameters after 2 steps equal the
    single-process HF model's (fp32, 1e-5)."""
    from ray_disagg import ContextParallel, HFModelSpec, tiny_qwen2_5_vl_config
    from ray_disagg.data.examples import synthetic_samples
    from tests.helpers import assert_matches_reference, group, run_layout, vt

    cfg = tiny_qwen2_5_vl_config()
    spec = HFModelSpec(config=cfg, seed=5)
    data = synthetic_samples(cfg, 8, grids=[(1, 4, 4), None, (1, 8, 4), (1, 4, 8)])
    loop = {"max_steps": 2, "global_batch_size": 4, "eps": 1e-6}
    loop = {**loop, "seed": 5, **extra}
    text = group(workers, ContextParallel(size=2, **cp))
    result = run_layout(spec, data, loop, vt(group(1), text), tmp_path, "cp", local=True)
    assert_matches_reference(result, spec, data, loop)


@pytest.mark.parametrize(
    "model_type,workers,extra",
    [
        ("qwen3_vl", 2, {}),  # DeepStack's mask and rows sliced with the sequence
        # (Adam's eps 1e-4: a near-zero gradient entry's update would magnify fp32 rounding)
        ("qwen3_vl", 2, {"pack_sequences": True, "max_seq_len": 200, "eps": 1e-4}),
        ("qwen3_vl_moe", 4, {}),  # dp2 x cp2: the router's aux loss over all four ranks
        ("qwen2_5_omni_thinker", 2, {}),  # mrope over audio, video and image positions
        ("internvl", 2, {}),  # 1-D rope, padded rows
        ("internvl", 2, {"pack_sequences": True, "max_seq_len": 200}),  # 1-D packed rows
        ("llava_onevision", 2, {}),
        ("gemma3", 2, {}),  # image blocks and sliding window across the split, padded
        ("gemma3", 2, {"pack_sequences": True, "max_seq_len": 200}),  # ... and packed
    ],
    ids=[
        "qwen3_vl-cp2",
        "qwen3_vl-cp2-packed",
        "qwen3_vl_moe-dp2xcp2",
        "omni-cp2",
        "internvl-cp2",
        "internvl-cp2-packed",
        "llava_onevision-cp2",
        "gemma3-cp2",
        "gemma3-cp2-packed",
    ],  # fmt: skip
)
def test_cp_for_more_families_trains_like_the_single_process_model(
    model_type, workers, extra, tmp_path
):
    """LLM context parallelism beyond Qwen2/2.5-VL: Qwen3-VL's DeepStack features (added
    after the first decoder layers), Qwen3-VL-MoE's router auxiliary loss (over the
    global batch), Qwen2.5-Omni's audio positions, the 1-D rope of InternVL and
    LLaVA-OneVision (packed rows told apart by the batch, not by mrope's rows): losses
    and parameters after 2 steps equal HF's (fp32, 1e-5)."""
    from ray_disagg import ADAPTERS, ContextParallel, HFModelSpec
    from ray_disagg.data.examples import synthetic_samples
    from tests.helpers import assert_matches_reference, group, run_layout

    cfg = ADAPTERS[model_type].tiny_config()
    spec = HFModelSpec(config=cfg, seed=5)
    grids = [{"images": [(1, 4, 4), (1, 8, 4)]}, None, {"videos": [(2, 4, 8)]}, (1, 8, 8)]
    if model_type == "qwen2_5_omni_thinker":
        grids = [{"images": [(1, 4, 8)], "audios": [40]}, None, {"audios": [24, 17]}, (1, 8, 8)]
    data = synthetic_samples(cfg, 8, grids=grids)
    loop = {"max_steps": 2, "global_batch_size": 4, "eps": 1e-6,
            "seed": 5, **extra}  # fmt: skip
    groups = {p: group(1) for p in spec.adapter.parts}  # (Omni: vision, audio, text)
    groups["text"] = group(workers, ContextParallel(size=2))
    result = run_layout(spec, data, loop, groups, tmp_path, "cp", local=True)
    assert_matches_reference(result, spec, data, loop)
    if model_type == "qwen3_vl_moe":
        assert result.metrics["text_expert_load_mean"] >= 1.0
