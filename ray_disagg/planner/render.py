"""Text and files the planner writes: the plan of a recipe (``ray-disagg plan``:
:func:`render`), the ranking of ``plan --auto`` (:func:`render_auto`) and the best layout
as a recipe (:func:`write_recipe`).

Example:
    >>> from ray_disagg.recipes.recipe import load_recipe
    >>> text = render(load_recipe("digits_cpu"))
    >>> "per worker" in text and '("dp", "tp") = (1, 1)' in text
    True
"""

from __future__ import annotations

import dataclasses
import os
import re

from ray_disagg.config.groups import (
    ContextParallel,
    DataParallel,
    ExpertParallel,
    SequenceParallel,
    TensorParallel,
)
from ray_disagg.launch.ray_compat import resources_per_worker
from ray_disagg.lora.parts import part_lora
from ray_disagg.models.support import family_row
from ray_disagg.pipeline.neighbours import Neighbourhoods
from ray_disagg.planner.memory import (
    GiB,
    WorkerMemory,
    estimate,
    mesh,
    per_gpu,
    schedule,
    seq_len,
)
from ray_disagg.planner.rollout import reference_mode, update_sequences
from ray_disagg.planner.search import Candidate, PlanResult

__all__ = ["recipe_dict", "render", "render_auto", "write_recipe"]


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e5 else f"{n:.0f}"


def _parallelism(p) -> str:
    fields = dataclasses.fields(p)
    args = [f"{f.name}={getattr(p, f.name)}" for f in fields if getattr(p, f.name) != f.default]
    if type(p).__name__ == "DataParallel" and not args:
        return "none (data parallel)"
    return f"{type(p).__name__}({', '.join(args)})"


def _source(d: dict) -> str:
    if d["type"] == "mixture":
        parts = [f"{s['name']} x{s['weight']:g}: {_source(s)}" for s in d["sources"]]
        return "mixture of " + "; ".join(parts)
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


def render(r) -> str:
    """The plan of recipe ``r`` as text: model, layout table, memory table."""
    memory = estimate(r)
    lines = [*_header(r), "", *_table(_layout_rows(r)), *_peer_lines(r), ""]
    lines += _memory_lines(r, memory)
    lines += [
        "(an estimate: AdamW 2 states, ZeRO-1/FSDP2/TP sharding, no gradient or optimizer",
        " state for frozen parameters; the activation formulas are in ray_disagg.planner.memory)",
    ]
    warnings = r.layout.warnings if r.layout is not None else ()
    if warnings:
        from ray_disagg.recipes.words import translate

        lines += ["", "warnings:", *(f"  - {translate(w)}" for w in warnings)]
    return "\n".join(lines)


def _header(r) -> list[str]:
    """The model, placement, loop, data and the activations' assumptions."""
    from ray_disagg.launch.resources import colocation_for
    from ray_disagg.recipes.data_stats import recipe_statistics

    cfg, sched, loop = r.model.load_config(), schedule(r), r.loop
    counts = {p: sum(t.numel() for t in r.model.meta_model(p).parameters()) for p in r.groups}
    total = ", ".join(f"{p} {_count(n)}" for p, n in counts.items())
    coloc = colocation_for(r.groups, r.placement)
    where = "separate (one placement group per group)"
    if coloc is not None:
        where = (f"colocated: {coloc.num_bundles} bundles of {coloc.bundle} "
                 f"({coloc.strategy}), worker i of every group in bundle i")  # fmt: skip
    lines = [
        f"recipe {r.name}: {r.model.adapter.model_type}, {r.model_source}",
        f"  {family_row(r.model.adapter.model_type)}",
        f"  parameters: {total} (total {_count(sum(counts.values()))})",
        f"placement: {where}; transfer: {r.transfer}",
        f"loop: max_steps {loop.max_steps}, global_batch_size {loop.global_batch_size}, "
        f"micro_batches {loop.micro_batches} ({sched.schedule}), lr {loop.lr:g} "
        f"{loop.lr_schedule} (warmup {loop.warmup_steps}), "
        f"{'bf16 autocast, ' if loop.bf16 else ''}{loop.param_dtype} parameters + AdamW",
        "data: " + ", ".join(f"{k} {_source(d)}" for k, d in r.data.items()),
    ]
    if loop.objective is not None:
        lines.insert(-1, f"objective: {_objective(r)}")
    for k in r.data:
        stats = recipe_statistics(r, k)
        if stats is not None:
            lines.append(f"  {k}: {stats}")
    if getattr(cfg, "vision_config", None) is not None:
        adapter, size = r.model.adapter, r.plan["image_size"]
        n, (gh, gw) = adapter.image_patches(size)
        lines.append(
            f"activations at: {r.plan['images_per_sample']} image(s) per sample of "
            f"{'x'.join(map(str, size))} px ({gh}x{gw} = {n} patches, "
            f"{adapter.image_tokens(size)} tokens), seq_len {seq_len(r)} tokens per sample"
        )
    return lines


def _objective(r) -> str:
    """The objective and what it adds to the estimate."""
    obj = r.loop.objective
    n, per = update_sequences(r, seq_len(r))
    text = f"{type(obj).__name__}: {n} sequence(s) of {per:.0f} tokens per sample"
    mode = reference_mode(r)
    if mode is not None:
        held = {
            "copy": "a frozen copy of each trained part (in memory below) and its forward",
            "adapters_disabled": "the trained parts with their adapters off: one more forward",
            "precompute": "log-probs computed before training",
        }[mode]
        text += f"; reference {mode}: {held}"
    return text


def _peer_lines(r) -> list[str]:
    """Each encoder group's cross-group peers: the neighbourhoods every plan keeps to."""
    adapter, out = r.model.adapter, []
    llm = r.groups[adapter.llm_part].dp_size
    for part in adapter.encoder_parts:
        if part in r.groups:
            band = Neighbourhoods(r.groups[part].dp_size, llm)
            out.append(
                f"cross-group peers: a {part} replica <-> at most {band.max_llm_peers} of "
                f"{llm} {adapter.llm_part} replicas, a {adapter.llm_part} replica <-> at most "
                f"{band.max_encoder_peers} of {band.encoders}"
            )
            out.append(
                f"  transport: one {part}-{adapter.llm_part} link over the replicas' "
                f"{band.encoders + llm} leaders: a gloo group, each leader connected to its "
                "peers only, and on GPUs one NCCL communicator (a pair's own where two "
                "workers of the link share a GPU)"
            )
    if out:
        out.append(
            "  statistics: summed within each group, then over the groups' rank 0s "
            "(no collective over every worker)"
        )
    return out


def _layout_rows(r) -> list[list[str]]:
    rows = [
        ["group", "workers", "resources/worker", "parallelism", "mesh", "ckpt", "trainable", "lr x"]
    ]
    for part, g in r.groups.items():
        axes, shape = mesh(g)
        sc = g.scaling_config
        trainable = "yes" + (f" (frozen: {', '.join(g.freeze)})" if g.freeze else "")
        lora = part_lora(r.model, part, g)
        if lora is not None:
            c = lora.config
            trainable = f"LoRA r={c.r} alpha={c.lora_alpha}" + trainable[3:] * g.trainable
        rows.append([
            part,
            str(g.num_workers),
            f"{resources_per_worker(sc)} {sc.placement_strategy}",
            _parallelism(g.parallelism),
            f"({', '.join(f'{a!r}' for a in axes)}) = {shape}".replace("'", '"'),
            "yes" if g.activation_checkpointing else "no",
            trainable if g.trainable else "no",
            f"{g.lr_multiplier:g}",
        ])  # fmt: skip
    return rows


def _memory_lines(r, memory: dict[str, WorkerMemory]) -> list[str]:
    big = max(m.total for m in memory.values()) >= GiB
    unit, div = ("GiB", GiB) if big else ("MiB", 2**20)
    ref = any(m.reference for m in memory.values())
    head = ["params/worker", "params", "grads", "optimizer", *["reference"] * ref]
    rows = [[f"per worker ({unit})", *head, "activations", "total"]]
    for part, m in memory.items():
        act = "n/a" if m.activations is None else f"{m.activations / div:.2f}"
        state = (m.params, m.grads, m.optimizer, *[m.reference] * ref)
        name = f"{part} (x{r.groups[part].num_workers})"
        sizes = (f"{v / div:.2f}" for v in state)
        rows.append([name, _count(m.num_params), *sizes, act, f"{m.total / div:.2f}"])
    lines = _table(rows)
    gpu = per_gpu(r, memory)
    if "bundle" in gpu:
        both = " + ".join(r.groups)
        lines.append(f"per GPU (colocated bundle = {both}): {gpu['bundle'] / div:.2f} {unit}")
    for part, b in ((k, v) for k, v in gpu.items() if k != "bundle"):
        lines.append(f"per GPU ({part}): {b / div:.2f} {unit}")
    if not gpu:
        lines.append("no GPUs: the totals are host memory per worker process")
    if r.loop.bf16 and r.loop.param_dtype == "float32":
        lines.append("activations include autocast's bf16 copy of trainable non-FSDP2 weights")
    return lines


def _parallelism_yaml(p):
    kind = {DataParallel: "data", SequenceParallel: "sequence", TensorParallel: "tensor",
            ContextParallel: "context", ExpertParallel: "expert"}[type(p)]  # fmt: skip
    out = {"type": kind}
    for f in dataclasses.fields(p):
        if getattr(p, f.name) != f.default or f.name == "size":
            out[f.name] = getattr(p, f.name)
    return "none" if out == {"type": "data"} else out


def recipe_dict(cand: Candidate) -> dict:
    """The recipe (as YAML data) of a candidate: the original with its layout."""
    r = cand.recipe
    raw = dict(r.raw)
    groups = {}
    for p, g in r.groups.items():
        sc = g.scaling_config
        groups[p] = {
            **(raw.get("groups", {}).get(p) or {}),
            "num_workers": sc.num_workers,
            "use_gpu": sc.use_gpu,
            "resources_per_worker": dict(sc.resources_per_worker),
            "parallelism": _parallelism_yaml(g.parallelism),
            "activation_checkpointing": g.activation_checkpointing,
        }
    loop = dict(raw.get("train_loop_config") or {})
    loop.update(micro_batches=r.loop.micro_batches, bf16=r.loop.bf16)
    for name in ("schedule", "max_in_flight"):  # the layout's (None: the default)
        loop.pop(name, None)
        if getattr(r.loop, name) is not None:
            loop[name] = getattr(r.loop, name)
    return {**raw, "groups": groups, "placement": r.placement, "train_loop_config": loop}


def write_recipe(cand: Candidate, path: str) -> str:
    import yaml

    pred = cand.prediction
    head = (
        f"# written by `ray-disagg plan --auto`: {cand.describe()}\n"
        f"# predicted step {pred.step_s:.3g} s; per device "
        + ", ".join(f"{k} {v / GiB:.2f} GiB" for k, v in pred.per_device.items())
        + "\n"
    )
    with open(path, "w") as f:
        f.write(head + yaml.safe_dump(recipe_dict(cand), sort_keys=False))
    return path


def _reason_kind(text: str) -> str:
    return text.split(":")[0] if text.startswith("out of memory") else text


def render_auto(result: PlanResult, top: int = 5, verbose: bool = False) -> str:
    """The ranking as text: the top layouts with predicted step time and memory, and
    why the others were dropped (grouped; every one with ``verbose``)."""
    f, c, w = result.figures, result.cluster, result.workload
    unit = "GPU" if c.gpu else "node"
    lines = [
        f"cluster: {c.nodes} node(s) x {c.per_node} {'GPUs' if c.gpu else 'CPU cores'}, "
        f"{c.device_memory_gib:g} GiB per {'GPU' if c.gpu else 'core'}",
        f"device figures: {f.name}" + ("" if f.calibrated else " - UNCALIBRATED (nominal)"),
        f"workload: {w.tokens:.0f} LLM tokens, {w.patches:.0f} patches per sample ({w.source})",
        f"{len(result.ranked)} layouts fit, {len(result.dropped)} dropped; top {top}:",
        "",
    ]
    for i, cand in enumerate(result.ranked[:top], 1):
        p = cand.prediction
        mem = ", ".join(f"{g} {m / GiB:.2f}" for g, m in p.memory.items())
        dev = ", ".join(f"{k} {v / GiB:.2f}" for k, v in p.per_device.items())
        per = f" ({p.samples:g} samples)" if cand.recipe.loop.max_tokens_per_microbatch else ""
        lines.append(f"{i}. {p.step_s:8.3f} s/step{per}  {cand.describe()}")
        rollout = f", rollout {p.rollout_s:.3f} s" if p.rollout_s else ""
        lines.append(
            f"   memory per worker (GiB): {mem}; per {unit}: {dev}; bubble {p.bubble_s:.3f} s, "
            f"crossings {p.crossing_s:.3f} s, sync {p.sync_s:.3f} s{rollout}"
        )
    rest = result.ranked[top:]
    if rest:
        lines.append(
            f"\n{len(rest)} more fit but are predicted slower "
            f"({rest[0].prediction.step_s:.3f} to {rest[-1].prediction.step_s:.3f} s/step)"
        )
    groups: dict[str, list[Candidate]] = {}
    for d in result.dropped:
        groups.setdefault(_reason_kind(d.dropped), []).append(d)
    for reason, cands in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        lines.append(f"dropped {len(cands)}: {reason} (e.g. {cands[0].describe()})")
        if verbose:
            lines += [f"  - {x.describe()}: {x.dropped}" for x in cands]
    return "\n".join(lines)
