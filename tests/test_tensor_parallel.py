"""Tier 2: tensor parallelism of the text part (gloo, real processes) equals the dense part."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.dist_utils import run_distributed


def _vocab_ce(rank, world):
    from ray_disagg._internal.tensor_parallel import VocabParallelCrossEntropy

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 12, generator=g)
    target = torch.randint(0, 12, (7,), generator=g)
    target[2] = -100
    ref_logits = logits.clone().requires_grad_()
    ref = F.cross_entropy(ref_logits, target, ignore_index=-100, reduction="sum")
    ref.backward()
    v = 12 // world
    shard = logits[:, rank * v : (rank + 1) * v].clone().requires_grad_()
    loss = VocabParallelCrossEntropy.apply(shard, target, rank * v, -100, dist.group.WORLD).sum()
    loss.backward()
    return {
        "loss": loss.detach(),
        "ref": ref.detach(),
        "grad": shard.grad,
        "ref_grad": ref_logits.grad,
    }


@pytest.mark.parametrize("world", [2, 3])
def test_vocab_parallel_cross_entropy_matches_torch(world):
    out = run_distributed(_vocab_ce, world)
    v = 12 // world
    for r, o in enumerate(out):
        torch.testing.assert_close(o["loss"], o["ref"])
        torch.testing.assert_close(o["grad"], o["ref_grad"][:, r * v : (r + 1) * v])


def _tp_text(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from ray_disagg import Qwen2_5_VLSpec, tiny_qwen2_5_vl_config
    from ray_disagg._internal.reference import reference_batch
    from ray_disagg._internal.tensor_parallel import parallelize_text
    from ray_disagg.examples_data import synthetic_samples

    cfg = tiny_qwen2_5_vl_config()
    spec = Qwen2_5_VLSpec(config=cfg, seed=2)
    samples = synthetic_samples(cfg, 3, grids=[(1, 4, 4), None, (1, 8, 4)])
    b = reference_batch(samples, cfg)
    n_img = int((b["input_ids"] == cfg.image_token_id).sum())
    emb = torch.randn(
        n_img, cfg.text_config.hidden_size, generator=torch.Generator().manual_seed(1)
    )
    args = (b["input_ids"], b["attention_mask"], b["labels"])

    def run(part):
        e = emb.clone().requires_grad_()
        loss = part(*args, e, b["image_grid_thw"], 10.0)
        loss.backward()
        grads = {}
        for n, p in part.named_parameters():
            g = p.grad
            grads[n] = g.full_tensor() if isinstance(g, DTensor) else g
        return loss.detach(), e.grad, grads

    dense = run(spec.build_text())
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    part = spec.build_text()
    parallelize_text(part, mesh)
    sharded = run(part)
    return {"dense": dense, "tp": sharded}


def test_tp_text_part_matches_dense_including_embedding_gradient():
    out = run_distributed(_tp_text, 2)
    for o in out:
        (dl, de, dg), (tl, te, tg) = o["dense"], o["tp"]
        torch.testing.assert_close(tl, dl, rtol=1e-6, atol=0)
        # the gradient sent back to the vision group: full, not a per-rank partial sum
        torch.testing.assert_close(te, de, rtol=1e-5, atol=1e-7)
        for name, g in dg.items():
            torch.testing.assert_close(tg[name], g, rtol=1e-5, atol=1e-6, msg=name)
