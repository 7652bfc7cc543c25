"""TRL's GRPO (``trl.GRPOTrainer``, f2cd577: ``_generate_and_score_completions``'s
advantages and metrics, ``_compute_loss``) written from its definitions on padded
``(completions, positions)`` tensors of the whole HF model, independently of
:mod:`ray_disagg.objectives`, as the single-process reference of the GRPO tests."""

import torch

from ray_disagg.testing.reference import reference_batch, reference_objective


def _nanstd(x, dim=None):
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=dim is not None)
    n = (~torch.isnan(x)).sum(dim=dim, keepdim=dim is not None)
    var = var * n / (n - 1)
    return torch.where(n > 1, var, torch.nan).sqrt()


def advantages_and_metrics(batch, opts: dict):
    """TRL's advantages (``sum_then_normalize``) of the batch's completions and its
    reward and length metrics."""
    g, names = opts["num_generations"], opts["names"]
    rows = [
        [[torch.nan if s["rewards"][n][i] is None else s["rewards"][n][i] for n in names]
         for i in range(g)]
        for s in batch
    ]  # fmt: skip
    per_func = torch.tensor(rows, dtype=torch.float32).view(-1, len(names))
    weights = torch.tensor(opts.get("reward_weights") or [1.0] * len(names))
    unscorable = torch.isnan(per_func).all(dim=1)
    rewards = (per_func * weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = torch.nan
    mean = torch.nanmean(rewards.view(-1, g), dim=1).repeat_interleave(g)
    scale = opts.get("scale_rewards", "group")
    if scale == "batch":
        std = _nanstd(rewards).expand_as(rewards)
    else:
        std = _nanstd(rewards.view(-1, g), dim=1).repeat_interleave(g)
    adv = rewards - mean
    if scale != "none":
        adv = adv / (std + 1e-4)
    adv = torch.nan_to_num(adv, nan=0.0)
    m = {"reward": torch.nanmean(rewards), "reward_std": _nanstd(rewards)}
    for i, n in enumerate(names):
        m[f"rewards/{n}/mean"] = torch.nanmean(per_func[:, i])
        m[f"rewards/{n}/std"] = _nanstd(per_func[:, i])
    m["frac_reward_zero_std"] = torch.isclose(std, torch.zeros_like(std)).float().mean()
    lengths = torch.tensor([len(c) for s in batch for c in s["completion_ids"]]).float()
    truncated = torch.tensor([t for s in batch for t in s["truncated"]])
    m["completions/mean_length"] = lengths.mean()
    m["completions/min_length"] = lengths.min()
    m["completions/max_length"] = lengths.max()
    m["completions/clipped_ratio"] = truncated.float().mean()
    term = lengths[~truncated] if (~truncated).any() else torch.zeros(1)
    m["completions/mean_terminated_length"] = term.mean()
    m["completions/min_terminated_length"] = term.min()
    m["completions/max_terminated_length"] = term.max()
    return adv, truncated, m


def per_token_logps(spec, model, batch, temperature):
    """``(completions, positions)`` log-probs of each completion token (logits divided by
    the temperature) and the completion mask."""
    seqs = []
    for s in batch:
        rollout = ("prompt_input_ids", "completion_ids", "rewards", "truncated")
        rest = {k: v for k, v in s.items() if k not in rollout}
        prompt = [int(t) for t in s["prompt_input_ids"]]
        for c in s["completion_ids"]:
            c = [int(t) for t in c]
            seqs.append({**rest, "input_ids": torch.tensor(prompt + c),
                         "labels": torch.tensor([-100] * len(prompt) + c)})  # fmt: skip
    kwargs = reference_batch(spec, seqs)
    labels = kwargs.pop("labels")[:, 1:]
    logits = model(**kwargs).logits[:, :-1].float() / temperature
    mask = labels != -100
    logps = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return logps * mask, mask.float()


def compute_loss(logps, old, ref, adv, mask, opts: dict):
    """TRL's ``_compute_loss`` on one process without accumulation: ``(loss, metrics)``."""
    eps, eps_high = opts.get("epsilon", 0.2), opts.get("epsilon_high") or opts.get("epsilon", 0.2)
    beta, adv = opts.get("beta", 0.0), adv.unsqueeze(1)
    log_ratio = logps - old
    if opts.get("importance_sampling_level", "token") == "sequence":
        log_w = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    else:
        log_w = log_ratio
    coef_1 = torch.exp(log_w)
    coef_2 = torch.clamp(coef_1, 1 - eps, 1 + eps_high)
    per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv)
    m = {}
    if beta != 0.0:
        kl = torch.exp(ref - logps) - (ref - logps) - 1
        per_token_loss = per_token_loss + beta * kl
        m["kl"] = (kl * mask).sum() / mask.sum().clamp(min=1.0)
    loss_type = opts.get("loss_type", "dapo")
    if loss_type == "grpo":
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "dr_grpo":
        loss = (per_token_loss * mask).sum() / (
            per_token_loss.size(0) * opts["max_completion_length"]
        )
    else:  # bnpo, dapo: one process, one accumulation step
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)

    def global_mean(x):
        if x.shape[1] == 1:
            return x.sum() / x.shape[0]
        return (x * mask).sum() / mask.sum().clamp(min=1.0)

    low = ((coef_1 < 1 - eps) & (adv < 0)).float()
    high = ((coef_1 > 1 + eps_high) & (adv > 0)).float()
    m["clip_ratio/low_mean"] = global_mean(low)
    m["clip_ratio/high_mean"] = global_mean(high)
    m["clip_ratio/region_mean"] = global_mean(torch.maximum(low, high))
    return loss, m


def sample_completions(spec, model, prompts, keys, opts: dict, stop_ids, greedy=False):
    """``(completions, truncated)``: ``num_generations`` per prompt, drawn one token at a
    time from a full forward of the single-process ``model`` over the prompt and the
    tokens so far (the media placeholders suppressed, HF's warpers in ``generate``'s
    order, then the argmax of the scores plus each completion's Gumbel noise at its
    position; ``keys`` one per completion); ``greedy``: one per prompt, the argmax."""
    from transformers.generation.logits_process import (
        SuppressTokensLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    from ray_disagg.rollout.sampling import gumbel_noise

    suppress = list(spec.adapter.placeholder_ids())  # media placeholders: never drawn
    warpers = [
        SuppressTokensLogitsProcessor(suppress),
        TemperatureLogitsWarper(opts.get("temperature", 1.0)),
    ]
    if opts.get("top_k"):
        warpers.append(TopKLogitsWarper(opts["top_k"]))
    if opts.get("top_p", 1.0) < 1.0:
        warpers.append(TopPLogitsWarper(opts["top_p"]))
    g, most = 1 if greedy else opts["num_generations"], opts["max_completion_length"]
    if greedy:
        warpers = warpers[:1]
    completions, truncated = [], []
    for i, p in enumerate(q for q in prompts for _ in range(g)):
        kwargs = spec.adapter.reference_inputs([p])
        kwargs.pop("labels")
        ids, drawn = kwargs.pop("input_ids"), []
        for step in range(most):
            types = (ids == spec.config.image_token_id).int()
            inputs = kwargs | {"attention_mask": torch.ones_like(ids), "mm_token_type_ids": types}
            with torch.no_grad():
                scores = model(input_ids=ids, **inputs).logits[:, -1].float()
            for w in warpers:
                scores = w(ids, scores)
            if not greedy:
                noise = gumbel_noise(keys[i : i + 1], torch.tensor([step]), 0, scores.shape[-1])
                scores = scores + noise
            token = int(torch.argmax(scores, -1))
            drawn.append(token)
            if token in stop_ids:
                break
            ids = torch.cat([ids, torch.tensor([[token]])], 1)
        completions.append(drawn)
        truncated.append(drawn[-1] not in stop_ids)
    return completions, truncated


def rollout_records(prompts, completions, truncated, funcs, decode, g):
    """The prompts with their completions and each reward function's values, called as
    TRL calls it (keywords ``prompts``, ``completions`` (text), ``completion_ids`` and the
    record's other columns, one per completion)."""
    import numpy as np

    rows = [p for p in prompts for _ in range(g)]
    columns = {k: [r[k] for r in rows] for k in ("id", "prompt", "solution") if k in rows[0]}
    texts = [decode(c) for c in completions]
    prompts_text = columns.pop("prompt", [None] * len(rows))
    values = {f.__name__: f(prompts=prompts_text, completions=texts, completion_ids=completions,
                            **columns) for f in funcs}  # fmt: skip
    out = []
    for k, p in enumerate(prompts):
        cut = slice(k * g, (k + 1) * g)
        out.append({**p, "prompt_input_ids": np.asarray(p["input_ids"]),
                    "completion_ids": [np.asarray(c) for c in completions[cut]],
                    "truncated": truncated[cut],
                    "rewards": {n: v[cut] for n, v in values.items()}})  # fmt: skip
    return out


def reference_grpo(spec, rollouts, cfg, opts: dict, plan, rollout=None, **kwargs):
    """Single-process GRPO with TRL's formulas on recorded rollouts (``opts``: the GRPO
    settings, ``names`` the reward functions'), or with ``rollout(model, step, prompts)``
    (the completed records) at the first of each batch's ``num_iterations`` steps; the old
    log-probs are a no-grad forward before the first of ``num_iterations`` steps on a
    batch (TRL's). Returns ``(losses, [metrics per step], model)``."""
    mu, temperature = opts.get("num_iterations", 1), opts.get("temperature", 1.0)
    kept = {}

    def step_loss(model, reference, step, batch):
        if rollout is not None:
            if step % mu == 0:
                kept["batch"] = rollout(model, step, batch)
            batch = kept["batch"]
        adv, truncated, metrics = advantages_and_metrics(batch, opts)
        logps, mask = per_token_logps(spec, model, batch, temperature)
        if opts.get("mask_truncated_completions"):
            mask = mask * (~truncated).unsqueeze(1).float()
        if step % mu == 0:
            with torch.no_grad():
                kept["old"] = per_token_logps(spec, model, batch, temperature)[0]
        ref = None
        if opts.get("beta", 0.0) != 0.0:
            ref = reference(lambda m: per_token_logps(spec, m, batch, temperature)[0])
        loss, loss_metrics = compute_loss(logps, kept["old"], ref, adv, mask, opts)
        metrics.update(loss_metrics)
        return loss, {k: float(v.detach()) for k, v in metrics.items()}

    return reference_objective(spec, rollouts, cfg, step_loss, plan=plan, **kwargs)
