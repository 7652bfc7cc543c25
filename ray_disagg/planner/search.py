"""``ray-disagg plan --auto``: enumerate the layouts of a recipe's model on a cluster,
drop those that do not fit or are not valid, rank the rest by the cost model's step time
(:mod:`ray_disagg.planner.cost`) and write the best as a recipe.

Enumerated per layout: placement (separate: the tower and LLM groups on disjoint devices
of every split; colocated: both on every device), the tower's parallelism (data
parallel, Ulysses ``SequenceParallel``), the LLM's (data parallel, ZeRO-1, FSDP2,
``TensorParallel`` within a node, with FSDP2 over the rest, ``ContextParallel``, and
``ExpertParallel`` for an MoE LLM), ``micro_batches`` (with 1F1B across separate groups,
the default 2 microbatches in flight or all of them), activation checkpointing per group
and bf16 autocast.

Example:
    >>> from ray_disagg.recipes.recipe import load_recipe
    >>> from ray_disagg.planner.cluster import parse_cluster, NOMINAL
    >>> result = plan_auto(load_recipe("digits_cpu"), parse_cluster("cpus_per_node=2"),
    ...                    NOMINAL["cpu"])
    >>> len(result.ranked) > 1 and result.ranked[0].prediction.step_s > 0
    True
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

from ray.train import ScalingConfig

from ray_disagg.config.groups import (
    ContextParallel,
    DataParallel,
    ExpertParallel,
    SequenceParallel,
    TensorParallel,
)
from ray_disagg.planner import cost
from ray_disagg.planner.cluster import Cluster, DeviceFigures
from ray_disagg.planner.memory import GiB, schedule

__all__ = ["Candidate", "PlanResult", "enumerate_layouts", "group_for", "plan_auto"]


@dataclass
class Candidate:
    recipe: object
    prediction: cost.Prediction | None = None
    dropped: str | None = None
    shortfall: tuple[str, float] | None = None  # (where, bytes) when it did not fit

    def describe(self) -> str:
        r = self.recipe
        parts = [f"{p}: {g.num_workers}x {_short(g)}" for p, g in r.groups.items()]
        k = r.loop.micro_batches
        sched = schedule(r)
        loop = f"mb={k}" + (f" {sched.schedule}" if k > 1 else "")
        if sched.schedule == "1f1b" and sched.max_in_flight != min(2, k):
            loop += f" ({sched.max_in_flight} in flight)"
        loop += " bf16" if r.loop.bf16 else ""
        return f"{r.placement}; " + "; ".join(parts) + f"; {loop}"


@dataclass
class PlanResult:
    ranked: list[Candidate]
    dropped: list[Candidate] = field(default_factory=list)
    figures: DeviceFigures | None = None
    cluster: Cluster | None = None
    workload: cost.Workload | None = None


def _short(g) -> str:
    p = g.parallelism
    kind = {DataParallel: "dp", SequenceParallel: "sp", TensorParallel: "tp",
            ContextParallel: "cp", ExpertParallel: "ep"}[type(p)]  # fmt: skip
    out = kind if kind == "dp" else f"{kind}{p.size}"
    out += f"xtp{p.tp}" if getattr(p, "tp", 1) > 1 else ""
    out += "+fsdp" if p.fsdp else "+zero1" if getattr(p, "zero1", False) else ""
    return out + (" ac" if g.activation_checkpointing else "")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _sizes(n: int, cap: int) -> list[int]:
    return [d for d in _divisors(n) if 1 < d <= cap]


def _tower_options(n: int, heads: int | None) -> list:
    out = [DataParallel(), DataParallel(fsdp=True)] if n > 1 else [DataParallel()]
    for s in _sizes(n, n):
        if heads and heads % s == 0:
            out.append(SequenceParallel(size=s))
    return out


def _llm_options(n: int, per_node: int, t, moe: bool) -> list:
    heads = t.num_attention_heads
    out = [DataParallel()]
    if n > 1:
        out += [DataParallel(zero1=True), DataParallel(fsdp=True)]
    for s in _sizes(n, per_node):
        if heads % s == 0 and t.num_key_value_heads % s == 0:
            out.append(TensorParallel(size=s))
            if n // s > 1:
                out.append(TensorParallel(size=s, fsdp=True))
    for s in _sizes(n, per_node):
        if heads % s == 0:
            out.append(ContextParallel(size=s))
    if moe:
        experts = t.num_experts
        out += [ExpertParallel(size=s) for s in _sizes(n, n) if experts % s == 0]
    return out


def group_for(base, n: int, parallelism, ac: bool, gpu: bool, share: float):
    sc = base.scaling_config
    res = {"GPU": share, "CPU": 1} if gpu else {"CPU": 1}
    new = ScalingConfig(num_workers=n, use_gpu=gpu, resources_per_worker=res,
                        placement_strategy=sc.placement_strategy)  # fmt: skip
    return dataclasses.replace(base, scaling_config=new, parallelism=parallelism,
                               activation_checkpointing=ac)  # fmt: skip


def _splits(c: Cluster, parts: list[str]):
    """(placement, {part: workers}) over the cluster's devices."""
    d = c.devices
    yield "colocated", dict.fromkeys(parts, d)
    if len(parts) == 2:  # separate: one encoder group beside the LLM only
        for v in range(1, d):
            yield "separate", {parts[0]: v, parts[1]: d - v}


def enumerate_layouts(r, c: Cluster):
    """Every candidate recipe (not yet checked): see the module docstring."""
    cfg = r.model.load_config()
    llm = r.model.adapter.llm_part
    parts = list(r.groups)
    t, v = cfg.text_config, getattr(cfg, "vision_config", None)
    moe = bool(getattr(t, "num_experts", None))
    heads = getattr(v, "num_heads", None) if v is not None else None
    b = r.loop.global_batch_size
    for placement, sizes in _splits(c, parts):
        share = 1 / len(parts) if placement == "colocated" and c.gpu else 1
        options = {
            p: _llm_options(n, c.per_node, t, moe) if p == llm else _tower_options(n, heads)
            for p, n in sizes.items()
        }
        for choice in itertools.product(*(options[p] for p in parts)):
            for acs in itertools.product((False, True), repeat=len(parts)):
                groups = {
                    p: group_for(r.groups[p], sizes[p], par, ac, c.gpu, share)
                    for p, par, ac in zip(parts, choice, acs)
                }
                dps = [g.dp_size for g in groups.values()]
                for k in (1, 2, 4, 8, 16):
                    if _splits_badly(r.loop, b, dps, groups[llm].dp_size * k, k):
                        continue
                    # 1F1B: the default 2 in flight, or every microbatch (fewer waits,
                    # more of the tower's activations held)
                    ahead = [None] + ([k] if placement == "separate" and k > 2 else [])
                    for bf16, m in itertools.product(sorted({r.loop.bf16, True}), ahead):
                        yield cost.with_layout(r, groups=groups, placement=placement,
                                               micro_batches=k, bf16=bf16,
                                               max_in_flight=m)  # fmt: skip


def _splits_badly(loop, b: int, dps: list[int], bins: int, k: int) -> bool:
    """A fixed batch must split evenly over every group's replicas x microbatches; a
    token budget's needs a sample per LLM microbatch."""
    if loop.max_tokens_per_microbatch is not None:
        return b < bins
    return any(b % (dp * k) for dp in dps)


def _check(cand: Candidate) -> str | None:
    """Why the layout is invalid for this model (the driver's own checks), else None."""
    from ray_disagg.config.layout import resolve
    from ray_disagg.config.refusals import refusals_of
    from ray_disagg.recipes.data import data_spec

    r = cand.recipe
    try:
        resolve(
            r.model, r.groups, r.loop, placement=r.placement, transfer=r.transfer,
            data=data_spec(r.data), check_weights=False,
        )  # fmt: skip
    except ValueError as e:
        return f"invalid: {str(refusals_of(e)[0]).split(';')[0]}"
    return None


def plan_auto(r, c: Cluster, figures: DeviceFigures, stats: dict | None = None) -> PlanResult:
    """Rank every layout of recipe ``r`` on cluster ``c`` (see the module docstring)."""
    model = cost.CachedModel(r.model)
    r = dataclasses.replace(r, model=model)
    facts, work = cost.model_facts(r), cost.workload(r, stats)
    ranked, dropped = [], []
    for layout in enumerate_layouts(r, c):
        cand = Candidate(layout)
        cand.dropped = _check(cand)
        if cand.dropped is None:
            cand.prediction = cost.predict(layout, facts, work, c, figures)
            ok, where, short = cost.fits(cand.prediction, c)
            if not ok:
                cand.dropped = f"out of memory: {where} needs {short / GiB:.1f} GiB more"
                cand.shortfall = (where, short)
        (dropped if cand.dropped else ranked).append(cand)
    ranked.sort(key=lambda x: x.prediction.sample_s)
    if not ranked:
        raise ValueError(_no_fit(dropped, c))
    return PlanResult(ranked, dropped, figures, c, work)


def _no_fit(dropped: list[Candidate], c: Cluster) -> str:
    short = [d for d in dropped if d.shortfall]
    if not short:
        return f"No layout of this model is valid on {c.devices} devices: {dropped[0].dropped}"
    best = min(short, key=lambda d: d.shortfall[1])
    where, need = best.shortfall
    have = c.gpu_memory_gib if c.gpu else c.host_memory_gib
    return (
        f"No layout fits the cluster ({c.devices} devices, {have:g} GiB each): the smallest "
        f"shortfall is {need / GiB:.1f} GiB on {where} with {best.describe()}. It would fit "
        f"with {have + need / GiB:.0f} GiB per device, more devices, "
        "train_loop_config.param_dtype=bfloat16 or frozen groups."
    )
