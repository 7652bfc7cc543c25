"""Single-process training of the whole Hugging Face model: the numerical reference that
every parallel layout is tested against (and the baseline of the step-time benchmark)."""

from __future__ import annotations

import time

import torch

from ray_disagg.freezing import is_frozen
from ray_disagg.loop_config import TrainLoopConfig
from ray_disagg.lr_schedule import lr_at
from ray_disagg.model import HFModelSpec
from ray_disagg.pipeline.assignment import BatchPlan, count_label_tokens


def reference_batch(spec: HFModelSpec, samples) -> dict:
    """Keyword arguments of the HF model's forward (with ``labels``) for ``samples``."""
    return spec.adapter.reference_inputs(samples)


def _param_groups(spec: HFModelSpec, model, groups) -> list[dict]:
    """AdamW parameter groups by module group (for per-group LR multipliers), frozen
    parameters left out (``requires_grad=False``)."""
    adapter, out = spec.adapter, []
    for part in adapter.part_modules:
        group = (groups or {}).get(part)
        params = []
        for name, p in adapter.part_parameters(model, part):
            if group is not None and is_frozen(name, group):
                p.requires_grad_(False)
            elif p.requires_grad and all(p is not q for q in params):
                params.append(p)
        mult = group.lr_multiplier if group is not None else 1.0
        if params:
            out.append({"params": params, "mult": mult})
    return out


@torch.no_grad()
def reference_val_loss(spec: HFModelSpec, model, dataset, cfg: TrainLoopConfig) -> float:
    """Mean token loss over the label tokens of the validation batches (in order)."""
    plan = BatchPlan(num_samples=len(dataset), global_batch_size=cfg.global_batch_size)
    loss_sum = labels = 0.0
    for step in range(plan.steps_per_epoch):
        samples = [dataset[i] for i in plan.global_indices(step)]
        n = sum(count_label_tokens(spec.adapter.labels(s)) for s in samples)
        loss_sum += float(model(**reference_batch(spec, samples)).loss) * n
        labels += n
    return loss_sum / labels


def reference_train(spec: HFModelSpec, dataset, cfg: TrainLoopConfig, groups=None, val=None):
    """Train ``spec``'s full HF model (``...ForConditionalGeneration(..., labels=...)``)
    for ``cfg.max_steps`` on the same global batches as ``DisaggregatedTrainer``, with its
    learning-rate schedule and, given ``groups``, their freezing and LR multipliers;
    returns ``(losses, step_times_s, model)``, and with a validation set ``val`` also the
    ``val_loss`` after every step."""
    model = spec.build_full()
    param_groups = _param_groups(spec, model, groups)
    opt = torch.optim.AdamW(
        param_groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay
    )
    trained = [p for g in param_groups for p in g["params"]]
    plan = BatchPlan(
        num_samples=len(dataset),
        global_batch_size=cfg.global_batch_size,
        seed=cfg.seed,
        shuffle=cfg.shuffle,
    )
    losses, times, val_losses = [], [], []
    for step in range(cfg.max_steps):
        t0 = time.perf_counter()
        batch = reference_batch(spec, [dataset[i] for i in plan.global_indices(step)])
        loss = model(**batch).loss
        loss.backward()
        if cfg.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(trained, cfg.max_grad_norm)
        for g in opt.param_groups:
            g["lr"] = lr_at(cfg, step, g["mult"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
        if val is not None:
            val_losses.append(reference_val_loss(spec, model, val, cfg))
    if val is not None:
        return losses, times, model, val_losses
    return losses, times, model


def reference_train_peft(spec: HFModelSpec, adapter_dir: str, dataset, cfg: TrainLoopConfig):
    """:func:`reference_train` of Hugging Face + PEFT: the whole HF model with the saved
    adapter in ``adapter_dir`` (``PeftModel.from_pretrained(..., is_trainable=True)``:
    its factors and ``modules_to_save`` trained, the rest frozen), AdamW over the trainable
    parameters; returns ``(losses, peft_model)``."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(spec.build_full(), adapter_dir, is_trainable=True)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        trained, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay
    )
    plan = BatchPlan(
        num_samples=len(dataset),
        global_batch_size=cfg.global_batch_size,
        seed=cfg.seed,
        shuffle=cfg.shuffle,
    )
    losses = []
    for step in range(cfg.max_steps):
        loss = model(**reference_batch(spec, [dataset[i] for i in plan.global_indices(step)])).loss
        loss.backward()
        if cfg.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(trained, cfg.max_grad_norm)
        for g in opt.param_groups:
            g["lr"] = lr_at(cfg, step, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, model
