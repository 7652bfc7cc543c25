"""Single-process training of the whole Hugging Face model: the numerical reference that
every parallel layout is tested against (and the baseline of the step-time benchmark)."""

from __future__ import annotations

import time

import torch

from ray_disagg.config.freezing import is_frozen
from ray_disagg.config.loop import TrainLoopConfig
from ray_disagg.config.lr_schedule import lr_at
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


class _Updates:
    """AdamW over parameter groups (each with its LR multiplier ``mult``) on the run's
    global batches, with its clipping and learning-rate schedule."""

    def __init__(self, param_groups: list[dict], num_samples: int, cfg: TrainLoopConfig, plan=None):
        self.cfg, self.trained = cfg, [p for g in param_groups for p in g["params"]]
        self.opt = torch.optim.AdamW(
            param_groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay
        )
        self.plan = plan or BatchPlan(
            num_samples=num_samples,
            global_batch_size=cfg.global_batch_size,
            seed=cfg.seed,
            shuffle=cfg.shuffle,
        )

    def batch(self, dataset, step: int) -> list:
        return [dataset[i] for i in self.plan.global_indices(step)]

    def apply(self, step: int) -> None:
        """Clip, set the scheduled learning rate, step and zero the gradients."""
        if self.cfg.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.trained, self.cfg.max_grad_norm)
        for g in self.opt.param_groups:
            g["lr"] = lr_at(self.cfg, step, g["mult"])
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


@torch.no_grad()
def reference_val_loss(spec: HFModelSpec, model, dataset, cfg: TrainLoopConfig, plan=None) -> float:
    """Mean token loss over the label tokens of the validation batches (in order;
    ``plan``: the trainer's ``val_plan``, a token budget's)."""
    plan = plan or BatchPlan(num_samples=len(dataset), global_batch_size=cfg.global_batch_size)
    loss_sum = labels = 0.0
    for step in range(plan.steps_per_epoch):
        samples = [dataset[i] for i in plan.global_indices(step)]
        n = sum(count_label_tokens(spec.adapter.labels(s)) for s in samples)
        loss_sum += float(model(**reference_batch(spec, samples)).loss) * n
        labels += n
    return loss_sum / labels


def reference_train(
    spec: HFModelSpec, dataset, cfg: TrainLoopConfig, groups=None, val=None, plan=None,
    val_plan=None,
):  # fmt: skip
    """Train ``spec``'s full HF model (``...ForConditionalGeneration(..., labels=...)``)
    for ``cfg.max_steps`` on the same global batches as ``DisaggregatedTrainer``, with its
    learning-rate schedule and, given ``groups``, their freezing and LR multipliers;
    returns ``(losses, step_times_s, model)``, and with a validation set ``val`` also the
    ``val_loss`` after every step. ``plan`` / ``val_plan``: the trainer's
    (``trainer.plan`` / ``trainer.val_plan``), whose steps depend on the layout under a
    token budget (``max_tokens_per_microbatch``)."""
    model = spec.build_full()
    updates = _Updates(_param_groups(spec, model, groups), len(dataset), cfg, plan)
    losses, times, val_losses = [], [], []
    for step in range(cfg.max_steps):
        t0 = time.perf_counter()
        loss = model(**reference_batch(spec, updates.batch(dataset, step))).loss
        loss.backward()
        updates.apply(step)
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
        if val is not None:
            val_losses.append(reference_val_loss(spec, model, val, cfg, val_plan))
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
    updates = _Updates([{"params": trained, "mult": 1.0}], len(dataset), cfg)
    losses = []
    for step in range(cfg.max_steps):
        loss = model(**reference_batch(spec, updates.batch(dataset, step))).loss
        loss.backward()
        updates.apply(step)
        losses.append(loss.item())
    return losses, model


def _pair_logps(spec: HFModelSpec, model, pairs) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, 2)`` summed log-probabilities of the chosen and rejected answers' label
    tokens (full logits, ``log_softmax``, gathered), and ``(B, 2)`` label-token counts."""
    seqs = []
    for pair in pairs:
        rest = {k: v for k, v in pair.items() if not k.startswith(("chosen_", "rejected_"))}
        for a in ("chosen", "rejected"):
            seqs.append(
                {**rest, "input_ids": pair[f"{a}_input_ids"], "labels": pair[f"{a}_labels"]}
            )
    kwargs = reference_batch(spec, seqs)
    labels = kwargs.pop("labels")[:, 1:]
    logits = model(**kwargs).logits[:, :-1].float()
    mask = labels != -100
    per_token = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0).unsqueeze(-1))
    logps = (per_token.squeeze(-1) * mask).sum(-1)
    return logps.view(-1, 2), mask.sum(-1).float().view(-1, 2)


def reference_objective(
    spec: HFModelSpec,
    data,
    cfg: TrainLoopConfig,
    step_loss,
    groups=None,
    peft_model=None,
    peft_reference: str = "adapters_disabled",
    plan=None,
):
    """Single-process training of the whole HF model on an objective, on the same global
    batches as ``DisaggregatedTrainer``, against a frozen copy of its initial weights
    (the reference): ``step_loss(model, reference, step, batch) -> (loss, info)`` gives
    each step's loss, ``reference(fn)`` being ``fn(reference model)`` without gradients;
    AdamW with the run's schedule. ``peft_model``: train this ``PeftModel`` instead (its
    trainable parameters), the reference being the same model under PEFT's
    ``disable_adapter()`` or, with ``peft_reference="copy"``, a frozen copy of it;
    ``plan``: the trainer's (a token budget's steps, repeated batches). Returns
    ``(losses, [info per step], model)``."""
    import contextlib
    import copy

    if peft_model is None:
        model = spec.build_full()
        ref_model = copy.deepcopy(model).requires_grad_(False)
        param_groups, off = _param_groups(spec, model, groups), contextlib.nullcontext
    else:
        model = ref_model = peft_model
        trained = [p for p in model.parameters() if p.requires_grad]
        param_groups, off = [{"params": trained, "mult": 1.0}], model.disable_adapter
        if peft_reference == "copy":
            ref_model, off = copy.deepcopy(model).requires_grad_(False), contextlib.nullcontext

    def reference(fn):
        with torch.no_grad(), off():
            return fn(ref_model)

    updates = _Updates(param_groups, len(data), cfg, plan)
    losses, infos = [], []
    for step in range(cfg.max_steps):
        loss, info = step_loss(model, reference, step, updates.batch(data, step))
        loss.backward()
        updates.apply(step)
        losses.append(loss.item())
        infos.append(info)
    return losses, infos, model


def reference_preference(
    spec: HFModelSpec, pairs, cfg: TrainLoopConfig, pair_loss, groups=None, **kwargs
):
    """:func:`reference_objective` on preference pairs: ``pair_loss(policy, reference,
    tokens, pairs)`` (each ``(B, 2)``: chosen, rejected; the batch's pairs) gives the
    per-pair losses, whose mean is the step's loss. Returns ``(losses, [(policy,
    reference) log-probs per step], model)``."""

    def step_loss(model, reference, _step, batch):
        policy, tokens = _pair_logps(spec, model, batch)
        ref, _ = reference(lambda m: _pair_logps(spec, m, batch))
        return pair_loss(policy, ref, tokens, batch).mean(), (policy.detach(), ref)

    return reference_objective(spec, pairs, cfg, step_loss, groups, **kwargs)
