"""Model FLOPs of one sample in one part (the numerator of MFU), counted from the config
and the sample's shapes, the way every family answers :meth:`CostHooks.sample_flops
<ray_disagg.models.costs.CostHooks.sample_flops>`.

Counting conventions (what ``torch.utils.flop_counter.FlopCounterMode`` reports for the
single-process HF model run with ``attn_implementation="eager"`` and eager experts, one
unpadded sample per row, no activation checkpointing; ``tests/unit/test_flops.py`` checks
every family within 5%: all agree exactly but Qwen3.5, whose Gated DeltaNet's backward
differs slightly, see ``ray_disagg.models.qwen3_5.costs``):

- matrix products only: ``nn.Linear``, convolutions, and attention's two batched products
  (``Q K^T`` and ``P V``), 2 FLOPs per multiply-add; norms, activations, softmax, rotary,
  gathers (embeddings), interpolation and pooling count nothing;
- backward is twice the forward (input and weight gradients), except a layer whose input
  is data (a tower's patch or mel embedding), whose backward computes the weight gradient
  only, and layers whose output reaches no loss (blocks after a tower's feature layer, a
  pooling head nobody reads), which run no backward:
  ``training = 3 x forward - data_input - 2 x no_backward``;
- attention over each sequence's real length, the whole ``s x s`` square (each image,
  frame, window, tile or sample; not halved for causality, as PaLM's MFU counts it); a
  padded row's padding is not counted;
- the ``lm_head`` at the label positions only, as the loss computes it;
- mixture of experts: the router and the ``top_k`` chosen experts of every token (plus a
  shared expert and its gate);
- model FLOPs, not hardware FLOPs: activation checkpointing's recomputation is not counted,
  and a LoRA or partly frozen part counts its whole backward; a part that trains nothing
  runs forward only, or forward and input gradients when gradients pass through it
  (:func:`step_flops`).

Example:
    >>> from ray_disagg.models.flops import Flops, linear
    >>> patch_embed = Flops(forward=linear(64, 1176, 32), data_input=linear(64, 1176, 32))
    >>> block = Flops(forward=linear(64, 32, 96))
    >>> (patch_embed + block).training == 2 * linear(64, 1176, 32) + 3 * linear(64, 32, 96)
    True
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "Flops",
    "attention",
    "decoder_flops",
    "head_dim",
    "linear",
    "step_flops",
]


@dataclass(frozen=True)
class Flops:
    """FLOPs of one forward and how much of it had data as input (see the module)."""

    forward: float = 0.0
    """Matrix-product FLOPs of the forward."""
    data_input: float = 0.0
    """The part of ``forward`` done by layers whose input is data (no input gradient)."""
    no_backward: float = 0.0
    """The part of ``forward`` whose output reaches no loss (no backward at all)."""

    def __add__(self, other: Flops) -> Flops:
        return Flops(
            self.forward + other.forward,
            self.data_input + other.data_input,
            self.no_backward + other.no_backward,
        )

    @property
    def training(self) -> float:
        """Forward and backward: ``3 x forward - data_input - 2 x no_backward``."""
        return 3.0 * self.forward - self.data_input - 2.0 * self.no_backward


def step_flops(flops: Flops, backward: bool, trains: bool = True) -> float:
    """FLOPs a part runs for ``flops``: forward only without a ``backward`` (an encoder
    with ``trainable=False`` runs under ``no_grad``); forward and the input gradients
    when it ``trains`` nothing but passes gradients on (a frozen LLM before a trained
    encoder: ``2 x forward - data_input - no_backward``); else :attr:`Flops.training`."""
    if not backward:
        return flops.forward
    if not trains:
        return 2.0 * flops.forward - flops.data_input - flops.no_backward
    return flops.training


def linear(rows: float, d_in: float, d_out: float) -> float:
    """A ``d_in -> d_out`` product over ``rows`` rows."""
    return 2.0 * rows * d_in * d_out


def attention(lengths: Iterable[float], width: float) -> float:
    """Attention's ``Q K^T`` and ``P V`` over sequences of ``lengths`` tokens, ``width`` =
    heads x head dim of the queries: ``4 s^2 width`` each."""
    return sum(4.0 * float(n) * float(n) * width for n in lengths)


def head_dim(c) -> int:
    """A config's attention head dim (``head_dim`` or ``hidden_size / heads``)."""
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def _is_moe(t, layer: int) -> bool:
    """Whether decoder layer ``layer`` of text config ``t`` has a sparse MLP (HF's rule:
    ``num_experts``, ``mlp_only_layers``, ``decoder_sparse_step``)."""
    if not getattr(t, "num_experts", None):
        return False
    if layer in (getattr(t, "mlp_only_layers", None) or ()):
        return False
    step = getattr(t, "decoder_sparse_step", None) or 1
    return (layer + 1) % step == 0


def _mlp_per_token(t, layer: int) -> float:
    """FLOPs per token of decoder layer ``layer``'s MLP: a gated dense MLP, or the router,
    the ``top_k`` experts' gated MLPs and a shared expert with its scalar gate."""
    h = t.hidden_size
    if not _is_moe(t, layer):
        return linear(1, h, 3 * t.intermediate_size)
    flops = linear(1, h, t.num_experts) + t.num_experts_per_tok * linear(
        1, h, 3 * t.moe_intermediate_size
    )
    shared = getattr(t, "shared_expert_intermediate_size", None)
    if shared:
        flops += linear(1, h, 3 * shared) + linear(1, h, 1)
    return flops


def _full_attention_per_token(t, gated_query: bool) -> float:
    """Projections of a softmax-attention layer per token (``gated_query``: ``q_proj``
    also makes an output gate, twice as wide: Qwen3.5)."""
    h, d = t.hidden_size, head_dim(t)
    q, kv = t.num_attention_heads * d, t.num_key_value_heads * d
    return linear(1, h, (2 if gated_query else 1) * q + 2 * kv) + linear(1, q, h)


def decoder_flops(
    t, tokens: int, labels: int, linear_attention=None, gated_query: bool = False
) -> Flops:
    """A decoder (text config ``t``) over one sample of ``tokens`` tokens whose loss has
    ``labels`` label positions: per layer its projections and MLP per token, softmax
    attention over the sample, and the ``lm_head`` at the labels. ``linear_attention``:
    ``f(t, tokens) -> FLOPs`` of one ``"linear_attention"`` layer (Qwen3.5's Gated
    DeltaNet), required when ``t.layer_types`` has such layers; ``gated_query``: see
    :func:`_full_attention_per_token`."""
    n = t.num_hidden_layers
    kinds = getattr(t, "layer_types", None) or ["full_attention"] * n
    flops = linear(labels, t.hidden_size, t.vocab_size)
    for layer, kind in enumerate(kinds[:n]):
        flops += tokens * _mlp_per_token(t, layer)
        if kind == "linear_attention":
            if linear_attention is None:
                raise NotImplementedError("linear attention layers need their FLOP count")
            flops += linear_attention(t, tokens)
        else:
            flops += tokens * _full_attention_per_token(t, gated_query)
            flops += attention([tokens], t.num_attention_heads * head_dim(t))
    return Flops(forward=flops)
