"""The planner's cost model: one step's time and each worker's memory for a layout.

Per step, for a recipe ``r`` (one candidate layout) on a :class:`Cluster` with
:class:`DeviceFigures` ``f``:

- **compute** per part: FLOPs / (workers x ``f.flops[dtype]``). The LLM does
  ``2 N T`` per forward (``N`` the parameters a token passes, experts counted ``k / E``,
  plus the lm_head), and attention's quadratic term ``2 x 2 d s^2 / 2`` per layer and
  sample (causal); the tower ``2 N P`` plus ``4 d p^2`` per block and image (a windowed
  block: ``4 d p w``). Training is 3 forwards (4 with activation checkpointing); a
  frozen part runs 1.
- **collectives** from their volumes over the group's bandwidth (within a node or
  across; the gradient sync at most ``f.grad_sync_bw``): DP gradient all-reduce
  ``2 (n-1)/n`` of the gradients, FSDP2 ``3 (n-1)/n`` of the parameters, ZeRO-1's
  all-gather, TP's 4 (6 with checkpointing) activation all-reduces per layer,
  Ulysses' 8 all-to-alls per block, context parallelism's K/V all-gathers, expert
  parallelism's 4 all-to-alls per MoE layer.
- **crossings**: the tower's output (and its gradient) per microbatch at the tier's
  bandwidth (``cuda_ipc`` colocated, ``nccl`` between GPUs, ``shm`` between CPU
  processes, ``gloo`` across nodes).
- **schedule**: colocated groups take turns, ``k (v + l + c)``; separate groups run
  their action lists, replayed with each microbatch's tower forward and backward and LLM
  seconds (:func:`ray_disagg.pipeline.timing.pipeline_seconds`): sequential
  ``k (v + l + c)``; 1F1B (and a frozen tower, which forwards ahead) overlaps them, and
  the bubble is what the replay takes beyond ``k max(v, l)``. Then the slowest group's
  gradient sync and
  optimizer step (AdamW streams ~28 bytes per local trainable parameter at
  ``f.memory_bw``) and ``k x f.overhead_s`` per group.
- **microbatch size**: compute per sample scales as (samples per microbatch per worker)
  to the power ``f.microbatch_exponent - 1`` relative to the calibration's (caches: on
  this CPU smaller microbatches run faster per sample).
- **CPU workers** share the node's cores: a group with more workers than cores
  computes at ``cores / workers`` of a core each; under 1F1B, where the groups compute
  at the same time, the pipeline takes at least the step's core-seconds over the cores.
  Their data-parallel gradient sync runs at ``f.grad_sync_bw`` (gloo's reductions share
  the cores with the backward). Colocated groups' syncs add up on GPUs and on
  oversubscribed cores (they overlap where each CPU worker has a core).
- **collective calls** each cost ``f.collective_latency_s`` on top of their volume:
  per microbatch ``4 L + 4`` for TP (``6 L + 4`` checkpointed), ``8 x depth`` for
  Ulysses, ``4 L`` for CP and EP, ``3 (L + 3)`` for FSDP2 units; per step one per 16M
  elements of data-parallel gradients.
- **memory** per worker: the training state of
  :func:`ray_disagg.planner.memory.estimate` (parameters, gradients, AdamW) and the
  calibrated fixed bytes (``f.memory_fit``), plus the larger of the activations (the
  estimate's, times the calibrated scale; a 1F1B tower holds one microbatch more than
  its schedule keeps in flight) and the buffers that live after backward (the
  data-parallel all-reduce's flat bucket and gloo's copy of it, up to 64 MiB each;
  FSDP2's unsharded embedding, lm_head and one layer with their gradients); per GPU the
  bundle's sum when colocated.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ray_disagg.config.groups import ExpertParallel
from ray_disagg.models.costs import depth
from ray_disagg.pipeline.timing import pipeline_seconds
from ray_disagg.planner.cluster import Cluster, DeviceFigures
from ray_disagg.planner.facts import (
    CachedModel,
    ModelFacts,
    Workload,
    model_facts,
    workload,
)
from ray_disagg.planner.memory import (
    GiB,
    count_blocks,
    memory_per_worker,
    microbatch_samples,
    schedule,
    step_samples,
)
from ray_disagg.planner.rollout import (
    decode_seconds,
    generating,
    prompt_tokens,
    reference_mode,
    update_sequences,
)

__all__ = [
    "CachedModel",
    "ModelFacts",
    "Prediction",
    "Workload",
    "fits",
    "model_facts",
    "part_flops",
    "passes",
    "predict",
    "with_layout",
    "workload",
]


@dataclass
class Prediction:
    """A layout's predicted step: seconds per part and term, and memory per worker."""

    step_s: float
    compute_s: dict
    comm_s: dict
    crossing_s: float
    bubble_s: float
    sync_s: float
    memory: dict
    """Per group: bytes of one worker (estimate x calibrated scale)."""
    per_device: dict
    """Per device kind (group, or "bundle" colocated; "node" for CPU workers): bytes."""
    samples: float = 0.0
    """Samples per step (``global_batch_size``, or what a token budget's steps take)."""
    rollout_s: float = 0.0
    """A generating objective's rollout before the update (:mod:`~ray_disagg.planner.rollout`)."""

    @property
    def sample_s(self) -> float:
        """Seconds per sample: what layouts are ranked by."""
        return self.step_s / max(self.samples, 1e-9)


def _dtype(r) -> str:
    return "bfloat16" if r.loop.bf16 or r.loop.param_dtype == "bfloat16" else "float32"


def _bw(group, cluster: Cluster, f: DeviceFigures, span: int) -> float:
    """Bandwidth of a collective over ``span`` workers of ``group``."""
    return f.collective_bw if span <= cluster.per_node else f.inter_node_bw


def _degrees(group) -> dict[str, int]:
    shape, axes = group.mesh_layout
    return dict(zip(axes, shape))


def _layer_comm(r, part: str, facts: ModelFacts, work: Workload, c: Cluster, f) -> float:
    """Seconds of one microbatch's TP / SP / CP / EP collectives on one worker."""
    g = r.groups[part]
    deg, a = _degrees(g), 2 if _dtype(r) == "bfloat16" else 4
    ac = g.activation_checkpointing
    samples = microbatch_samples(r, g)
    if part == facts.llm_part:
        n, per = update_sequences(r, work.tokens)
        return _llm_comm(g, facts.text, samples * n * per, a, ac, c, f)
    sp = deg.get("sp", 1)
    if part != "vision" or sp == 1 or facts.vision is None:
        return 0.0
    v = facts.vision
    h = getattr(v, "embed_dim", None) or v.hidden_size
    rows = samples * work.patches / sp
    volume = 8 * depth(v) * (sp - 1) / sp * rows * h * a / _bw(g, c, f, sp)
    return volume + 8 * depth(v) * f.collective_latency_s


def _llm_comm(g, t, tokens: float, a: int, ac: bool, c: Cluster, f) -> float:
    deg, h, lat, layers = _degrees(g), t.hidden_size, f.collective_latency_s, t.num_hidden_layers
    tp, cp, seconds = deg.get("tp", 1), deg.get("cp", 1), 0.0
    if tp > 1:
        count = (6 if ac else 4) * layers
        seconds += count * 2 * (tp - 1) / tp * tokens / cp * h * a / _bw(g, c, f, tp)
        seconds += (count + 4) * lat
    if cp > 1:
        kv = t.num_key_value_heads * (getattr(t, "head_dim", None) or h // t.num_attention_heads)
        seconds += 3 * layers * (cp - 1) / cp * tokens * 2 * kv * a / _bw(g, c, f, cp)
        seconds += 4 * layers * lat
    if isinstance(g.parallelism, ExpertParallel) and g.parallelism.size > 1:
        ep, top = g.parallelism.size, getattr(t, "num_experts_per_tok", 1)
        seconds += 4 * layers * (ep - 1) / ep * tokens * top * h * a / _bw(g, c, f, ep)
        seconds += 4 * layers * lat
    return seconds


def _sync(r, part: str, facts: ModelFacts, c: Cluster, f: DeviceFigures) -> float:
    """Gradient sync and optimizer step of one worker of ``part``, seconds."""
    g, pf = r.groups[part], facts.parts[part]
    if not pf.trainable:
        return 0.0
    deg = _degrees(g)
    mp = math.prod(v for k, v in deg.items() if k not in ("dp", "dp_shard"))
    local, p_bytes = pf.trained / mp, 2 if r.loop.param_dtype == "bfloat16" else 4
    dp = g.dp_size
    seconds = 0.0
    if dp > 1:
        bw = _bw(g, c, f, g.num_workers)
        bw = min(bw, f.grad_sync_bw or bw)
        volume = 3 * local * p_bytes if g.fsdp else 2 * local * p_bytes
        if getattr(g.parallelism, "zero1", False):
            volume += local * p_bytes
        seconds += (dp - 1) / dp * volume / bw
        if g.fsdp:  # per microbatch: gather forward and backward, reduce-scatter
            calls = 3 * (count_blocks(r, part) + 3) * r.loop.micro_batches
        else:
            calls = math.ceil(local / (1 << 24)) + getattr(g.parallelism, "zero1", False)
        seconds += calls * (f.collective_latency_s + g.fsdp * f.fsdp_unit_s)
    shard = dp if (g.fsdp or getattr(g.parallelism, "zero1", False)) else 1
    return seconds + local / shard * 28 / f.memory_bw


def _tier(r, c: Cluster) -> str:
    if r.placement == "colocated":
        return "cuda_ipc" if c.gpu else "shm"
    if c.gpu:
        return "nccl"
    return "shm" if c.nodes == 1 else "gloo"


def _crossing(r, facts: ModelFacts, work: Workload, c: Cluster, f: DeviceFigures) -> float:
    """Seconds of one microbatch's crossings (tower output forward, its gradient back)."""
    v = facts.vision
    if v is None or "vision" not in r.groups:
        return 0.0
    g = r.groups[facts.llm_part]
    a = 2 if _dtype(r) == "bfloat16" else 4
    samples = microbatch_samples(r, g)
    out = getattr(v, "out_hidden_size", None) or facts.text.hidden_size
    rows = samples * work.patches / getattr(v, "spatial_merge_size", 1) ** 2
    ways = 2 if facts.parts["vision"].trainable else 1
    return ways * rows * out * a / f.tier_bw.get(_tier(r, c), min(f.tier_bw.values()))


def _size_factor(r, part: str, f: DeviceFigures) -> float:
    """How much slower per sample a worker computes at its microbatch size than at the
    calibration's (``f.microbatch_exponent``)."""
    if not f.reference_samples or f.microbatch_exponent == 1.0:
        return 1.0
    samples = microbatch_samples(r, r.groups[part])
    return (samples / f.reference_samples) ** (f.microbatch_exponent - 1.0)


def _busy(r, part: str, c: Cluster) -> float:
    """CPU workers: the share of a core each worker of ``part`` gets while it computes
    (1 on GPUs): the node's cores shared by its own group's workers. Other groups
    computing at the same time (1F1B) are bounded by the cores as a whole
    (:func:`_core_bound`)."""
    return 1.0 if c.gpu else min(1.0, c.devices / r.groups[part].num_workers)


def _core_bound(r, compute: dict, c: Cluster) -> float:
    """CPU workers: the step's compute cannot take less than its core-seconds over the
    cores (0 on GPUs, where each worker has its own device)."""
    if c.gpu:
        return 0.0
    used = {p: min(r.groups[p].num_workers, c.devices) for p in compute}
    return sum(compute[p] * used[p] for p in compute) / c.devices


def passes(r, part: str, facts) -> int:
    """Forward-sized passes of a part per microbatch: 1 forward, 2 backward, 1 more
    forward under activation checkpointing; 1 when frozen; under LoRA the backward is
    one pass (input gradients; the factors' are small); 1 more forward of a trained part
    for an objective's reference model (a copy, or the model with its adapters off)."""
    pf = facts.parts[part]
    if not pf.trainable:
        return 1
    n = (3 if pf.lora else 4) if r.groups[part].activation_checkpointing else (2 if pf.lora else 3)
    return n + (reference_mode(r) in ("copy", "adapters_disabled"))


def part_flops(r, facts, work) -> dict[str, float]:
    """Training FLOPs of one global batch per part: the adapter's forward FLOPs of a
    sample (``ModelAdapter.forward_flops``) x passes x samples."""
    adapter, b, llm = r.model.adapter, step_samples(r), facts.llm_part
    seqs = {p: update_sequences(r, work.tokens) if p == llm else (1, work.tokens)
            for p in facts.parts}  # fmt: skip
    return {
        part: passes(r, part, facts) * b * seqs[part][0]
        * adapter.forward_flops(part, pf.params, seqs[part][1], work.patches, work.images)
        for part, pf in facts.parts.items()
    }  # fmt: skip


def predict(r, facts: ModelFacts, work: Workload, c: Cluster, f: DeviceFigures) -> Prediction:
    sched = schedule(r)
    k, llm = r.loop.micro_batches, facts.llm_part
    flops, speed = part_flops(r, facts, work), f.flops[_dtype(r)]
    rel = {p: 1.0 if p == llm else f.encoder_speed for p in flops}
    compute = {
        p: flops[p]
        * _size_factor(r, p, f)
        / (r.groups[p].num_workers * speed * rel[p] * _busy(r, p, c))
        for p in flops
    }
    comm = {p: k * _layer_comm(r, p, facts, work, c, f) for p in r.groups}
    cross = k * _crossing(r, facts, work, c, f)
    per_mb = {p: (compute[p] + comm[p]) / k + f.overhead_s for p in r.groups}
    pipe, bubble = _pipeline(r, sched, facts, per_mb, compute, cross, c)
    syncs = {p: _sync(r, p, facts, c, f) for p in r.groups}
    workers = sum(g.num_workers for g in r.groups.values())
    shared = r.placement == "colocated" and (c.gpu or workers > c.devices)
    sync = sum(syncs.values()) if shared else max(syncs.values())
    memory, per_device = memory_per_worker(r, c, f)
    rollout = _rollout(r, facts, work, c, f)
    return Prediction(
        step_s=pipe + sync + rollout, compute_s=compute, comm_s=comm, crossing_s=cross,
        bubble_s=bubble, sync_s=sync, memory=memory, per_device=per_device,
        samples=step_samples(r), rollout_s=rollout,
    )  # fmt: skip


def _rollout(r, facts, work, c: Cluster, f: DeviceFigures) -> float:
    """Seconds of a generating objective's rollout pass (0 otherwise): the trained
    encoders' extra forward of each prompt (a frozen one's rows serve the update), the
    prefill and the decode steps on one LLM worker (:mod:`ray_disagg.planner.rollout`)."""
    obj = generating(r)
    if obj is None:
        return 0.0
    adapter, b, llm = r.model.adapter, step_samples(r), facts.llm_part
    g, pf, dtype = r.groups[llm], facts.parts[llm], _dtype(r)
    tp = _degrees(g).get("tp", 1)
    speed = f.flops[dtype] * _busy(r, llm, c)
    rows = b * obj.num_generations / g.dp_size
    prompt = prompt_tokens(r, work.tokens)
    one = adapter.forward_flops(llm, pf.params, prompt, work.patches, work.images)
    prefill = rows * one / (tp * speed)
    weights = pf.total * (2 if r.loop.param_dtype == "bfloat16" else 4) / tp
    comm = (2 * facts.text.num_hidden_layers + 2) * f.collective_latency_s if tp > 1 else 0.0
    if g.fsdp:  # every token's forward gathers every unit
        n = g.num_workers // tp
        comm += (n - 1) / n * weights / _bw(g, c, f, g.num_workers)
        comm += (count_blocks(r, llm) + 3) * (f.collective_latency_s + f.fsdp_unit_s)
    decode = decode_seconds(r, rows, weights, 2 * pf.params / tp, speed, f.memory_bw, comm)
    encode = sum(
        b * adapter.forward_flops(p, q.params, work.tokens, work.patches, work.images)
        / (r.groups[p].num_workers * f.flops[dtype] * f.encoder_speed * _busy(r, p, c))
        for p, q in facts.parts.items() if p != llm and q.trainable
    )  # fmt: skip
    return (encode + prefill) / obj.num_iterations + decode


def _pipeline(r, sched, facts, per_mb, compute, cross, c) -> tuple[float, float]:
    """Seconds of the step's microbatches (crossings included) and the bubble in them:
    colocated groups take turns on their devices; separate ones run the action lists
    (replayed), at least the core-seconds over the cores where they overlap (CPUs)."""
    k, llm = r.loop.micro_batches, facts.llm_part
    lm = per_mb[llm]
    encoders = [p for p in r.groups if p != llm]
    v = sum(per_mb[p] for p in encoders)
    if r.placement == "colocated":
        return k * (v + lm) + cross, 0.0
    fwd = sum(per_mb[p] / passes(r, p, facts) for p in encoders)
    trains = any(facts.parts[p].trainable for p in encoders)
    vision = facts.parts.get("vision")
    ways = 2 if vision is not None and vision.trainable else 1  # as _crossing counts

    def replay(transfer: float) -> float:
        return pipeline_seconds(
            k=k, max_in_flight=sched.max_in_flight, forward=fwd, backward=v - fwd,
            train=lm, transfer=transfer, encoder_trains=trains,
        )  # fmt: skip

    pipe = replay(cross / k / ways)
    if sched.max_in_flight == 1 and trains:  # sequential: one group computes at a time
        return pipe, 0.0
    bubble = max(0.0, replay(0.0) - k * max(v, lm))
    return max(pipe, _core_bound(r, compute, c) + cross / k), bubble


def fits(pred: Prediction, c: Cluster) -> tuple[bool, str, float]:
    """Whether the layout fits: ``(ok, where, shortfall bytes)``."""
    limit = (c.host_memory_gib if not c.gpu else c.gpu_memory_gib) * GiB
    where, need = max(pred.per_device.items(), key=lambda kv: kv[1])
    return need <= limit, where, max(0.0, need - limit)


def with_layout(r, **changes):
    """A copy of recipe ``r`` with ``groups``/``placement`` and loop fields
    (``micro_batches``, ``bf16``, ``schedule``, ``max_in_flight``; their defaults
    otherwise) replaced."""
    names = ("micro_batches", "bf16", "schedule", "max_in_flight")
    loop = {k: changes.pop(k) for k in names if k in changes}
    if loop:
        loop = {"schedule": None, "max_in_flight": None, **loop}
        changes["loop"] = dataclasses.replace(r.loop, **loop)
    return dataclasses.replace(r, **changes)
