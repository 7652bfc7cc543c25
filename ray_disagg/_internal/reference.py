"""Single-process training of the whole Hugging Face model: the numerical reference that
every parallel layout is tested against (and the baseline of the step-time benchmark)."""

from __future__ import annotations

import time

import torch

from ray_disagg.config import TrainLoopConfig
from ray_disagg.data import BatchPlan
from ray_disagg.model import HFModelSpec


def reference_batch(spec: HFModelSpec, samples) -> dict:
    """Keyword arguments of the HF model's forward (with ``labels``) for ``samples``."""
    return spec.adapter.reference_inputs(samples)


def reference_train(spec: HFModelSpec, dataset, cfg: TrainLoopConfig):
    """Train ``spec``'s full HF model (``...ForConditionalGeneration(..., labels=...)``)
    for ``cfg.max_steps`` on the same global batches as ``DisaggregatedTrainer``; returns
    ``(losses, step_times_s, model)``."""
    model = spec.build_full()
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay
    )
    plan = BatchPlan(
        num_samples=len(dataset),
        global_batch_size=cfg.global_batch_size,
        seed=cfg.seed,
        shuffle=cfg.shuffle,
    )
    losses, times = [], []
    for step in range(cfg.max_steps):
        t0 = time.perf_counter()
        batch = reference_batch(spec, [dataset[i] for i in plan.global_indices(step)])
        loss = model(**batch).loss
        loss.backward()
        if cfg.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
    return losses, times, model
