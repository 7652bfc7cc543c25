"""Tier 2: a frozen LLM group (``trainable=False``) passes gradients to the encoder, keeps
its weights and skips the backward of a text-only microbatch, equal to the single-process
model (the workers without Ray, ``testing.local``)."""

import torch

from ray_disagg import HFModelSpec, TrainLoopConfig, load_metrics, tiny_qwen2_5_vl_config
from ray_disagg.data.examples import synthetic_samples
from ray_disagg.testing.reference import reference_train
from tests.helpers import assert_params_close, checkpoint_state, group, run_layout, vt


def test_frozen_llm_trains_the_encoder_through_text_only_microbatches(tmp_path):
    """Only the vision group trains (the LLM passes gradients through, keeps its weights);
    the second microbatch of every step is text-only, so nothing upstream of its loss
    trains and its backward is skipped."""
    cfg = tiny_qwen2_5_vl_config()
    spec = HFModelSpec(config=cfg, seed=11)
    grids = [(1, 4, 4), (1, 8, 4), (1, 4, 8), (1, 4, 4), None, None, None, None]
    data = synthetic_samples(cfg, 8, grids=grids)
    loop = {"max_steps": 2, "global_batch_size": 8, "micro_batches": 2, "shuffle": False}
    loop["assignment"] = "contiguous"  # microbatches in order: the second is text-only
    loop.update(eps=1e-6, schedule="sequential")
    groups = vt(group(1), group(1))
    groups["text"].trainable = False
    result = run_layout(
        spec, data, loop, groups, tmp_path, "frozen-llm", validation=data[:8], local=True
    )
    history = load_metrics(result)
    assert history["text_backward_passes"].tolist() == [1, 1]
    assert history["vision_backward_passes"].tolist() == [1, 1]
    assert history["text_grad_norm"].tolist() == [0.0, 0.0]
    ref_losses, _, ref_model = reference_train(spec, data, TrainLoopConfig(**loop), groups)
    torch.testing.assert_close(
        torch.tensor(history["loss"].tolist()), torch.tensor(ref_losses), rtol=1e-5, atol=0.0
    )
    state = checkpoint_state(result.checkpoint)
    initial = spec.build_full().state_dict()
    assert all(torch.equal(state[k], initial[k]) for k in state if not k.startswith("model.visual"))
    assert_params_close(state, ref_model.state_dict())
