"""Single-process training of the whole Hugging Face model: the numerical reference that
every parallel layout is tested against (and the baseline of the step-time benchmark)."""

from __future__ import annotations

import time

import torch

from ray_disagg.config import TrainLoopConfig
from ray_disagg.data import BatchPlan, collate_text, collate_vision, text_item
from ray_disagg.model import Qwen2_5_VLSpec


def reference_batch(samples, config) -> dict:
    items = [text_item(s, config.image_token_id) for s in samples]
    batch = collate_text(items, config.text_config.pad_token_id or 0)
    pixels, grid = collate_vision(samples)
    return {
        "input_ids": batch.input_ids,
        "attention_mask": batch.attention_mask,
        "labels": batch.labels,
        "pixel_values": pixels,
        "image_grid_thw": grid,
        "mm_token_type_ids": (batch.input_ids == config.image_token_id).int(),
    }


def reference_train(spec: Qwen2_5_VLSpec, dataset, cfg: TrainLoopConfig):
    """Train ``spec``'s full HF model for ``cfg.max_steps`` on the same global batches as
    ``DisaggregatedTrainer``; returns ``(losses, step_times_s, model)``."""
    model = spec.build_full()
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay
    )
    plan = BatchPlan(
        num_samples=len(dataset),
        global_batch_size=cfg.global_batch_size,
        vision_dp=1,
        text_dp=1,
        seed=cfg.seed,
        shuffle=cfg.shuffle,
    )
    losses, times = [], []
    for step in range(cfg.max_steps):
        t0 = time.perf_counter()
        batch = reference_batch([dataset[i] for i in plan.global_indices(step)], model.config)
        loss = model(**batch).loss
        loss.backward()
        if cfg.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
    return losses, times, model
