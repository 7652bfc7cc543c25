"""Tier 2: with Ulysses SP=2 a vision worker keeps about half the activations of SP=1."""

import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed


def _activation_bytes(rank, world):
    from ray_disagg import HFModelSpec, tiny_qwen2_5_vl_config
    from ray_disagg.data.examples import synthetic_samples
    from ray_disagg.parallel.ulysses import enable_ulysses
    from ray_disagg.worker.memory import saved_activation_bytes

    cfg = tiny_qwen2_5_vl_config(vision_depth=4, fullatt_block_indexes=(1, 3))
    spec = HFModelSpec(config=cfg, seed=0)
    adapter, vision = spec.adapter, spec.build_part("vision")
    samples = synthetic_samples(cfg, 1, grids=[{"images": [(1, 16, 16), (1, 16, 8), (1, 8, 8)]}])
    cpu = torch.device("cpu")
    with saved_activation_bytes(vision) as sp1:
        adapter.encode(vision, "vision", samples, cpu)
    enable_ulysses(vision.model.visual)
    with saved_activation_bytes(vision) as sp2:
        adapter.encode(vision, "vision", samples, cpu, sp=dist.group.WORLD)
    return sp1[0], sp2[0]


def test_sp2_halves_activation_memory_per_worker():
    out = run_distributed(_activation_bytes, 2)
    for sp1, sp2 in out:
        assert 0.40 < sp2 / sp1 < 0.62, (sp1, sp2)
