"""Tier 2 (the groups' workers without Ray): Qwen3.5's LLM context parallelism. The
softmax layers run Ulysses on the sequence's slices; the Gated DeltaNet layers run the
whole sequence split by heads (``ray_disagg.models.qwen3_5.context``): losses and
parameters after 2 steps equal the family's single-process HF model (fp32, 1e-5), packed
(the per-sample spans on the gathered rows) under FSDP2 with activation checkpointing (the
layers' collectives rerun in the recomputation), and for Qwen3.5-MoE padded (its router's
auxiliary loss over the cp ranks' tokens). Text TP inside CP is refused on the driver."""

import pytest
from ray.train import ScalingConfig

from ray_disagg import (
    ContextParallel,
    HFModelSpec,
    ModuleGroup,
    tiny_qwen3_5_config,
    tiny_qwen3_5_moe_config,
)
from ray_disagg.data.examples import synthetic_samples
from ray_disagg.launch.checks import validate_layout
from ray_disagg.models import get_adapter
from tests.helpers import assert_matches_reference, group, run_layout, vt

LOOP = {"max_steps": 2, "global_batch_size": 6, "lr": 1e-3, "eps": 1e-6, "seed": 3}  # fmt: skip
PACKED = {**LOOP, "pack_sequences": True, "max_seq_len": 160}
GRIDS = [(1, 8, 8), None, {"videos": [(2, 4, 4)]}, None, (1, 4, 8), {"images": [(1, 8, 4)] * 2}]


@pytest.mark.parametrize(
    "model_type,loop,cp",
    [
        ("qwen3_5", PACKED, {"fsdp": True}),  # packed rows, FSDP2, activation checkpointing
        ("qwen3_5_moe", LOOP, {}),  # padded rows, the router's auxiliary loss
    ],
    ids=["qwen3_5-cp2-fsdp-packed", "qwen3_5_moe-cp2"],
)
def test_gated_deltanet_by_heads_under_cp_trains_like_hf(model_type, loop, cp, tmp_path):
    make = tiny_qwen3_5_config if model_type == "qwen3_5" else tiny_qwen3_5_moe_config
    cfg = make()
    spec = HFModelSpec(config=cfg, seed=7)
    data = synthetic_samples(cfg, 12, grids=GRIDS)
    text = group(2, ContextParallel(size=2, **cp), ac=bool(cp))
    result = run_layout(spec, data, loop, vt(group(1), text), tmp_path, "cp", local=True)
    assert_matches_reference(result, spec, data, loop)
    if model_type == "qwen3_5_moe":
        assert result.metrics["text_expert_load_mean"] >= 1.0


def test_cp_with_text_tp_and_degrees_beyond_the_key_heads_are_refused():
    adapter = get_adapter(tiny_qwen3_5_config())

    def groups(n, **cp):
        text = ModuleGroup(
            scaling_config=ScalingConfig(num_workers=n), parallelism=ContextParallel(**cp)
        )
        return {"vision": ModuleGroup(scaling_config=ScalingConfig(num_workers=1)), "text": text}

    validate_layout(adapter, groups(2, size=2))
    with pytest.raises(ValueError, match=r"ContextParallel\(size=2, tp=2\) is not supported"):
        validate_layout(adapter, groups(4, size=2, tp=2))
    keys = adapter.config.text_config.linear_num_key_heads  # 2 (4 query heads)
    with pytest.raises(ValueError, match=f"size=4.* does not divide linear_num_key_heads={keys}"):
        validate_layout(adapter, groups(4, size=4))
