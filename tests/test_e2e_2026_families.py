"""Tier 3, one Ray run per 2026 family (Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE): the groups
as Ray Train worker groups equal the family's single-process HF model (losses and
parameters, fp32, 1e-5), the MoE families with the router's auxiliary loss over the
global batch. The other layouts are in the gloo tier (``test_e2e_families``)."""

import pytest

from ray_disagg import ADAPTERS, DataParallel, HFModelSpec
from ray_disagg.data.examples import synthetic_samples
from tests.helpers import assert_matches_reference, group, run_layout, vt

LOOP = {"max_steps": 2, "global_batch_size": 4, "lr": 1e-3, "eps": 1e-6, "seed": 3}
LOOP["checkpoint_every"] = 1  # the metrics history comes from the checkpoints
GRIDS = [{"images": [(1, 4, 4), (1, 8, 4)]}, None, {"videos": [(2, 4, 8)]}, (1, 8, 8)]
LAYOUTS = {
    "qwen3_vl_moe": lambda: vt(group(1), group(2)),  # the aux loss over 2 replicas
    "qwen3_5": lambda: vt(group(2), group(1)),
    "qwen3_5_moe": lambda: vt(group(1), group(2, DataParallel(fsdp=True))),
}


@pytest.mark.parametrize("model_type", sorted(LAYOUTS))
def test_family_trains_on_ray_like_hf(ray_start_4_cpus, tmp_path, model_type):
    cfg = ADAPTERS[model_type].tiny_config()
    spec = HFModelSpec(config=cfg, seed=11)
    data = synthetic_samples(cfg, 8, grids=GRIDS)
    result = run_layout(spec, data, LOOP, LAYOUTS[model_type](), tmp_path, model_type)
    assert_matches_reference(result, spec, data, LOOP)
