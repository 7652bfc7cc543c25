"""The planner's memory model (see :mod:`ray_disagg.recipes.cost`): a worker's bytes
over the idle baseline are its training state (parameters, gradients, AdamW; from
:func:`ray_disagg.recipes.estimate.estimate`), the calibrated fixed bytes, and the larger
of the activations (the estimate's, times the calibrated scale) and the buffers that
live after backward (data-parallel bucket, FSDP2's unsharded units)."""

from __future__ import annotations

import dataclasses
import re

from ray_disagg.recipes.cluster import Cluster, DeviceFigures

__all__ = ["memory_per_worker", "worker_terms"]


def _depth(v) -> int:
    """Blocks of a tower (Qwen's ``depth``, SigLIP's / InternViT's ``num_hidden_layers``)."""
    return getattr(v, "depth", None) or getattr(v, "num_hidden_layers", 1)


def memory_per_worker(r, c: Cluster, f: DeviceFigures) -> tuple[dict, dict]:
    """Per group, one worker's bytes; per device (group, ``bundle`` colocated, ``node``
    for CPU workers) the bytes it holds."""
    llm = r.model.adapter.llm_part
    memory = {}
    for p in r.groups:
        state, extra, act = worker_terms(r, p)
        fixed, scale = f.memory_fit.get("llm" if p == llm else "encoder", (0.0, 1.0))
        memory[p] = state + fixed + max(scale * act * _held(r, p), extra)
    if not c.gpu:
        total = sum(memory[p] * g.num_workers for p, g in r.groups.items())
        return memory, {"node": total / c.nodes}
    if r.placement == "colocated":
        return memory, {"bundle": sum(memory.values())}
    return memory, dict(memory)


def _held(r, part: str) -> float:
    """Microbatches of activations a tower holds at its peak, over the estimate's count:
    under 1F1B one more than the schedule keeps in flight (measured: its backward's
    temporaries while the next forwards wait), at most every microbatch."""
    from ray_disagg.recipes.estimate import _schedule

    if part == r.model.adapter.llm_part:
        return 1.0
    sched = _schedule(r)
    if sched.schedule != "1f1b":
        return 1.0
    return min(sched.max_in_flight + 1, r.loop.micro_batches) / sched.max_in_flight


def worker_terms(r, part: str) -> tuple[float, float, float]:
    """Bytes of one worker of ``part``: ``(training state, DP/FSDP2 buffers, estimated
    activations)`` (cached on the model per group setting: the planner asks for
    thousands of layouts)."""
    from ray_disagg.recipes.estimate import estimate

    g, loop = r.groups[part], r.loop
    key = (part, g.num_workers, g.parallelism, g.activation_checkpointing, g.trainable,
           g.freeze, loop.micro_batches, loop.bf16, loop.param_dtype, r.placement,
           loop.schedule, loop.max_in_flight)  # fmt: skip
    cache = getattr(r.model, "memory_cache", None)
    if cache is not None and key in cache:
        return cache[key]
    m = estimate(dataclasses.replace(r, groups={part: g}))[part]
    out = (m.params + m.grads + m.optimizer, _buffers(r, part, m), m.activations or 0.0)
    if cache is not None:
        cache[key] = out
    return out


def _buffers(r, part: str, m) -> float:
    """The data-parallel all-reduce's flat bucket and gloo's copy (<= 64 MiB each);
    FSDP2's unsharded largest units (embedding, lm_head, one layer) and their grads."""
    g = r.groups[part]
    if not g.trainable or g.dp_size == 1:
        return 0.0
    if not g.fsdp:
        return 2 * min(m.grads, 64 * 2**20)
    p_bytes = 2 if r.loop.param_dtype == "bfloat16" else 4
    units = _largest_units(r, part)
    return 2 * units * p_bytes


def _largest_units(r, part: str) -> float:
    """Parameters of the embedding, the lm_head and one block of ``part`` (whole)."""
    cache = getattr(r.model, "memory_cache", {})
    key = ("units", part)
    if key not in cache:
        sizes: dict[str, float] = {}
        for name, p in r.model.meta_model(part).named_parameters():
            unit = re.sub(r"(\.(layers|blocks)\.)\d+\..*", r"\1", name)
            unit = unit if unit != name else name.split(".")[-2]
            sizes[unit] = sizes.get(unit, 0.0) + p.numel()
        blocks = [n for u, n in sizes.items() if u.endswith((".layers.", ".blocks."))]
        per_block = max(blocks) / _count_blocks(r, part) if blocks else 0.0
        rest = sorted((n for u, n in sizes.items() if not u.endswith((".layers.", ".blocks."))))
        cache[key] = per_block + sum(rest[-2:])
    return cache[key]


def _count_blocks(r, part: str) -> int:
    cfg = r.model.load_config()
    if part == r.model.adapter.llm_part:
        return cfg.text_config.num_hidden_layers
    v = getattr(cfg, "vision_config", None)
    return _depth(v) if v is not None else 1
