"""Tier 2: Ulysses sequence parallelism (gloo, real processes) equals each family's HF tower
(outputs, DeepStack features and parameter gradients), with ragged and empty slices."""

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed


def _round_trip(rank, world, seq_lens):
    from ray_disagg.parallel.ulysses import GatherToLeader, HeadsToSeq, SeqToHeads

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


def _sp_tower(rank, world, model_type, spec, seed, heads):
    from ray_disagg import HFModelSpec
    from ray_disagg.data.examples import synthetic_samples
    from ray_disagg.models import ADAPTERS
    from ray_disagg.parallel.ulysses import enable_ulysses

    cfg = ADAPTERS[model_type].tiny_config(vision_heads=heads, vision_hidden=8 * heads)
    model = HFModelSpec(config=cfg, seed=seed).build_part("vision")
    adapter = ADAPTERS[model_type](cfg)
    samples = synthetic_samples(cfg, 1, seed=seed, grids=[spec])
    cpu = torch.device("cpu")
    ref = adapter.encode(model, "vision", samples, cpu)
    g = torch.Generator().manual_seed(seed)
    upstream = {k: torch.randn(v.shape, generator=g) for k, v in ref.items()}
    torch.autograd.backward([ref[k] for k in ref], [upstream[k] for k in ref])
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    tower = adapter.part_roots(model, "vision")[0]
    enable_ulysses(tower)
    out = adapter.encode(model, "vision", samples, cpu, sp=dist.group.WORLD)
    assert sorted(out) == sorted(ref)
    grads_in = [upstream[k] if rank == 0 else torch.zeros_like(out[k]) for k in out]
    torch.autograd.backward([out[k] for k in out], grads_in)
    grads = {
        n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
        for n, p in model.named_parameters()
    }
    for v in grads.values():
        dist.all_reduce(v)  # SP ranks hold partial gradients of the replicated weights
    return {
        "ref": {k: v.detach() for k, v in ref.items()},
        "out": {k: v.detach() for k, v in out.items()},
        "ref_grads": ref_grads,
        "grads": grads,
    }


CASES = [
    # ragged images and a 2-frame video, several windows / merge units each
    (2, 4, {"images": [(1, 8, 8), (1, 4, 8), (1, 12, 4)], "videos": [(2, 4, 8)]}),
    (2, 4, {"images": [(1, 4, 4)]}),  # one window / merge unit: rank 1 holds nothing
    (3, 6, {"images": [(1, 8, 16), (1, 4, 4)]}),
]


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("world,heads,spec", CASES, ids=["ragged+video", "tiny", "sp3"])
def test_sp_tower_matches_hf(model_type, world, heads, spec):
    out = run_distributed(_sp_tower, world, model_type, spec, 11, heads)
    for key, ref in out[0]["ref"].items():  # embeddings and DeepStack features
        torch.testing.assert_close(out[0]["out"][key], ref, rtol=1e-5, atol=1e-6, msg=key)
        for r in range(1, world):
            assert out[r]["out"][key].shape[0] == 0
    for name, ref in out[0]["ref_grads"].items():  # summed fp32 gradients: relative norm
        err = float((out[0]["grads"][name] - ref).norm() / ref.norm().clamp_min(1e-12))
        assert err < 1e-5, f"{name}: relative error {err:.1e}"


def _two_microbatches(rank, world, model_type):
    from ray_disagg import HFModelSpec
    from ray_disagg.data.examples import synthetic_samples
    from ray_disagg.models import ADAPTERS
    from ray_disagg.parallel.ulysses import enable_ulysses

    cfg = ADAPTERS[model_type].tiny_config()
    model = HFModelSpec(config=cfg, seed=5).build_part("vision")
    adapter = ADAPTERS[model_type](cfg)
    specs = [{"images": [(1, 8, 8), (1, 4, 8)]}, {"images": [(1, 4, 4)], "videos": [(2, 4, 8)]}]
    mbs = [synthetic_samples(cfg, 1, seed=i, grids=[s]) for i, s in enumerate(specs)]
    cpu = torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    refs = [adapter.encode(model, "vision", s, cpu) for s in mbs]
    upstream = [{k: torch.randn(v.shape, generator=g) for k, v in r.items()} for r in refs]
    for ref, up in zip(refs, upstream):
        torch.autograd.backward([ref[k] for k in ref], [up[k] for k in ref])
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    tower = adapter.part_roots(model, "vision")[0]
    tower.gradient_checkpointing_enable({"use_reentrant": False})  # backward recomputes
    enable_ulysses(tower)
    outs = [adapter.encode(model, "vision", s, cpu, sp=dist.group.WORLD) for s in mbs]
    for out, up in reversed(list(zip(outs, upstream))):  # the last forward first
        grads_in = [up[k] if rank == 0 else torch.zeros_like(out[k]) for k in out]
        torch.autograd.backward([out[k] for k in out], grads_in)
    grads = {
        n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
        for n, p in model.named_parameters()
    }
    for v in grads.values():
        dist.all_reduce(v)
    state = [k for m in tower.modules() for k in vars(m) if "ulysses" in k]
    return {"ref_grads": ref_grads, "grads": grads, "state_on_modules": state}


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl"])
def test_interleaved_microbatches_recompute_with_their_own_slices(model_type):
    """Two microbatches of different lengths forwarded back to back, then backwarded in
    reverse order with activation checkpointing (the recomputed attention needs each
    microbatch's own slice), give the single-process gradients; the slice state travels
    with each call, none is kept on the tower."""
    out = run_distributed(_two_microbatches, 2, model_type)
    assert out[0]["state_on_modules"] == []
    for name, ref in out[0]["ref_grads"].items():
        err = float((out[0]["grads"][name] - ref).norm() / ref.norm().clamp_min(1e-12))
        assert err < 1e-5, f"{name}: relative error {err:.1e}"


def test_host_rows_copy_only_the_rows_asked_for():
    """A rank's slice of several samples' pixels, gathered from read-only views (as the
    object store hands them out) in any order, equals indexing their concatenation."""
    import numpy as np

    from ray_disagg.parallel.ulysses import HostRows

    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((n, 6)) for n in (4, 1, 7)]
    for a in arrays:
        a.setflags(write=False)
    index = torch.tensor([11, 5, 0, 4, 6, 3])
    got = HostRows(arrays, "cpu").take(index)
    want = torch.from_numpy(np.concatenate(arrays).astype(np.float32))[index]
    assert got.dtype == torch.float32 and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
