"""Tier 2: Ulysses sequence parallelism (gloo, real processes) equals the HF vision tower."""

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed


def _round_trip(rank, world, seq_lens):
    from ray_disagg._internal.ulysses import GatherToLeader, HeadsToSeq, SeqToHeads

    torch.manual_seed(rank)
    heads, d = 4, 3
    x = torch.randn(seq_lens[rank], heads, d, requires_grad=True)
    y = SeqToHeads.apply(x, seq_lens, rank, dist.group.WORLD)
    z = HeadsToSeq.apply(y, seq_lens, rank, dist.group.WORLD)
    (z * 2).sum().backward()
    flat = x.reshape(seq_lens[rank], heads * d)
    g = GatherToLeader.apply(flat, seq_lens, rank, dist.group.WORLD)
    return {"x": x.detach(), "y": y.detach(), "z": z.detach(), "grad": x.grad, "g": g.detach()}


@pytest.mark.parametrize("seq_lens", [[3, 3], [5, 0], [2, 4]])
def test_all_to_all_round_trip_and_gather(seq_lens):
    out = run_distributed(_round_trip, 2, seq_lens)
    xs = torch.cat([o["x"] for o in out])  # (S, H, d), rank order
    hn = xs.shape[1] // 2
    for r, o in enumerate(out):
        torch.testing.assert_close(o["y"], xs[:, r * hn : (r + 1) * hn])  # my head group, all seq
        torch.testing.assert_close(o["z"], o["x"])
        torch.testing.assert_close(o["grad"], torch.full_like(o["x"], 2.0))
    torch.testing.assert_close(out[0]["g"], xs.reshape(xs.shape[0], -1))
    assert out[1]["g"].shape[0] == 0


def _sp_tower(rank, world, grids, seed, heads):
    from ray_disagg import Qwen2_5_VLSpec, tiny_qwen2_5_vl_config
    from ray_disagg._internal.ulysses import enable_ulysses, sp_vision_forward

    cfg = tiny_qwen2_5_vl_config(vision_heads=heads, vision_hidden=8 * heads, window_size=16)
    vision = Qwen2_5_VLSpec(config=cfg, seed=seed).build_vision()
    grid = torch.tensor(grids)
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 4 * 4, generator=g)
    upstream = torch.randn(int(grid.prod(-1).sum()) // 4, cfg.text_config.hidden_size, generator=g)

    ref = vision(pixels, grid)
    (ref * upstream).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in vision.named_parameters()}
    vision.zero_grad(set_to_none=True)

    enable_ulysses(vision.visual, dist.group.WORLD)
    out = sp_vision_forward(vision.visual, pixels, grid)
    out.backward(upstream if rank == 0 else torch.zeros_like(out))
    grads = {
        n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
        for n, p in vision.named_parameters()
    }
    for v in grads.values():
        dist.all_reduce(v)  # SP ranks hold partial gradients of the replicated weights
    return {"ref": ref.detach(), "out": out.detach(), "ref_grads": ref_grads, "grads": grads}


@pytest.mark.parametrize(
    "world,heads,grids",
    [
        (2, 4, [[1, 8, 8], [1, 4, 8], [1, 12, 4]]),  # ragged images, several windows each
        (2, 4, [[1, 4, 4]]),  # one image, one window: rank 1 holds nothing
        (3, 6, [[1, 8, 16], [1, 4, 4]]),
    ],
)
def test_sp_vision_tower_matches_hf(world, heads, grids):
    out = run_distributed(_sp_tower, world, grids, 11, heads)
    torch.testing.assert_close(out[0]["out"], out[0]["ref"], rtol=1e-5, atol=1e-6)
    for r in range(1, world):
        assert out[r]["out"].shape[0] == 0
    for name, ref in out[0]["ref_grads"].items():
        torch.testing.assert_close(out[0]["grads"][name], ref, rtol=1e-4, atol=1e-6, msg=name)
