"""What a step reports, in one place: the stats vector every rank sums once a step (each
group's slots, the LLM's loss slots), the time spent computing and waiting, the sample
ids and where tensors went, the reporting cadence, the report itself (with a checkpoint:
:mod:`ray_disagg.worker.checkpoint`), the metrics file and the one line a step prints."""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist

from ray_disagg.data.mixture import SOURCE_KEY
from ray_disagg.lr_schedule import lr_at
from ray_disagg.pipeline.assignment import count_label_tokens
from ray_disagg.transport.channel import Channel
from ray_disagg.worker import checkpoint, memory
from ray_disagg.worker.checkpoint import is_checkpoint_step


class StepStats:
    """Slots of the float64 vector every rank all-reduces (SUM) over the channel once a
    step. Each slot is filled by exactly one rank (or by one rank per data-parallel
    replica for the batch sums); the others give 0.

    - ``loss``, ``label_tokens``, ``llm_tokens``, ``samples``: the LLM group's
      data-parallel leaders;
    - ``cycle``: wall seconds since the previous exchange, the LLM group's rank 0;
    - ``transfer_fallbacks``: tensor messages sent over gloo instead of their planned tier
      (e.g. a full /dev/shm), every rank;
    - ``checkpoint_writing``: ranks whose asynchronous checkpoint write is not done, every
      rank (0 everywhere: the checkpoint is reported this step);
    - ``<group>_{sq,time,wait,peak,inflight,bwd}``: squared grad norm, compute and wait
      seconds, peak memory (MB), most microbatches alive at once, backward passes run, of
      each group, from its rank 0;
    - ``<group>_flops``: the model FLOPs of the group's samples (:mod:`ray_disagg.worker.mfu`),
      its DP leaders; ``<group>_peak_flops``: the sum of its ranks' peak FLOP/s (NaN when
      one has none), every rank of the group;
    - counters (``images``, ``videos``, ``audios``, ``tiles``): the encoder groups' DP leaders;
    - with a per-sequence objective, ``objective_samples`` and the sums of its
      ``metric_names`` (reported as means over the samples): the LLM's DP leaders;
    - a mixture's ``loss/<source>`` (summed token loss) and ``label_tokens/<source>``:
      the LLM's DP leaders.
    """

    def __init__(self, groups: list[str], counters: list[str], objective_metrics=None,
                 sources=()):  # fmt: skip
        self.groups, self.counters = list(groups), list(counters)
        self.objective_metrics = objective_metrics  # None: no objective (SFT)
        self.sources = tuple(sources)
        names = ["loss", "label_tokens", "llm_tokens", "samples", "cycle", "transfer_fallbacks"]
        names += ["checkpoint_writing"]
        per_group = ("sq", "time", "wait", "peak", "inflight", "bwd", "flops", "peak_flops")
        names += [f"{g}_{k}" for g in groups for k in per_group]
        names += list(counters)
        if objective_metrics is not None:
            names += ["objective_samples", *objective_metrics]
        names += [f"{k}/{src}" for src in self.sources for k in ("loss", "label_tokens")]
        self.index = {n: i for i, n in enumerate(names)}

    def new(self) -> torch.Tensor:
        return torch.zeros(len(self.index), dtype=torch.float64)

    def metrics(
        self, stats, step: int, epoch: int, lrs: dict[str, float], mean_step_time: float
    ) -> dict:
        """``lrs``: ``"lr"`` (the schedule's) and ``"<group>_lr"`` of this step."""
        s = {n: float(stats[i]) for n, i in self.index.items()}
        cycle = max(s["cycle"], 1e-9)
        out = {
            "step": step + 1,
            "epoch": epoch,
            "loss": s["loss"],
            "grad_norm": sum(s[f"{g}_sq"] for g in self.groups) ** 0.5,
            **lrs,
            "label_tokens": int(s["label_tokens"]),
            "samples": int(s["samples"]),
            "step_time_s": s["cycle"],
            "mean_step_time_s": mean_step_time,
            "tokens_per_s": s["llm_tokens"] / cycle,
            "transfer_fallbacks": int(s["transfer_fallbacks"]),
        }
        for g in self.groups:
            out[f"{g}_grad_norm"] = s[f"{g}_sq"] ** 0.5
            out[f"{g}_compute_s"] = s[f"{g}_time"]
            out[f"{g}_wait_s"] = s[f"{g}_wait"]
            out[f"{g}_peak_memory_mb"] = s[f"{g}_peak"]
            out[f"{g}_max_in_flight"] = int(s[f"{g}_inflight"])
            out[f"{g}_backward_passes"] = int(s[f"{g}_bwd"])
        out.update(_mfu(s, self.groups, cycle))
        out.update({c: int(s[c]) for c in self.counters})
        if self.objective_metrics is not None:
            n = max(s["objective_samples"], 1.0)
            out.update({m: s[m] / n for m in self.objective_metrics})
        for src in self.sources:  # the source's mean token loss (NaN: none in the step)
            n = s[f"label_tokens/{src}"]
            out[f"loss/{src}"] = s[f"loss/{src}"] / n if n else float("nan")
            out[f"label_tokens/{src}"] = int(n)
        return out

    def total_norm(self, stats) -> float:
        return float(sum(stats[self.index[f"{g}_sq"]] for g in self.groups)) ** 0.5


def _mfu(s: dict, groups: list[str], cycle: float) -> dict:
    """``tflops_per_s`` (model FLOPs, every group) and, where every rank knows its peak,
    ``<group>_mfu`` and ``mfu``."""
    flops = sum(s[f"{g}_flops"] for g in groups)
    if math.isnan(flops):  # an adapter that counts no FLOPs
        return {}
    out = {"tflops_per_s": flops / cycle / 1e12}
    known = [g for g in groups if s[f"{g}_peak_flops"] > 0]  # (NaN: a rank has none)
    for g in known:
        out[f"{g}_mfu"] = s[f"{g}_flops"] / (cycle * s[f"{g}_peak_flops"])
    if known and len(known) == len(groups):
        out["mfu"] = flops / (cycle * sum(s[f"{g}_peak_flops"] for g in groups))
    return out


class StepClock:
    """Seconds a worker spends computing and waiting in a step (:meth:`span`), and the
    wall time between two stats exchanges, not counting time spent reporting
    (``excluded``)."""

    def __init__(self):
        self.last_exchange = time.perf_counter()
        self.excluded = 0.0
        self.cycles: list[float] = []
        self.compute = self.wait = 0.0
        self.trace: list | None = None  # a traced step's [action, start, end, waiting]

    def begin(self, step: int, trace_steps) -> None:
        """Start ``step`` (from 0): its actions are recorded when it is one of
        ``trace_steps`` (from 1)."""
        self.trace = [] if step + 1 in trace_steps else None

    @contextlib.contextmanager
    def span(self, waiting: bool, action=None):
        t0, wall = time.perf_counter(), time.time()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            if waiting:
                self.wait += dt
            else:
                self.compute += dt
            if self.trace is not None and action is not None:
                self.trace.append([str(action), wall, wall + dt, waiting])

    def take(self) -> tuple[float, float]:
        """``(compute, wait)`` seconds of this step so far; starts the next step at 0."""
        out = (self.compute, self.wait)
        self.compute = self.wait = 0.0
        return out

    def exchange(self, channel: Channel, stats: torch.Tensor, layout, is_timer: bool):
        now = time.perf_counter()
        cycle = layout.index["cycle"]
        if is_timer:
            stats[cycle] = now - self.last_exchange - self.excluded
        self.last_exchange, self.excluded = now, 0.0
        stats = channel.all_reduce_sum(stats)
        self.cycles.append(float(stats[cycle]))
        return stats

    @property
    def mean_step_time(self) -> float:
        """Mean step time without the first (warm-up) step."""
        steady = self.cycles[1:] or self.cycles
        return sum(steady) / len(steady)


def write_trace(w, step: int) -> None:
    """A traced step's actions (group rank 0) as one line of ``<run>/trace/<group>.jsonl``:
    ``{"step", "group", "actions": [{"action", "start", "end", "waiting"}, ...]}`` (wall
    clock seconds)."""
    trace, w.clock.trace = w.clock.trace, None
    if trace is None or w.group_rank != 0 or not w.args.metrics_path:
        return
    folder = os.path.join(os.path.dirname(w.args.metrics_path), "trace")
    keys = ("action", "start", "end", "waiting")
    line = {"step": step + 1, "group": w.part, "actions": [dict(zip(keys, a)) for a in trace]}
    try:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"{w.part}.jsonl"), "a") as f:
            f.write(json.dumps(line) + "\n")
    except OSError as e:  # a trace never stops the training
        log_line(f"{w.part}: could not write the trace of step {step + 1} ({e})")


def group_lrs(args, step: int) -> dict[str, float]:
    """``lr`` (the schedule's) and ``<group>_lr`` (times its multiplier; 0 when frozen)."""
    out = {"lr": lr_at(args.cfg, step)}
    for name, g in args.groups.items():
        frozen = name in args.frozen_parts
        out[f"{name}_lr"] = 0.0 if frozen else lr_at(args.cfg, step, g.lr_multiplier)
    return out


def is_eval_step(args, step: int) -> bool:
    """Validation runs every ``eval_every`` steps and at every checkpoint step."""
    if args.val_plan is None:
        return False
    every = args.cfg.eval_every
    return is_checkpoint_step(args.cfg, step) or (every is not None and (step + 1) % every == 0)


def is_reported_step(args, step: int) -> bool:
    """Every ``report_every`` steps, checkpoint steps and evaluation steps (``val_loss``)."""
    cfg = args.cfg
    reported = is_checkpoint_step(cfg, step) or (step + 1) % cfg.report_every == 0
    return reported or is_eval_step(args, step)


def maybe_report(
    args, stats, step: int, writer, clock: StepClock, model, optimizer, extra, background=None
):
    """On the steps every rank agrees on (each ``report_every``, evaluation and checkpoint
    steps, the last): the step's metrics, logged and appended to the metrics file by the
    LLM group's rank 0, then reported, with a checkpoint at checkpoint steps
    (:func:`ray_disagg.worker.checkpoint.maybe_save`). First an asynchronous checkpoint
    whose files every rank has written is reported."""
    t0 = time.perf_counter()
    must = is_checkpoint_step(args.cfg, step)  # the last step is one too
    checkpoint.flush(writer, ready=must or stats[args.stats.index["checkpoint_writing"]] == 0)
    if not is_reported_step(args, step):
        clock.excluded += time.perf_counter() - t0
        return
    epoch = args.plan.epoch_of(step)
    metrics = args.stats.metrics(stats, step, epoch, group_lrs(args, step), clock.mean_step_time)
    metrics.update(extra)
    if writer.module == args.adapter.llm_part and writer.lead:
        if not args.driver_progress:
            log_step(metrics, args.cfg.max_steps)
        if args.metrics_path:
            append_metrics(args.metrics_path, metrics)
    checkpoint.maybe_save(args, step, metrics, writer, model, optimizer, background)
    clock.excluded += time.perf_counter() - t0


def log_line(message: str) -> None:
    """One line on the worker's stdout, which Ray forwards to the driver once. (Ray
    Train's patched ``print`` in workers both tees to stdout and logs the message, so a
    ``print`` shows up twice.)"""
    sys.stdout.write(f"[ray_disagg] {message}\n")
    sys.stdout.flush()


def log_step(metrics: dict, max_steps: int) -> None:
    """One line per reported step, from the LLM group's rank 0 only."""
    val = f" val_loss {metrics['val_loss']:.4f}" if "val_loss" in metrics else ""
    log_line(
        f"step {metrics['step']}/{max_steps} loss {metrics['loss']:.4f}{val} "
        f"lr {metrics['lr']:.3g} grad_norm {metrics['grad_norm']:.3f} "
        f"step_time {metrics['step_time_s']:.3f}s tokens/s {metrics['tokens_per_s']:.0f}"
    )


def append_metrics(path: str, metrics: dict) -> None:
    """One JSON line per reported step (a restarted run appends the steps it redoes;
    :func:`ray_disagg.load_metrics` keeps the last line of each step)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(metrics, default=float) + "\n")


def plain(v):
    return v.item() if hasattr(v, "item") else v


def step_stats(w, run, objective_sums=None):
    """The LLM's slots; ``objective_sums``: ``[samples, *metric sums]`` of an objective."""
    stats = w.args.stats.new()
    if w.leader:
        ix = w.args.stats.index
        stats[ix["loss"]] = float(run.loss_sum)  # after the last gradients were posted
        stats[ix["label_tokens"]] = run.local_labels
        stats[ix["llm_tokens"]] = run.tokens
        stats[ix["samples"]] = len(run.items)
        stats[ix[f"{w.part}_flops"]] = run.flops
        if run.by_source is not None:
            sums = run.by_source.tolist()  # after the last gradients were posted
            for src, total, n in zip(w.args.sources, sums, run.source_labels):
                stats[ix[f"loss/{src}"]], stats[ix[f"label_tokens/{src}"]] = total, n
        if objective_sums:
            first = ix["objective_samples"]
            stats[first : first + len(objective_sums)] = torch.tensor(
                objective_sums, dtype=torch.float64
            )
    return stats


def source_index(items, sources: tuple[str, ...], device) -> torch.Tensor:
    """The source (index into ``sources``) of each item of a mixture's microbatch."""
    return torch.tensor([sources.index(it[SOURCE_KEY]) for it in items], device=device)


def label_tokens_by_source(w, items) -> list[int]:
    """The label tokens of ``items`` per source of the run's mixture (host counts)."""
    out = [0] * len(w.args.sources)
    for it in items:
        out[w.args.sources.index(it[SOURCE_KEY])] += count_label_tokens(w.adapter.labels(it))
    return out


def sample_ids(w, run) -> tuple[list, dict]:
    """The step's sample ids on this rank and, with ``report_sample_ids``, every
    replica's as the ``sample_ids`` metric (for audits)."""
    ids = [plain(it.get("id")) for it in run.ordered_items()]
    if not w.cfg.report_sample_ids:
        return ids, {}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, ids if w.leader else [], group=w.rt.object_group)
    return ids, {"sample_ids": [i for part in gathered for i in part]}


def record(w, stats, sq: float, inflight: int) -> None:
    """The group's own slots (from its rank 0) and this rank's transfer fallbacks."""
    ix, part = w.args.stats.index, w.part
    compute, wait = w.clock.take()
    if w.group_rank == 0:
        stats[ix[f"{part}_sq"]] = sq
        stats[ix[f"{part}_time"]] = compute
        stats[ix[f"{part}_wait"]] = wait
        stats[ix[f"{part}_peak"]] = memory.peak_memory_mb(w.device)
        memory.reset_peak_memory(w.device)  # the next step's peak: from here
        stats[ix[f"{part}_inflight"]] = inflight
        stats[ix[f"{part}_bwd"]] = w.backward_passes
    w.backward_passes = 0
    stats[ix[f"{part}_peak_flops"]] = math.nan if w.peak_flops is None else w.peak_flops
    stats[ix["transfer_fallbacks"]] = w.channel.fallbacks
    stats[ix["checkpoint_writing"]] = checkpoint.writing(w.writer)
    w.channel.fallbacks = 0


def placement_metrics(w, fallbacks: int) -> dict:
    """``transfer_tier``: the tiers that carried tensors between the groups this step
    (e.g. "shm", "cuda_ipc+nccl"; "gloo" joins when messages fell back to it);
    ``<group>_restarts``: how often that group alone was restarted in this attempt;
    ``<group>_standby_takeovers``: how many of those restarts its standby took (a group
    with ``standby=True``); ``<group>_workers``: its current number of workers (an
    elastic group's size); with
    ``report_placement`` also ``placement``: each worker's ``[placement group id, bundle
    index]`` as the worker saw it."""
    spec = w.channel.spec
    tiers = set(spec.tiers.values()) | ({"gloo"} if fallbacks else set())
    out = {"transfer_tier": "+".join(sorted(tiers)) or "none"}
    out.update({f"{g}_restarts": spec.restarts.get(g, 0) for g in w.args.groups})
    out.update({f"{g}_standby_takeovers": n for g, n in spec.takeovers.items()})
    out.update({f"{g}_workers": spec.sizes[g] for g in w.args.groups})
    if w.cfg.report_placement:
        out["placement"] = {
            spec.label(r): [loc.placement_group, loc.bundle] for r, loc in enumerate(spec.locations)
        }
    return out
