"""What ``ray-disagg plan`` prints: every group's layout and an estimate of each worker's
memory, from the meta-device model of each part (no weights, no Ray, no memory).

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
the CUDA context and temporaries are not counted.

Example:
    >>> from ray_disagg.recipes.recipe import load_recipe
    >>> text = render(load_recipe("digits_cpu"))
    >>> "per worker" in text and '("dp", "tp") = (1, 1)' in text
    True
"""

from __future__ import annotations

import dataclasses
import math
import os
import re

from ray_disagg.freezing import is_frozen
from ray_disagg.launch.ray_compat import resources_per_worker

__all__ = ["WorkerMemory", "estimate", "image_patches", "mesh", "render"]

GiB = 2**30


@dataclasses.dataclass
class WorkerMemory:
    """Estimated bytes of one worker of a group (see the module docstring)."""

    num_params: float
    params: float
    grads: float
    optimizer: float
    activations: float | None

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + (self.activations or 0.0)


def mesh(group) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The group's device mesh axes and sizes, as the trainer builds it."""
    shape, axes = group.mesh_layout
    return axes, shape


def _degree(group, axis: str) -> int:
    """The group's size along mesh axis ``axis`` (1 when it has no such axis)."""
    shape, axes = group.mesh_layout
    return dict(zip(axes, shape)).get(axis, 1)


def _tp_sharded(adapter, part: str, name: str) -> bool:
    if part == adapter.llm_part:
        if name.endswith("embed_tokens.weight") or name.startswith("lm_head."):
            return True
        plan, layers = adapter.llm_tp_plan(), r"\.layers\.\d+\."
    else:
        tower = adapter.tower_tp_plan(part)
        if tower is None:
            return False
        plan, layers = tower.styles, rf"\.{re.escape(tower.blocks)}\.\d+\."
        # a split Linear's fused tensor is sharded like its row blocks
        plan = {**plan, **{p: plan[f"{p}.{s.pieces[0]}"] for p, s in tower.splits.items()}}
    m = re.search(layers + r"(.+)\.(weight|bias)$", name)
    if not m:
        return False
    module, kind = m.groups()
    style = plan.get(module)
    return style == "colwise" or (style == "rowwise" and kind == "weight")


def _is_ep(group) -> bool:
    return type(group.parallelism).__name__ == "ExpertParallel"


def image_patches(vision_config, image_size) -> tuple[int, int]:
    """``(patches, h_patches x w_patches)`` of one image of ``image_size = [H, W]`` px."""
    p, m = vision_config.patch_size, getattr(vision_config, "spatial_merge_size", 1)
    p = p[0] if isinstance(p, list | tuple) else p  # InternViT: (14, 14)
    f = p * m
    h, w = (max(f, round(s / f) * f) // p for s in image_size)
    return h * w, (h, w)


def _mlp_width(t, tp: int) -> float:
    """Per token and layer, the MLP's activation width: ``4 i / tp`` for a dense one (gate,
    up, act, product, TP-sharded); for an MoE block the ``top_k`` chosen experts' (whole
    on every tp rank) plus a shared expert, and the dispatched rows (sent, received,
    returned: ``3 k h``)."""
    k = getattr(t, "num_experts_per_tok", None)
    if not getattr(t, "num_experts", None) or not k:
        return 4 * t.intermediate_size / tp
    shared = getattr(t, "shared_expert_intermediate_size", 0) or 0
    return 4 * (k * t.moe_intermediate_size + shared) + 3 * k * t.hidden_size


def _expert_sharded(name: str) -> bool:
    return re.search(r"\.mlp\.experts\.(gate_up_proj|down_proj)$", name) is not None


def _llm_activations(cfg, r, group, sched, a: int) -> float:
    t = cfg.text_config
    h, layers, vocab = t.hidden_size, t.num_hidden_layers, t.vocab_size
    head_dim = getattr(t, "head_dim", None) or h // t.num_attention_heads
    q, kv = t.num_attention_heads * head_dim, t.num_key_value_heads * head_dim
    tp = _degree(group, "tp")
    samples = math.ceil(r.loop.global_batch_size / (group.dp_size * sched.micro_batches))
    tokens = samples * _seq_len(cfg, r)
    if r.loop.pack_sequences:
        tokens = math.ceil(tokens / r.loop.max_seq_len) * r.loop.max_seq_len
    cp = _degree(group, "cp")
    layer = 4 * h + (2 * q + 2 * kv) / tp + _mlp_width(t, tp)
    kept = layers * h + layer if group.activation_checkpointing else layers * layer
    # the decoder sees 1/cp of the tokens; logits exist for a chunk of them at a time
    logit_rows = min(tokens / cp, r.loop.loss_chunk_tokens or math.inf)
    return tokens / cp * kept * a + tokens * 2 * h * a + logit_rows * vocab / tp * (a + 8)


def _vision_activations(cfg, r, group, sched, a: int, gated: bool) -> float:
    v = cfg.vision_config
    h = getattr(v, "embed_dim", None) or v.hidden_size
    i = getattr(v, "intermediate_size", None) or int(h * v.mlp_ratio)
    out = getattr(v, "out_hidden_size", None) or v.hidden_size
    tp, sp = _degree(group, "tp"), _degree(group, "sp")
    samples = math.ceil(r.loop.global_batch_size / (group.dp_size * sched.micro_batches))
    per_image, _ = image_patches(v, r.plan["image_size"])
    patches = samples * r.plan["images_per_sample"] * per_image / sp
    block = 4 * h + (9 * h + (4 if gated else 2) * i) / tp
    kept = v.depth * h + block if group.activation_checkpointing else v.depth * block
    outside = 3 * v.temporal_patch_size * v.patch_size**2 + 5 * h + out / v.spatial_merge_size**2
    return sched.max_in_flight * patches * (kept + outside) * a


def _qwen_tower(cfg) -> bool:
    """A Qwen tower (patch merger, temporal patches): the activation formula's; other
    towers (SigLIP, InternViT) are not estimated ("n/a")."""
    v = getattr(cfg, "vision_config", None)
    return v is not None and hasattr(v, "spatial_merge_size") and hasattr(v, "depth")


def _seq_len(cfg, r) -> int:
    if r.plan["seq_len"] is not None:
        return r.plan["seq_len"]
    if r.loop.max_seq_len is not None:
        return r.loop.max_seq_len
    v = getattr(cfg, "vision_config", None)
    merge = getattr(v, "spatial_merge_size", 1) ** 2
    per_image = image_patches(v, r.plan["image_size"])[0] // merge if v else 0
    return r.plan["images_per_sample"] * per_image + 512


def _schedule(r):
    from ray_disagg.launch.checks import resolve_schedule

    return resolve_schedule(r.loop, r.placement, "map", False)


def estimate(r) -> dict[str, WorkerMemory]:
    """Estimated memory of one worker of each group of the recipe ``r``."""
    cfg, adapter, sched = r.model.load_config(), r.model.adapter, _schedule(r)
    p_bytes = 4 if r.loop.param_dtype == "float32" else 2
    a = 2 if (r.loop.bf16 or r.loop.param_dtype == "bfloat16") else 4
    out = {}
    for part, group in r.groups.items():
        params = dict(r.model.meta_model(part).named_parameters())
        tp = _degree(group, "tp")
        fsdp = group.num_workers // tp if group.fsdp else 1
        zero1 = group.num_workers if getattr(group.parallelism, "zero1", False) else 1
        local = trainable = 0.0
        ep = getattr(group.parallelism, "size", 1) if _is_ep(group) else 1
        for name, p in params.items():
            if ep > 1 and _expert_sharded(name):  # over ep only (FSDP2 leaves experts)
                n = p.numel() / ep
            else:
                n = p.numel() / (tp if tp > 1 and _tp_sharded(adapter, part, name) else 1) / fsdp
            local += n
            trainable += 0 if is_frozen(name, group) else n
        if part == adapter.llm_part:
            act = _llm_activations(cfg, r, group, sched, a)
        elif part == "vision" and _qwen_tower(cfg):
            gated = any(".mlp.gate_proj." in n for n in params)
            act = _vision_activations(cfg, r, group, sched, a, gated)
        else:
            act = None
        if act is not None and part != adapter.llm_part and trainable == 0:
            act /= sched.max_in_flight * max(1, cfg.vision_config.depth)  # no_grad: ~a block
        if act is not None and r.loop.bf16 and r.loop.param_dtype == "float32" and not group.fsdp:
            act += 2 * trainable  # autocast caches bf16 copies of trainable leaf weights
        out[part] = WorkerMemory(
            num_params=local,
            params=local * p_bytes,
            grads=trainable * p_bytes,
            optimizer=2 * trainable * p_bytes / zero1,
            activations=act,
        )
    return out


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e5 else f"{n:.0f}"


def _parallelism(p) -> str:
    fields = dataclasses.fields(p)
    args = [f"{f.name}={getattr(p, f.name)}" for f in fields if getattr(p, f.name) != f.default]
    if type(p).__name__ == "DataParallel" and not args:
        return "none (data parallel)"
    return f"{type(p).__name__}({', '.join(args)})"


def _source(d: dict) -> str:
    where = d.get("annotations") or d.get("paths") or d.get("records")
    if d["type"] == "digits":
        return f"digits ({d['num_samples'] or 'all'} from #{d['start']}, {d['image_size']} px)"
    paths = where if isinstance(where, list) else [where]
    local = [os.path.expanduser(str(p)) for p in paths if "://" not in str(p)]
    missing = [p for p in local if not os.path.exists(p)]
    return f"{d['type']} ({where}{', not on this machine' if missing else ''})"


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    number = re.compile(r"[\d.]+[MB]?|n/a")
    fmt = [
        str.rjust if c and all(number.fullmatch(row[c]) for row in rows[1:]) else str.ljust
        for c in range(len(widths))
    ]
    return ["  ".join(f(cell, w) for f, cell, w in zip(fmt, row, widths)).rstrip() for row in rows]


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


def render(r) -> str:
    """The plan of recipe ``r`` as text: model, layout table, memory table."""
    from ray_disagg.launch.resources import colocation_for
    from ray_disagg.recipes.data_stats import recipe_statistics

    cfg, sched, memory = r.model.load_config(), _schedule(r), estimate(r)
    counts = {p: sum(t.numel() for t in r.model.meta_model(p).parameters()) for p in r.groups}
    loop = r.loop
    lines = [
        f"recipe {r.name}: {r.model.adapter.model_type}, {r.model_source}",
        "  parameters: "
        + ", ".join(f"{p} {_count(n)}" for p, n in counts.items())
        + f" (total {_count(sum(counts.values()))})",
    ]
    coloc = colocation_for(r.groups, r.placement)
    where = (
        "separate (one placement group per group)"
        if coloc is None
        else (
            f"colocated: {coloc.num_bundles} bundles of {coloc.bundle} ({coloc.strategy}), "
            f"worker i of every group in bundle i"
        )
    )
    lines.append(f"placement: {where}; transfer: {r.transfer}")
    lines.append(
        f"loop: max_steps {loop.max_steps}, global_batch_size {loop.global_batch_size}, "
        f"micro_batches {loop.micro_batches} ({sched.schedule}), lr {loop.lr:g} "
        f"{loop.lr_schedule} (warmup {loop.warmup_steps}), "
        f"{'bf16 autocast, ' if loop.bf16 else ''}{loop.param_dtype} parameters + AdamW"
    )
    lines.append("data: " + ", ".join(f"{k} {_source(d)}" for k, d in r.data.items()))
    for k in r.data:
        stats = recipe_statistics(r, k)
        if stats is not None:
            lines.append(f"  {k}: {stats}")
    if getattr(cfg, "vision_config", None) is not None:
        n, (gh, gw) = image_patches(cfg.vision_config, r.plan["image_size"])
        merge = cfg.vision_config.spatial_merge_size**2
        lines.append(
            f"activations at: {r.plan['images_per_sample']} image(s) per sample of "
            f"{'x'.join(map(str, r.plan['image_size']))} px ({gh}x{gw} = {n} patches, "
            f"{n // merge} tokens), seq_len {_seq_len(cfg, r)} tokens per sample"
        )
    rows = [
        ["group", "workers", "resources/worker", "parallelism", "mesh", "ckpt", "trainable", "lr x"]
    ]
    for part, g in r.groups.items():
        axes, shape = mesh(g)
        sc = g.scaling_config
        trainable = (
            "no"
            if not g.trainable
            else "yes" + (f" (frozen: {', '.join(g.freeze)})" if g.freeze else "")
        )
        rows.append(
            [
                part,
                str(g.num_workers),
                f"{resources_per_worker(sc)} {sc.placement_strategy}",
                _parallelism(g.parallelism),
                f"({', '.join(f'{a!r}' for a in axes)}) = {shape}".replace("'", '"'),
                "yes" if g.activation_checkpointing else "no",
                trainable,
                f"{g.lr_multiplier:g}",
            ]
        )
    lines += ["", *_table(rows), ""]
    big = max(m.total for m in memory.values()) >= GiB
    unit, div = ("GiB", GiB) if big else ("MiB", 2**20)
    rows = [
        [
            f"per worker ({unit})",
            "params/worker",
            "params",
            "grads",
            "optimizer",
            "activations",
            "total",
        ]
    ]
    for part, m in memory.items():
        act = "n/a" if m.activations is None else f"{m.activations / div:.2f}"
        rows.append(
            [
                f"{part} (x{r.groups[part].num_workers})",
                _count(m.num_params),
                *(f"{v / div:.2f}" for v in (m.params, m.grads, m.optimizer)),
                act,
                f"{m.total / div:.2f}",
            ]
        )
    lines += _table(rows)
    gpu = per_gpu(r, memory)
    if "bundle" in gpu:
        lines.append(
            f"per GPU (colocated bundle = {' + '.join(r.groups)}): {gpu['bundle'] / div:.2f} {unit}"
        )
    for part, b in ((k, v) for k, v in gpu.items() if k != "bundle"):
        lines.append(f"per GPU ({part}): {b / div:.2f} {unit}")
    if not gpu:
        lines.append("no GPUs: the totals are host memory per worker process")
    if r.loop.bf16 and r.loop.param_dtype == "float32":
        lines.append("activations include autocast's bf16 copy of trainable non-FSDP2 weights")
    lines += [
        "(an estimate: AdamW 2 states, ZeRO-1/FSDP2/TP sharding, no gradient or optimizer",
        " state for frozen parameters; the activation formula is in ray_disagg.recipes.estimate)",
    ]
    return "\n".join(lines)
