"""Tier 2 (the groups' workers without Ray): Qwen3.5 with packed rows. Its Gated DeltaNet
layers run each packed sample as its own row (``ray_disagg.models.qwen3_5.packing``), so
no recurrent state or convolution crosses samples: the packed run equals the family's
single-process HF model on the unpacked batches (3 steps, fp32, 1e-5), alone and under
text TP2 (the layers' key heads sharded), with samples of very different lengths sharing
rows."""

import pytest

from ray_disagg import HFModelSpec, TensorParallel, tiny_qwen3_5_config
from ray_disagg.data.examples import synthetic_samples
from tests.helpers import assert_matches_reference, group, run_layout, vt

LOOP = {"max_steps": 3, "global_batch_size": 6, "lr": 1e-3, "eps": 1e-6, "seed": 3,
        "pack_sequences": True, "max_seq_len": 160}  # fmt: skip
GRIDS = [(1, 8, 8), None, {"videos": [(2, 4, 4)]}, None, (1, 4, 8), {"images": [(1, 8, 4)] * 2}]


@pytest.mark.parametrize("text", ["1", "tp2"])
def test_packed_gated_deltanet_equals_the_unpacked_hf_model(tmp_path, text):
    cfg = tiny_qwen3_5_config()
    spec = HFModelSpec(config=cfg, seed=7)
    data = synthetic_samples(cfg, 12, grids=GRIDS)
    llm = group(1) if text == "1" else group(2, TensorParallel(size=2))
    result = run_layout(spec, data, LOOP, vt(group(1), llm), tmp_path, text, local=True)
    assert_matches_reference(result, spec, data, LOOP)
