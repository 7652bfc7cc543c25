"""Tier 2: with Ulysses SP=2 a vision worker keeps about half the activations of SP=1."""

import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed


def _activation_bytes(rank, world):
    from ray_disagg import Qwen2_5_VLSpec, tiny_qwen2_5_vl_config
    from ray_disagg._internal.memory import saved_activation_bytes
    from ray_disagg._internal.ulysses import enable_ulysses, sp_vision_forward

    cfg = tiny_qwen2_5_vl_config(vision_depth=4, fullatt_block_indexes=(1, 3))
    vision = Qwen2_5_VLSpec(config=cfg, seed=0).build_vision()
    grid = torch.tensor([[1, 16, 16], [1, 16, 8], [1, 8, 8]])
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 4 * 4)
    with saved_activation_bytes(vision) as sp1:
        vision(pixels, grid)
    enable_ulysses(vision.visual, dist.group.WORLD)
    with saved_activation_bytes(vision) as sp2:
        sp_vision_forward(vision.visual, pixels, grid)
    return sp1[0], sp2[0]


def test_sp2_halves_activation_memory_per_worker():
    out = run_distributed(_activation_bytes, 2)
    for sp1, sp2 in out:
        assert 0.40 < sp2 / sp1 < 0.62, (sp1, sp2)
