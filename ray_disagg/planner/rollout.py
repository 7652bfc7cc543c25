"""What GRPO's rollouts on the training groups add to a step's estimate (an objective
that generates: ``GRPO`` unless ``rollouts="recorded"``).

- **The update** (of any GRPO, generated or recorded) trains ``num_generations``
  sequences per prompt, each the prompt and a completion of at most
  ``max_completion_length`` tokens (counted at that length).
- **Memory**: while a microbatch's completions are drawn, the LLM worker holds their KV
  cache, ``rows x (prompt + max_completion_length)`` tokens of K and V in every layer
  (its tensor-parallel share of the heads), and the last position's logits; the peak is
  the larger of that and the update's activations (the rollout runs before the update,
  on the same model: no second copy).
- **Time** before the update: the encoders' forward of each prompt's media, the
  prefill (a forward of every row's prompt) and ``max_completion_length`` decode steps,
  each at least one read of the worker's weights from memory (decoding is bound by
  memory bandwidth at small batches) or its rows' FLOPs, plus under FSDP2 the all-gather
  of the parameters and under TP two all-reduces per layer, per token.
"""

from __future__ import annotations

__all__ = ["decode_seconds", "generating", "kv_cache_bytes", "update_tokens"]


def generating(r):
    """The recipe's objective when it generates its completions, else ``None``."""
    obj = r.loop.objective
    if obj is None or getattr(obj, "rollouts", "recorded") == "recorded":
        return None
    return obj


def update_tokens(r, tokens: float) -> float:
    """LLM tokens one sample trains: its ``tokens``, or a GRPO prompt's (``tokens``) with
    each of its completions at full length (generated or recorded)."""
    obj = r.loop.objective
    if getattr(obj, "num_generations", None) is None:
        return tokens
    return obj.num_generations * (tokens + obj.max_completion_length)


def kv_cache_bytes(r, prompts: float, prompt_tokens: float, tp: int, a: int) -> float:
    """Bytes of the KV cache and last logits of ``prompts`` prompts' completions on one
    LLM worker (``tp``: its tensor-parallel degree, ``a``: bytes per element)."""
    obj = generating(r)
    if obj is None:
        return 0.0
    t = r.model.load_config().text_config
    rows = prompts * obj.num_generations
    head = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
    tokens = prompt_tokens + obj.max_completion_length
    kv = rows * tokens * t.num_hidden_layers * 2 * t.num_key_value_heads * head * a
    return (kv + rows * t.vocab_size * 4) / tp


def decode_seconds(
    r, rows: float, weight_bytes: float, flops_per_row: float, speed: float, memory_bw: float,
    per_token_comm: float,
) -> float:  # fmt: skip
    """Seconds of a generating objective's ``max_completion_length`` decode steps on one
    LLM worker: each reads ``weight_bytes`` at ``memory_bw`` or computes its ``rows``
    (``flops_per_row`` each at ``speed``), whichever is longer, plus ``per_token_comm``."""
    obj = generating(r)
    if obj is None:
        return 0.0
    step = max(weight_bytes / memory_bw, rows * flops_per_row / speed)
    return obj.max_completion_length * (step + per_token_comm)
