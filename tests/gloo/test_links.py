"""Tier 2: 8 vision x 4 text replicas on the real channel without Ray equal the
single-process HF model, and each worker made one cross-group gloo group (its link) and
connected only to its neighbours, not to the 11 other workers."""

import json

from ray_disagg import HFModelSpec, tiny_qwen2_5_vl_config
from ray_disagg.data.examples import synthetic_samples
from ray_disagg.pipeline.neighbours import Neighbourhoods
from ray_disagg.testing.local import CHANNELS
from tests.helpers import assert_matches_reference, group, run_layout, vt

LOOP = {"max_steps": 2, "global_batch_size": 8, "lr": 1e-3, "eps": 1e-6, "seed": 3}


def test_eight_by_four_replicas_match_single_process_over_bounded_links(tmp_path):
    cfg = tiny_qwen2_5_vl_config()
    spec = HFModelSpec(config=cfg, seed=7)
    data = synthetic_samples(cfg, 16, grids=[(1, 4, 4), (1, 8, 4), None, (1, 4, 8)])
    groups = vt(group(8, cpus=0.25), group(4, cpus=0.25))
    result = run_layout(spec, data, LOOP, groups, tmp_path, "8x4", local=True)
    assert_matches_reference(result, spec, data, LOOP)
    made = json.loads((tmp_path / "8x4" / CHANNELS).read_text())
    assert len(made) == 12
    assert all(m["gloo"] == 1 and m["nccl"] == 0 for m in made.values()), made
    # side ranks: text 0-3, then vision 0-7; peers = ring neighbours (+ the two rank 0s)
    hood = Neighbourhoods(8, 4)
    for d in range(4):
        want = {4 + e for e in hood.of_llm(d)} | ({4} if d == 0 else set())
        assert set(made[f"text {d}"]["peers"]) <= want, (d, made[f"text {d}"])
    for e in range(8):
        want = set(hood.of_encoder(e)) | ({0} if e == 0 else set())
        assert set(made[f"vision {e}"]["peers"]) <= want, (e, made[f"vision {e}"])
    assert max(len(m["peers"]) for m in made.values()) <= 4  # not 11: every other worker
