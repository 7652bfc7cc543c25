"""What Qwen3.5's decoder costs (``ray_disagg.models.costs`` hooks): the FLOPs of its
Gated DeltaNet ``"linear_attention"`` layers, which :func:`ray_disagg.models.flops.
decoder_flops` takes as ``linear_attention`` (the full-attention layers, the MLPs and
the ``lm_head`` it counts itself).

What is counted is what transformers' eager torch path runs on one unpadded sample in a
training forward (the fla and causal-conv1d kernels absent): the chunked rule
``torch_chunk_gated_delta_rule`` (the per-token ``torch_recurrent_gated_delta_rule`` runs
only when decoding one token against a cached state); matrix products only, 2 FLOPs per
multiply-add (:mod:`ray_disagg.models.flops`).

Training is ``3 x forward`` as everywhere. The backward that runs differs a little,
for two reasons not counted here (``tests/unit/test_flops.py``: 0.98-0.99 of
``FlopCounterMode``'s count on the tiny config, whose head dims of 8 make them large;
about 0.2-0.5% of a real layer):

- the chunked rule's two triangular solves count nothing forward (no matrix product)
  but their backward's ``grad_A = -grad_B X^T`` is one: ``2 C^2 (dk + dv)`` per chunk
  and value head, backward only;
- the first chunk reads the zero initial state (no gradient: one product each, not
  two) and the last chunk's state update feeds nothing (no backward): ``8 C dk dv``
  fewer per value head.

(``FlopCounterMode`` also counts a depthwise convolution's weight gradient ``groups``
times over, its formula ignoring ``groups``; the test counts it once.)
"""

from __future__ import annotations

import math

from ray_disagg.models.flops import linear

__all__ = ["CHUNK", "chunked_delta_rule_flops", "gated_deltanet_flops"]

CHUNK = 64
"""``torch_chunk_gated_delta_rule``'s ``chunk_size`` (the Gated DeltaNet calls it with
the default)."""


def chunked_delta_rule_flops(tokens: int, heads: int, dk: int, dv: int) -> float:
    """``torch_chunk_gated_delta_rule`` over ``tokens`` tokens: the sequence is padded to
    a multiple of :data:`CHUNK` (``C``) and every chunk of every value head (the query
    and key heads repeated to ``heads`` value heads) runs

    - ``k_beta K^T`` and ``Q K^T`` (``C x dk x C`` each: the UT system and the
      intra-chunk attention, both masked to the lower triangle by the decay);
    - two unit-triangular solves of the UT system (``new_values``, ``k_cumdecay``): no
      matrix product, not counted;
    - the scan: ``k_cumdecay S`` and ``Q S`` (``C x dk x dv``: reading the
      ``dk x dv`` state of the previous chunks), ``A v_new`` (``C x C x dv``: the
      intra-chunk attention applied to the corrected values) and ``K^T v_new``
      (``dk x C x dv``: the state update; the last chunk's too, though unused).
    """
    chunks = math.ceil(tokens / CHUNK)
    per_chunk = (
        2 * linear(CHUNK, dk, CHUNK)  # k_beta @ K^T, Q @ K^T
        + 3 * linear(CHUNK, dk, dv)  # k_cumdecay @ S, Q @ S, K^T @ v_new
        + linear(CHUNK, CHUNK, dv)  # A @ v_new
    )
    return chunks * heads * per_chunk


def gated_deltanet_flops(t, tokens: int) -> float:
    """Forward FLOPs of one Gated DeltaNet layer (``Qwen3_5GatedDeltaNet``, text config
    ``t``) over one sample of ``tokens`` tokens: the input projections ``in_proj_qkv``
    (to ``2 key_dim + value_dim``), ``in_proj_z`` (the output gate, ``value_dim``),
    ``in_proj_b`` and ``in_proj_a`` (one per value head each); the depthwise causal
    ``conv1d`` over the ``q, k, v`` channels (``kernel`` taps per channel, padded by
    ``kernel - 1`` on both sides, so ``tokens + kernel - 1`` outputs before the causal
    slice); the chunked delta rule (:func:`chunked_delta_rule_flops`); and
    ``out_proj``. The gated RMSNorm, the l2norms, the decays and the gates count
    nothing."""
    h, heads = t.hidden_size, t.linear_num_value_heads
    dk, dv = t.linear_key_head_dim, t.linear_value_head_dim
    key_dim, value_dim = t.linear_num_key_heads * dk, heads * dv
    channels, kernel = 2 * key_dim + value_dim, t.linear_conv_kernel_dim
    projections = linear(tokens, h, channels + value_dim + 2 * heads)
    projections += linear(tokens, value_dim, h)
    conv = 2.0 * (tokens + kernel - 1) * channels * kernel
    return projections + conv + chunked_delta_rule_flops(tokens, heads, dk, dv)
