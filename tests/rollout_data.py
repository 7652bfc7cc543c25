"""Prompt records for the tests of GRPO's generated rollouts."""

from ray_disagg.data.examples import synthetic_prompts

GRIDS = [(1, 4, 4), (1, 8, 4), None, (1, 4, 8)]


def prompts_of(cfg, n: int, seed: int = 1) -> list[dict]:
    """Synthetic prompts with images of varied sizes and a text-only one."""
    return synthetic_prompts(cfg, n, seed=seed, grids=GRIDS)
