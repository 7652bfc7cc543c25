"""The memory of each worker of a layout, from the meta-device model of each part (no
weights, no Ray, no memory): :func:`estimate` (what ``ray-disagg plan`` prints) and the
planner's memory model (:func:`memory_per_worker`).

Per worker, with ``P`` bytes per parameter (4 for ``param_dtype: float32``, the default
also under ``bf16`` autocast; 2 for ``bfloat16``):

- parameters: the part's parameters (``HFModelSpec.meta_model(part)``) on this rank, x P.
  ``TensorParallel`` divides the tensors its plan shards by its size (decoder q/k/v/o and
  MLP, the vocab-parallel embedding and lm_head; a tower's qkv/proj/MLP); norms and
  row-wise biases stay whole. FSDP2 divides every tensor by the shard degree.
  ``ExpertParallel(size)`` divides the routed experts by ``size`` (and FSDP2 leaves
  them to it).
- gradients: the trainable parameters (``trainable: false`` and ``freeze`` prefixes have
  none), sharded the same way, x P.
- optimizer: AdamW's two states of the trainable parameters, 2 x P, sharded the same way
  and divided by the group's workers with ZeRO-1.
- reference: an objective's frozen copy of a trained part (``DPO(reference="copy")``,
  also what ``"auto"`` chooses without LoRA), its parameters as above; a DPO sample is
  a pair: two sequences through the LLM (its activations and FLOPs), one set of media.
- activations, ``a`` bytes per element (2 under bf16 or bfloat16, else 4), assuming a
  memory-efficient attention kernel (no ``seq^2`` term):

  - LLM: ``T`` tokens per microbatch (``ceil(global_batch_size / (dp x micro_batches))``
    samples x ``seq_len``; packed: whole rows of ``max_seq_len``) times, per layer,
    ``4h + (2 q + 2 kv + 4 i) / tp`` elements (the norms' inputs and outputs are whole;
    q, k, v, the attention output and the MLP's gate, up, act and product are TP-sharded;
    an MoE block: ``4 (k i_e + i_shared) + 3 k h``, its chosen experts and the
    dispatched rows),
    x layers; with activation checkpointing ``layers x h`` plus one layer's full set;
    plus ``2h`` (final norm) and the logits, ``(V / tp) x (a + 8)`` bytes per token (the
    logits, their fp32 copy and the saved fp32 log-softmax).
  - vision tower: the patches of one microbatch's images on this rank (``/ sp``), times
    the encoder microbatches in flight (1F1B), times, per block, ``4h + (9h + m i) / tp``
    (``m`` = 4 for a gated MLP, else 2; the attention keeps q, k, v, their roped and
    head-major copies and its output), x depth (checkpointing: ``depth x h`` + one
    block), plus the patch input (``3 t p^2``) and the merger (``5h + out / merge^2``).
    An image of ``image_size`` is rounded to multiples of ``patch x merge`` as the Qwen
    processors do: ``(H / patch) x (W / patch)`` patches, ``/ merge^2`` LLM tokens.
  - bf16 autocast over fp32 parameters (without FSDP2) also caches a bf16 copy of every
    local parameter for the step: ``+ 2`` bytes per parameter, counted here.
  - other encoders (audio): not estimated.

  Measured against the tensors autograd saves (``worker.memory.saved_activation_bytes``)
  for a small Qwen2.5-VL in fp32 on CPU: the LLM formula within 2%, the tower's within 5%.

- per GPU: colocated, the bundle's sum (worker ``i`` of every group); separate, a
  worker's total times the workers that share one GPU (``1 / GPU share``).

It is an estimate: allocator caches, communication buffers, FSDP2's all-gathered layer,
the CUDA context and temporaries are not counted. Each family's adapter gives the
activation formulas (``ray_disagg.models.costs``); those above are the defaults and the
Qwen towers'.

The planner's memory model adds, over the idle baseline, the calibrated fixed bytes and
takes the larger of the activations (the estimate's, times the calibrated scale) and the
buffers that live after backward (data-parallel bucket, FSDP2's unsharded units).

Example:
    >>> from ray_disagg.recipes.recipe import load_recipe
    >>> memory = estimate(load_recipe("digits_cpu"))
    >>> memory["text"].total > memory["text"].params > 0
    True
"""

from __future__ import annotations

import dataclasses
import math
import re

from ray_disagg.config.freezing import is_frozen
from ray_disagg.launch.ray_compat import resources_per_worker
from ray_disagg.lora.layers import base_name, is_factor
from ray_disagg.lora.parts import lora_key, lora_meta_part, part_lora
from ray_disagg.models.costs import ActivationShape, depth
from ray_disagg.parallel.tensor_parallel import LayerTPPlan
from ray_disagg.planner.cluster import Cluster, DeviceFigures
from ray_disagg.planner.rollout import kv_cache_bytes, reference_mode, update_sequences

__all__ = [
    "GiB",
    "WorkerMemory",
    "degree",
    "estimate",
    "memory_per_worker",
    "mesh",
    "part_model",
    "per_gpu",
    "schedule",
    "seq_len",
    "worker_terms",
]

GiB = 2**30


@dataclasses.dataclass
class WorkerMemory:
    """Estimated bytes of one worker of a group (see the module docstring)."""

    num_params: float
    params: float
    grads: float
    optimizer: float
    activations: float | None
    reference: float = 0.0
    """An objective's frozen copy of the part (``DPO(reference="copy")``)."""

    @property
    def total(self) -> float:
        state = self.params + self.grads + self.optimizer + self.reference
        return state + (self.activations or 0.0)


def mesh(group) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The group's device mesh axes and sizes, as the trainer builds it."""
    shape, axes = group.mesh_layout
    return axes, shape


def degree(group, axis: str) -> int:
    """The group's size along mesh axis ``axis`` (1 when it has no such axis)."""
    shape, axes = group.mesh_layout
    return dict(zip(axes, shape)).get(axis, 1)


def part_model(r, part: str):
    """The part's meta model as it trains: under LoRA (:mod:`ray_disagg.lora`) with PEFT's
    layers injected and the group's freezing applied (cached per adapter)."""
    group = r.groups[part]
    lora = part_lora(r.model, part, group)
    if lora is None:
        return r.model.meta_model(part)
    cache = getattr(r.model, "memory_cache", {})
    key = ("lora", part, group.freeze, group.trainable, lora_key(group.peft_config, r.model))
    if key not in cache:
        cache[key] = lora_meta_part(r.model, part, group, lora)[0]
    return cache[key]


def _tp_sharded(adapter, part: str, name: str) -> bool:
    """Whether TP shards parameter ``name`` (under LoRA: a base as without it; the
    factor that meets the shard: a column-wise module's ``lora_B``, a row-wise one's
    ``lora_A``)."""
    if is_factor(name):
        module, _, factor = name.partition(".lora_")
        style = _tp_style(adapter, part, f"{module}.weight")
        return (style, factor[0]) in (("colwise", "B"), ("rowwise", "A"))
    name = base_name(name)
    style = _tp_style(adapter, part, name)
    if style is True:
        return True
    return style == "colwise" or (style == "rowwise" and name.endswith(".weight"))


def _tp_style(adapter, part: str, name: str):
    """The TP style of the module of parameter ``name`` (``True``: the vocab-parallel
    embedding and lm_head)."""
    if part == adapter.llm_part:
        if name.endswith("embed_tokens.weight") or name.startswith("lm_head."):
            return True
        plan, layers = adapter.llm_tp_plan(), r"\.layers\.\d+\."
        plan = plan.fused_styles() if isinstance(plan, LayerTPPlan) else plan
    else:
        tower = adapter.tower_tp_plan(part)
        if tower is None:
            return None
        plan, layers = tower.styles, rf"\.{re.escape(tower.blocks)}\.\d+\."
        # a split Linear's fused tensor is sharded like its row blocks
        plan = {**plan, **{p: plan[f"{p}.{s.pieces[0]}"] for p, s in tower.splits.items()}}
    m = re.search(layers + r"(.+)\.(weight|bias)$", name)
    return plan.get(m.group(1)) if m else None


def _is_ep(group) -> bool:
    return type(group.parallelism).__name__ == "ExpertParallel"


def _expert_sharded(name: str) -> bool:
    return re.search(r"\.mlp\.experts\.(gate_up_proj|down_proj)$", name) is not None


def step_samples(r) -> int:
    """Samples per step the estimate assumes: ``global_batch_size``; under a token budget
    (``max_tokens_per_microbatch``) as many samples of :func:`seq_len` tokens (each
    sequence of a pair) as fill the LLM's microbatches, at most ``global_batch_size`` (a
    recipe narrowed to one encoder group, as :func:`worker_terms` makes, carries the
    step's samples there)."""
    b, budget = r.loop.global_batch_size, r.loop.max_tokens_per_microbatch
    llm = r.groups.get(r.model.adapter.llm_part)
    if budget is None or llm is None:
        return b
    n, per = update_sequences(r, seq_len(r))  # DPO's pair, GRPO's completions
    per_sample = n * per
    return min(b, max(1, budget // per_sample) * llm.dp_size * r.loop.micro_batches)


def microbatch_samples(r, group) -> float:
    """Samples of one microbatch on one replica of ``group``."""
    return step_samples(r) / (group.dp_size * r.loop.micro_batches)


def seq_len(r) -> int:
    """LLM tokens per sample the estimate assumes: ``plan.seq_len``, else ``max_seq_len``,
    else the images' tokens plus 512."""
    if r.plan["seq_len"] is not None:
        return r.plan["seq_len"]
    if r.loop.max_seq_len is not None:
        return r.loop.max_seq_len
    adapter = r.model.adapter
    if getattr(r.model.load_config(), "vision_config", None) is None:
        return 512
    return r.plan["images_per_sample"] * adapter.image_tokens(r.plan["image_size"]) + 512


def schedule(r):
    """The recipe's loop with its schedule resolved (as the trainer does, map-style)."""
    from ray_disagg.launch.checks import resolve_schedule

    return resolve_schedule(r.loop, r.placement, "map", False)


def _activations(r, part: str, group, sched, a: int, params: dict) -> float | None:
    """The part's activations of one microbatch on one rank, by its adapter's formula."""
    adapter = r.model.adapter
    samples = math.ceil(microbatch_samples(r, group))
    tp, ac = degree(group, "tp"), group.activation_checkpointing
    if part == adapter.llm_part:
        n, per = update_sequences(r, seq_len(r))
        tokens = samples * n * per
        if r.loop.pack_sequences:
            tokens = math.ceil(tokens / r.loop.max_seq_len) * r.loop.max_seq_len
        chunk = r.loop.loss_chunk_tokens or math.inf
        shape = ActivationShape(items=tokens, a=a, tp=tp, cp=degree(group, "cp"),
                                checkpointed=ac, loss_chunk=chunk)  # fmt: skip
        act = adapter.activation_bytes(part, shape)  # or a rollout's KV cache, if larger
        return max(act or 0.0, kv_cache_bytes(r, samples, seq_len(r), tp, a)) or act
    if adapter.tower_config(part) is None:
        return None
    per_image, _ = adapter.image_patches(r.plan["image_size"])
    patches = samples * r.plan["images_per_sample"] * per_image
    patches = min(patches, r.loop.max_patches_per_microbatch or math.inf) / degree(group, "sp")
    gated = any(".mlp.gate_proj." in n for n in params)
    shape = ActivationShape(items=patches, a=a, tp=tp, checkpointed=ac, gated=gated)
    act = adapter.activation_bytes(part, shape)
    return None if act is None else act * sched.max_in_flight


def estimate(r) -> dict[str, WorkerMemory]:
    """Estimated memory of one worker of each group of the recipe ``r``."""
    cfg, adapter, sched = r.model.load_config(), r.model.adapter, schedule(r)
    p_bytes = 4 if r.loop.param_dtype == "float32" else 2
    a = 2 if (r.loop.bf16 or r.loop.param_dtype == "bfloat16") else 4
    out = {}
    for part, group in r.groups.items():
        params = dict(part_model(r, part).named_parameters())
        local, trainable, factors = _local_params(adapter, part, group, params)
        act = _activations(r, part, group, sched, a, params)
        if act is not None and part != adapter.llm_part and trainable + factors[1] == 0:
            blocks = depth(cfg.vision_config)
            act /= sched.max_in_flight * max(1, blocks)  # no_grad: about one block
        trained = trainable * p_bytes + factors[1] * 4  # LoRA factors: fp32 always
        if act is not None and r.loop.bf16 and r.loop.param_dtype == "float32" and not group.fsdp:
            act += trained / 2  # autocast caches bf16 copies of trainable leaf weights
        zero1 = group.num_workers if getattr(group.parallelism, "zero1", False) else 1
        params_bytes = local * p_bytes + factors[0] * 4
        copy = reference_mode(r) == "copy" and trainable + factors[1] > 0
        out[part] = WorkerMemory(
            num_params=local + factors[0],
            params=params_bytes,
            grads=trained,
            optimizer=2 * trained / zero1,
            activations=act,
            reference=params_bytes if copy else 0.0,
        )
    return out


def _local_params(adapter, part: str, group, params: dict) -> tuple[float, float, tuple]:
    """``(parameters, trainable parameters, (LoRA factors, trainable ones))`` on one rank
    of ``group`` (under LoRA ``params`` come frozen as they train)."""
    tp = degree(group, "tp")
    fsdp = group.num_workers // tp if group.fsdp else 1
    ep = getattr(group.parallelism, "size", 1) if _is_ep(group) else 1
    lora = any(is_factor(n) for n in params)
    local = trainable = factors = trained_factors = 0.0
    for name, p in params.items():
        if ep > 1 and _expert_sharded(name):  # over ep only (FSDP2 leaves experts)
            n = p.numel() / ep
        else:
            n = p.numel() / (tp if tp > 1 and _tp_sharded(adapter, part, name) else 1) / fsdp
        trains = p.requires_grad if lora else not is_frozen(name, group)
        if is_factor(name):
            factors, trained_factors = factors + n, trained_factors + n * trains
        else:
            local, trainable = local + n, trainable + n * trains
    return local, trainable, (factors, trained_factors)


def per_gpu(r, memory: dict[str, WorkerMemory]) -> dict[str, float]:
    """Bytes per GPU: ``{"bundle": sum}`` when colocated, else per group (GPU groups only)."""
    if r.placement == "colocated":
        if not all(g.scaling_config.use_gpu for g in r.groups.values()):
            return {}
        return {"bundle": sum(m.total for m in memory.values())}
    out = {}
    for part, g in r.groups.items():
        share = resources_per_worker(g.scaling_config).get("GPU", 0)
        if g.scaling_config.use_gpu and share:
            out[part] = memory[part].total * max(1, math.floor(1 / share + 1e-9))
    return out


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
    if part == r.model.adapter.llm_part:
        return 1.0
    sched = schedule(r)
    if sched.schedule != "1f1b":
        return 1.0
    return min(sched.max_in_flight + 1, r.loop.micro_batches) / sched.max_in_flight


def worker_terms(r, part: str) -> tuple[float, float, float]:
    """Bytes of one worker of ``part``: ``(training state, DP/FSDP2 buffers, estimated
    activations)`` (cached on the model per group setting: the planner asks for
    thousands of layouts)."""
    g, samples = r.groups[part], step_samples(r)
    loop = dataclasses.replace(r.loop, global_batch_size=samples)
    key = (part, g.num_workers, g.parallelism, g.activation_checkpointing, g.trainable,
           g.freeze, loop.micro_batches, loop.bf16, loop.param_dtype, r.placement,
           loop.schedule, loop.max_in_flight, lora_key(g.peft_config, r.model),
           samples)  # fmt: skip
    cache = getattr(r.model, "memory_cache", None)
    if cache is not None and key in cache:
        return cache[key]
    m = estimate(dataclasses.replace(r, groups={part: g}, loop=loop))[part]
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
        per_block = max(blocks) / count_blocks(r, part) if blocks else 0.0
        rest = sorted((n for u, n in sizes.items() if not u.endswith((".layers.", ".blocks."))))
        cache[key] = per_block + sum(rest[-2:])
    return cache[key]


def count_blocks(r, part: str) -> int:
    cfg = r.model.load_config()
    if part == r.model.adapter.llm_part:
        return cfg.text_config.num_hidden_layers
    v = getattr(cfg, "vision_config", None)
    return depth(v) if v is not None else 1
