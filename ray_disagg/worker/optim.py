"""A group's optimizer (AdamW, ZeRO-1 optionally) and what a step does to it: the
scheduled learning rate, the clip coefficient, the scaled gradients."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ray_disagg.config.lr_schedule import lr_at

__all__ = ["NoOptimizer", "build_optimizer", "clip_coef", "scale_grads", "set_lr"]


class NoOptimizer:
    """The optimizer of a group with nothing to train (every parameter frozen)."""

    state: dict = {}
    param_groups: list = []

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg, zero1: bool):
    """AdamW; with ``zero1`` its state is sharded over the default (whole group's) process
    group by ``ZeroRedundancyOptimizer`` (each rank updates its shard, then broadcasts).
    No trainable parameter: :class:`NoOptimizer`. The learning rate is set every step
    (:func:`set_lr`)."""
    params = list(params)
    if not params:
        return NoOptimizer()
    kwargs = {"lr": cfg.lr, "betas": cfg.betas, "eps": cfg.eps, "weight_decay": cfg.weight_decay}
    if zero1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, **kwargs)
    if _mixed_kinds(params):  # foreach kernels reject plain tensors next to DTensors
        kwargs["foreach"] = False
    return torch.optim.AdamW(params, **kwargs)


def _mixed_kinds(params) -> bool:
    """Plain tensors next to DTensors (TP's replicated norms, expert-parallel experts
    next to data-parallel weights): CUDA's default foreach AdamW refuses the mix."""
    from torch.distributed.tensor import DTensor

    return len({isinstance(p, DTensor) for p in params}) > 1


def set_lr(optimizer, cfg, step: int, multiplier: float) -> float:
    """The scheduled learning rate of ``step`` times the group's multiplier, set on every
    parameter group (ZeRO-1 copies it into its local optimizer on ``step()``)."""
    lr = lr_at(cfg, step, multiplier)
    for g in optimizer.param_groups:
        g["lr"] = lr
    return lr


def clip_coef(total_norm: float, max_norm: float | None) -> float:
    """``torch.nn.utils.clip_grad_norm_``'s coefficient, clamped to 1."""
    if max_norm is None:
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))


@torch.no_grad()
def scale_grads(params: Iterable[torch.nn.Parameter], coef: float) -> None:
    if coef < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
