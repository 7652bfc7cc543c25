"""Tier 2 (the groups' workers without Ray, ``testing.local``): FSDP2 layouts (alone and
composed with TP and SP) equal the single-process reference, and checkpoints move between
1 + 1, TP, FSDP2 and FSDP2 x TP2 / SP2 x FSDP2 without any rank holding the full model;
weights come from a multi-file pretrained directory that every worker reads only its own
keys and shards from."""

import pytest
import torch

from ray_disagg import (
    DataParallel,
    HFModelSpec,
    SequenceParallel,
    TensorParallel,
    TrainLoopConfig,
    load_metrics,
    tiny_qwen2_5_vl_config,
)
from ray_disagg.data.examples import synthetic_samples
from ray_disagg.testing.reference import reference_train
from tests.helpers import assert_params_close, checkpoint_state, group, run_layout, vt


def fit(*args, **kwargs):
    return run_layout(*args, local=True, **kwargs)


# text-only samples put vision replicas without any image in some steps (FSDP2 stand-ins)
GRIDS = [(1, 4, 4), None, None, (1, 4, 8), (1, 8, 4), None]
LOOP = {"global_batch_size": 4, "eps": 1e-6, "seed": 3}

# (name, groups, steps trained by this layout)
CHAIN = [
    ("one-one", lambda: vt(group(1), group(1)), 1),
    ("tp2", lambda: vt(group(2), group(2, TensorParallel(size=2))), 1),
    (
        "fsdp2",
        lambda: vt(group(2, DataParallel(fsdp=True)), group(2, DataParallel(fsdp=True))),
        3,
    ),
    (
        "sp2xfsdp-fsdp2xtp2",
        lambda: vt(
            group(2, SequenceParallel(size=2, fsdp=True), cpus=0.25, ac=True),
            group(4, TensorParallel(size=2, fsdp=True), cpus=0.25),
        ),
        3,
    ),
    ("back-to-one-one", lambda: vt(group(1), group(1)), 1),
]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    cfg = tiny_qwen2_5_vl_config()
    path = tmp_path_factory.mktemp("pretrained")
    HFModelSpec(config=cfg, seed=11).build_full().save_pretrained(path, max_shard_size="60KB")
    assert len(list(path.glob("*.safetensors"))) > 3  # really several files and an index
    return HFModelSpec(pretrained_path=path), synthetic_samples(cfg, 12, grids=GRIDS)


def test_fsdp_layouts_and_resharding_checkpoints_match_reference(pretrained, tmp_path):
    spec, data = pretrained
    total = sum(steps for _, _, steps in CHAIN)
    ref_states, ref_losses = {}, None
    done, previous, losses = 0, None, []
    for name, groups, steps in CHAIN:
        done += steps
        loop = dict(LOOP, max_steps=done, loss_chunk_tokens=5)  # chunks under FSDP2 (x TP)
        result = fit(spec, data, loop, groups(), tmp_path, name, resume=previous)
        got = load_metrics(result)
        assert got["step"].tolist() == list(range(done - steps + 1, done + 1)), name
        losses += got["loss"].tolist()
        ref_losses, _, ref_model = reference_train(spec, data, TrainLoopConfig(**loop))
        ref_states[name] = ref_model.state_dict()
        # parameters after this layout's last step, from its sharded checkpoint
        assert_params_close(checkpoint_state(result.checkpoint), ref_states[name])
        assert got["text_grad_norm"].gt(0).all() and got["loss"].notna().all()
        previous = result.checkpoint
    assert done == total
    torch.testing.assert_close(
        torch.tensor(losses, dtype=torch.float64),
        torch.tensor(ref_losses, dtype=torch.float64),
        rtol=1e-5,
        atol=0.0,
    )


def test_fsdp_bf16_mixed_and_pure_bf16_train_close_to_fp32(pretrained, tmp_path):
    spec, data = pretrained
    loop = dict(LOOP, max_steps=2, bf16=True)
    groups = vt(group(2, DataParallel(fsdp=True)), group(2, DataParallel(fsdp=True)))
    ref_losses, _, _ = reference_train(spec, data, TrainLoopConfig(**dict(loop, bf16=False)))
    mixed = fit(spec, data, loop, groups, tmp_path, "mixed")
    state = checkpoint_state(mixed.checkpoint)
    assert all(v.dtype == torch.float32 for v in state.values())  # fp32 master weights
    pure = fit(spec, data, dict(loop, param_dtype="bfloat16"), groups, tmp_path, "pure")
    state = checkpoint_state(pure.checkpoint)
    assert all(v.dtype == torch.bfloat16 for v in state.values())  # bf16 params and AdamW
    for result in (mixed, pure):
        losses = load_metrics(result)["loss"].tolist()
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(ref_losses), rtol=0.02, atol=0.0
        )
