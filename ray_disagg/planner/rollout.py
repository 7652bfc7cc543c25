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
- **Time** before the update, on the first of each batch's ``num_iterations`` steps
  (averaged over them): the encoders' forward of each prompt's media, the prefill (a
  forward of every row's prompt) and, per microbatch, ``max_completion_length`` decode
  steps, each at least one read of the worker's weights from memory (decoding is bound
  by memory bandwidth at small batches) or its rows' FLOPs, plus under FSDP2 the
  all-gather of the parameters and under TP two all-reduces per layer, per token.
- The prompt's tokens: the recipe's ``plan.seq_len``, else ``max_seq_len`` less
  ``max_completion_length`` (a packed row holds both).
"""

from __future__ import annotations

__all__ = [
    "decode_seconds",
    "generating",
    "kv_cache_bytes",
    "prompt_tokens",
    "reference_mode",
    "update_sequences",
]


def generating(r):
    """The recipe's objective when it generates its completions, else ``None``."""
    obj = r.loop.objective
    if obj is None or getattr(obj, "rollouts", "recorded") == "recorded":
        return None
    return obj


def prompt_tokens(r, tokens: float) -> float:
    """A GRPO prompt's tokens out of the estimate's sequence length ``tokens``: the
    recipe's ``plan.seq_len`` is the prompt's; ``max_seq_len`` (a packed row) holds the
    prompt and its completion."""
    obj = r.loop.objective
    if getattr(obj, "num_generations", None) is None or r.plan.get("seq_len") is not None:
        return tokens
    if r.loop.max_seq_len is not None:
        return max(1, r.loop.max_seq_len - obj.max_completion_length)
    return tokens


def update_sequences(r, tokens: float) -> tuple[int, float]:
    """``(sequences, tokens of each)`` one sample trains on the LLM: one of ``tokens``, a
    preference pair's two (DPO: chosen and rejected, each ``tokens``), or a GRPO prompt's
    ``num_generations``, each the prompt and a completion at full length (generated or
    recorded)."""
    obj = r.loop.objective
    if getattr(obj, "num_generations", None) is None:
        return getattr(obj, "sequences_per_sample", 1), tokens
    return obj.num_generations, prompt_tokens(r, tokens) + obj.max_completion_length


def reference_mode(r) -> str | None:
    """How the objective holds its reference model (``DPO.reference`` as the trainer
    decides ``"auto"``: ``"copy"``, ``"adapters_disabled"`` or ``"precompute"``), ``None``
    without one. A ``"copy"`` holds a frozen copy of each trained part's parameters
    (sharded as the part, no gradients or optimizer state); it and
    ``"adapters_disabled"`` add a forward of each trained part per microbatch."""
    obj = r.loop.objective
    if obj is None or not obj.needs_reference:
        return None
    if obj.reference == "auto":
        layout = getattr(r, "layout", None)
        return layout.loop.objective.reference if layout is not None else "copy"
    return obj.reference


def kv_cache_bytes(r, prompts: float, tokens: float, tp: int, a: int) -> float:
    """Bytes of the KV cache and last logits of ``prompts`` prompts' completions on one
    LLM worker (``tokens``: the estimate's sequence length, :func:`prompt_tokens`;
    ``tp``: its tensor-parallel degree, ``a``: bytes per element)."""
    obj = generating(r)
    if obj is None:
        return 0.0
    t = r.model.load_config().text_config
    rows = prompts * obj.num_generations
    head = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
    length = prompt_tokens(r, tokens) + obj.max_completion_length
    kv = rows * length * t.num_hidden_layers * 2 * t.num_key_value_heads * head * a
    return (kv + rows * t.vocab_size * 4) / tp


def decode_seconds(
    r, rows: float, weight_bytes: float, flops_per_row: float, speed: float, memory_bw: float,
    per_token_comm: float,
) -> float:  # fmt: skip
    """Seconds of a generating objective's decode steps on one LLM worker per step: each
    microbatch (``rows`` rows) draws up to ``max_completion_length`` tokens, each step
    reading ``weight_bytes`` at ``memory_bw`` or computing its rows (``flops_per_row``
    each at ``speed``), whichever is longer, plus ``per_token_comm``; averaged over a
    batch's ``num_iterations`` steps (only the first generates)."""
    obj = generating(r)
    if obj is None:
        return 0.0
    k = r.loop.micro_batches
    step = max(weight_bytes / memory_bw, rows / k * flops_per_row / speed)
    return k * obj.max_completion_length * (step + per_token_comm) / obj.num_iterations
