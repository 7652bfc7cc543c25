"""Mixture-of-experts pieces the MoE families share: the router's auxiliary
(load-balancing) loss over the global batch.

HF's ``load_balancing_loss_func`` is ``E * sum_e (C_e / R) * (P_e / R)``: ``C_e`` how
often expert ``e`` is in a token's top-k, ``P_e`` the summed router probabilities of
``e`` and ``R`` the token rows, each summed over every MoE layer and every real token of
the batch (attention-mask weighted). It is a product of batch sums, so it does not add up
over microbatches or replicas. Here each rank adds ``E * sum_e C_e * P_e_local / R**2``
with ``C`` and ``R`` all-reduced over the ranks that hold different tokens: ``C`` and
``R`` carry no gradient, so the ranks' terms sum to HF's loss and their gradients to its
gradient. That needs every token's routing before any backward: one microbatch per step
(:func:`check_micro_batches`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = [
    "ExpertLoad",
    "RouterSpec",
    "check_micro_batches",
    "router_aux_loss",
    "router_spec",
    "routing_sums",
]


@dataclass(frozen=True)
class RouterSpec:
    """What the auxiliary loss needs from the text config."""

    num_experts: int
    top_k: int
    coef: float
    """``router_aux_loss_coef``: the loss adds ``coef * aux``."""


def router_spec(text_config) -> RouterSpec | None:
    """The router's auxiliary-loss settings, or ``None`` when HF would not add it
    (``output_router_logits`` is false, HF's default, or the model is dense)."""
    if not getattr(text_config, "output_router_logits", False):
        return None
    return RouterSpec(
        num_experts=text_config.num_experts,
        top_k=text_config.num_experts_per_tok,
        coef=float(text_config.router_aux_loss_coef),
    )


def check_micro_batches(spec: RouterSpec | None, micro_batches: int, model_type: str) -> None:
    """``ValueError`` when the auxiliary loss cannot be exact: with several microbatches
    the routing counts of later microbatches are unknown at the first one's backward."""
    if spec is not None and micro_batches > 1:
        raise ValueError(
            f"train_loop_config['micro_batches']={micro_batches}: {model_type}'s router "
            "auxiliary loss (output_router_logits=True) is a product of sums over the whole "
            "global batch, so it is exact only with micro_batches=1 (every token routed "
            "before any backward). Use micro_batches=1, or set "
            "text_config.output_router_logits=False to train without it."
        )


def routing_sums(router_logits, spec: RouterSpec, mask: torch.Tensor | None):
    """``(counts, probs, rows)`` of this rank's tokens, summed over layers: per-expert
    top-k counts ``(E,)`` (no gradient), per-expert probability sums ``(E,)`` and token
    rows ``(1,)``; ``mask`` ``(B, T)`` weighs each token (1 real, 0 padding)."""
    device = router_logits[0].device
    counts = torch.zeros(spec.num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(spec.num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros(1, dtype=torch.float32, device=device)
    weight = None if mask is None else mask.reshape(-1).to(device, torch.float32)
    for logits in router_logits:
        p = torch.softmax(logits.float(), dim=-1)
        chosen = torch.topk(p.detach(), spec.top_k, dim=-1).indices
        w = torch.ones(p.shape[0], device=device) if weight is None else weight
        counts = counts.scatter_add(0, chosen.reshape(-1), w.repeat_interleave(spec.top_k))
        probs = probs + (p * w[:, None]).sum(0)
        rows = rows + w.sum()
    return counts, probs, rows


def router_aux_loss(router_logits, spec: RouterSpec, mask=None, group=None) -> torch.Tensor:
    """This rank's share of ``coef * aux`` (see the module docstring); ``group``: the
    ranks holding different tokens of the global batch (``None``: this rank holds all)."""
    counts, probs, rows = routing_sums(router_logits, spec, mask)
    shared = torch.cat([counts, rows])
    if group is not None:  # device tensors: no host sync
        dist.all_reduce(shared, group=group)
    counts, rows = shared[:-1], shared[-1]
    return spec.coef * spec.num_experts * (counts * probs).sum() / rows**2


def _is_router(module) -> bool:
    """HF's top-k routers (``...TopKRouter``: ``weight`` ``(E, H)``, ``top_k``)."""
    return hasattr(module, "top_k") and hasattr(module, "num_experts") and hasattr(module, "weight")


class ExpertLoad:
    """How evenly each MoE layer's routers spread the tokens over the experts in a step:
    forward hooks on the routers count every token's top-k choices (on the device)
    while :attr:`active`, so recomputation (activation checkpointing) is not counted.

    Example:
        >>> import torch
        >>> from ray_disagg import HFModelSpec, tiny_qwen3_vl_moe_config
        >>> text = HFModelSpec(config=tiny_qwen3_vl_moe_config()).build_part("text")
        >>> load = ExpertLoad(text.model.language_model)
        >>> load.active = True
        >>> _ = text.model.language_model(input_ids=torch.tensor([[1, 2, 3, 4]]))
        >>> sorted(load.take())
        ['expert_load_max', 'expert_load_mean']
    """

    def __init__(self, decoder):
        self.routers = [m for m in decoder.modules() if _is_router(m)]
        self.num_experts = self.routers[0].num_experts if self.routers else 0
        self.counts: torch.Tensor | None = None
        self.active = False
        for i, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(i))

    def _hook(self, layer: int):
        def count(module, _args, out):
            if not self.active:
                return
            if self.counts is None:
                self.counts = self._zeros(out[2].device)
            chosen = out[2].reshape(-1)  # scatter_add_: bincount would sync (its max)
            self.counts[layer].scatter_add_(0, chosen, torch.ones_like(chosen, dtype=torch.float32))

        return count

    def _zeros(self, device) -> torch.Tensor:
        return torch.zeros((len(self.routers), self.num_experts), device=device)

    def reset(self) -> None:
        """Forget the counts so far (a step that was abandoned)."""
        self.counts = None

    def take(self, group=None, device=None) -> dict[str, float]:
        """``expert_load_max`` / ``_mean``: over the MoE layers, the most loaded expert's
        tokens over the mean expert's (1.0: perfectly even), counted over the ranks of
        ``group`` (collective: every rank calls it once a step); resets the counts."""
        counts, self.counts = self.counts, None
        if counts is None:  # no forward this step: the same shape for the all-reduce
            counts = self._zeros(device)
        if group is not None:
            dist.all_reduce(counts, group=group)
        per_layer = counts.max(1).values / counts.mean(1).clamp_min(1e-12)
        top, mean = torch.stack([per_layer.max(), per_layer.mean()]).tolist()
        return {"expert_load_max": top, "expert_load_mean": mean}
