"""Tier 3, one Ray run with DPO: the groups as Ray Train worker groups (a trained
vision tower with its reference copy, text, two 1F1B microbatches) equal the
independently written single-process DPO (losses, parameters), and the Result carries
TRL's metric names. The other layouts are in the gloo tier
(``tests/gloo/test_preference.py``)."""

import torch

from ray_disagg import DPO, HFModelSpec, TrainLoopConfig, tiny_qwen2_5_vl_config
from ray_disagg.data.examples import synthetic_pairs
from ray_disagg.testing.reference import reference_preference
from tests.helpers import assert_params_close, checkpoint_state, group, losses, run_layout, vt
from tests.preference_data import trl_pair_loss

LOOP = {"global_batch_size": 4, "max_steps": 2, "checkpoint_every": 1, "eps": 1e-6, "seed": 3,
        "micro_batches": 2}  # fmt: skip


def test_dpo_on_ray_equals_single_process(ray_start_4_cpus, tmp_path):
    cfg = tiny_qwen2_5_vl_config()
    spec, pairs = HFModelSpec(config=cfg, seed=4), synthetic_pairs(cfg, 8)
    dpo = DPO(beta=0.1, loss_type="hinge")
    loop = LOOP | {"objective": dpo}
    result = run_layout(spec, pairs, loop, vt(group(1), group(1)), tmp_path, "dpo")
    pair_loss = trl_pair_loss("hinge", 0.1)
    ref_losses, _, ref_model = reference_preference(spec, pairs, TrainLoopConfig(**LOOP), pair_loss)

    torch.testing.assert_close(losses(result), ref_losses, rtol=1e-5, atol=0.0)
    assert_params_close(checkpoint_state(result.checkpoint), ref_model.state_dict(), 1e-5)
    assert set(dpo.metric_names) <= set(result.metrics)
    assert result.metrics["rewards/accuracies"] in (0.0, 0.25, 0.5, 0.75, 1.0)
