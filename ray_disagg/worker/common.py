"""Pieces shared by the encoder and LLM training loops: optimizer, global clipping, the
per-step stats exchange, metrics, checkpoints and ``ray.train.report``."""

from __future__ import annotations

import functools
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass

import ray.train
import torch

from ray_disagg.config import ModuleGroup, TrainLoopConfig
from ray_disagg.lr_schedule import lr_at
from ray_disagg.model import HFModelSpec
from ray_disagg.pipeline.assignment import BatchPlan
from ray_disagg.transport.channel import SideGroup
from ray_disagg.worker.memory import peak_memory_mb, reset_peak_memory  # noqa: F401 - moved


class StatsLayout:
    """Slots of the float64 vector every rank all-reduces (SUM) over the side group once a
    step. Each slot is filled by exactly one rank (or by one rank per data-parallel
    replica for the batch sums); the others give 0.

    - ``loss``, ``label_tokens``, ``llm_tokens``: the LLM group's data-parallel leaders;
    - ``cycle``: wall seconds since the previous exchange, the LLM group's rank 0;
    - ``transfer_fallbacks``: tensor messages sent over gloo instead of their planned tier
      (e.g. a full /dev/shm), every rank;
    - ``<group>_{sq,time,wait,peak,inflight,bwd}``: squared grad norm, compute and wait
      seconds, peak memory (MB), most microbatches alive at once, backward passes run, of
      each group, from its rank 0;
    - counters (``images``, ``videos``, ``audios``): the encoder groups' DP leaders.
    """

    def __init__(self, groups: list[str], counters: list[str]):
        self.groups, self.counters = list(groups), list(counters)
        names = ["loss", "label_tokens", "llm_tokens", "cycle", "transfer_fallbacks"]
        per_group = ("sq", "time", "wait", "peak", "inflight", "bwd")
        names += [f"{g}_{k}" for g in groups for k in per_group]
        names += list(counters)
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
        out.update({c: int(s[c]) for c in self.counters})
        return out

    def total_norm(self, stats) -> float:
        return float(sum(stats[self.index[f"{g}_sq"]] for g in self.groups)) ** 0.5


@dataclass
class LoopArgs:
    """Everything a worker's loop needs (pickled into the train function)."""

    spec: HFModelSpec
    cfg: TrainLoopConfig
    groups: dict[str, ModuleGroup]  # in the adapter's part order, the LLM part last
    plan: BatchPlan
    dataset_ref: list | None = None  # [ObjectRef]: a list keeps Ray from resolving it early
    resume_from_checkpoint: object = None
    samples_validated: bool = False  # the driver checked every sample before the run
    metrics_path: str | None = None  # <run dir>/metrics.jsonl: every reported step
    frozen_parts: tuple[str, ...] = ()  # groups whose parameters are all frozen
    val_ref: list | None = None  # [ObjectRef] of the map-style validation samples
    val_plan: BatchPlan | None = None

    @property
    def adapter(self):
        return self.spec.adapter

    @functools.cached_property
    def stats(self) -> StatsLayout:
        a = self.adapter
        counters = [c for p in a.encoder_parts for c in a.counter_names(p)]
        return StatsLayout(list(self.groups), counters)

    def leader_side_rank(self, side, group: str, dp_rank: int) -> int:
        """Side rank of the model-parallel rank 0 of replica ``dp_rank`` of ``group``."""
        return side.rank_of(group, dp_rank * self.groups[group].model_parallel_size)


class NoOptimizer:
    """The optimizer of a group with nothing to train (every parameter frozen)."""

    state: dict = {}
    param_groups: list = []

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: TrainLoopConfig, zero1: bool):
    """AdamW; with ``zero1`` its state is sharded over the default (whole group's) process
    group by ``ZeroRedundancyOptimizer`` (each rank updates its shard, then broadcasts).
    No trainable parameter: :class:`NoOptimizer`. The learning rate is set every step
    (:func:`set_lr`)."""
    params = list(params)
    if not params:
        return NoOptimizer()
    kwargs = {"lr": cfg.lr, "betas": cfg.betas, "eps": cfg.eps, "weight_decay": cfg.weight_decay}
    if zero1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(list(params), optimizer_class=torch.optim.AdamW, **kwargs)
    return torch.optim.AdamW(list(params), **kwargs)


def set_lr(optimizer, cfg: TrainLoopConfig, step: int, multiplier: float) -> float:
    """The scheduled learning rate of ``step`` times the group's multiplier, set on every
    parameter group (ZeRO-1 copies it into its local optimizer on ``step()``)."""
    lr = lr_at(cfg, step, multiplier)
    for g in optimizer.param_groups:
        g["lr"] = lr
    return lr


def group_lrs(args: LoopArgs, step: int) -> dict[str, float]:
    """``lr`` (the schedule's) and ``<group>_lr`` (times its multiplier; 0 when frozen)."""
    out = {"lr": lr_at(args.cfg, step)}
    for name, g in args.groups.items():
        frozen = name in args.frozen_parts
        out[f"{name}_lr"] = 0.0 if frozen else lr_at(args.cfg, step, g.lr_multiplier)
    return out


def is_eval_step(args: LoopArgs, step: int) -> bool:
    """Validation runs every ``eval_every`` steps and at every checkpoint step."""
    if args.val_plan is None:
        return False
    every = args.cfg.eval_every
    return is_checkpoint_step(args.cfg, step) or (every is not None and (step + 1) % every == 0)


def is_checkpoint_step(cfg: TrainLoopConfig, step: int) -> bool:
    last = step == cfg.max_steps - 1
    return last or (cfg.checkpoint_every is not None and (step + 1) % cfg.checkpoint_every == 0)


def is_reported_step(args: LoopArgs, step: int) -> bool:
    """Every ``report_every`` steps, checkpoint steps and evaluation steps (``val_loss``)."""
    cfg = args.cfg
    reported = is_checkpoint_step(cfg, step) or (step + 1) % cfg.report_every == 0
    return reported or is_eval_step(args, step)


def clip_coef(total_norm: float, max_norm: float | None) -> float:
    """``torch.nn.utils.clip_grad_norm_``'s coefficient, clamped to 1."""
    if max_norm is None:
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))


@torch.no_grad()
def scale_grads(params: Iterable[torch.nn.Parameter], coef: float) -> None:
    if coef < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)


class StepTimer:
    """Wall time between two stats exchanges, not counting time spent in reporting."""

    def __init__(self):
        self.last_exchange = time.perf_counter()
        self.excluded = 0.0
        self.cycles: list[float] = []

    def exchange(self, side: SideGroup, stats: torch.Tensor, layout, is_timer: bool):
        now = time.perf_counter()
        cycle = layout.index["cycle"]
        if is_timer:
            stats[cycle] = now - self.last_exchange - self.excluded
        self.last_exchange, self.excluded = now, 0.0
        stats = side.all_reduce_sum(stats)
        self.cycles.append(float(stats[cycle]))
        return stats

    @property
    def mean_step_time(self) -> float:
        """Mean step time without the first (warm-up) step."""
        steady = self.cycles[1:] or self.cycles
        return sum(steady) / len(steady)


@dataclass
class ShardWriter:
    """Writes this rank's part of a checkpoint into ``<root>/<module>/``: its DCP shard
    (every rank, see ``checkpointing``); on the group's rank 0 (``lead``) also
    ``trainer_state.json`` and, when ``hf_config`` is set, the HF ``config.json`` at the top."""

    module: str
    lead: bool
    hf_config: object = None
    cfg: TrainLoopConfig | None = None

    def write(self, root: str, step: int, model, optimizer) -> None:
        from ray_disagg.worker import checkpoint as checkpointing

        d = os.path.join(root, self.module)
        checkpointing.save_sharded(model, optimizer, d)
        if self.lead:
            state = {"step": step + 1}
            if self.cfg is not None:  # the schedule is a function of the step
                keys = ("lr", "lr_schedule", "warmup_steps", "min_lr_ratio", "max_steps")
                state["lr_schedule"] = {k: getattr(self.cfg, k) for k in keys}
                state["next_lr"] = lr_at(self.cfg, step + 1)
            with open(os.path.join(d, "trainer_state.json"), "w") as f:
                json.dump(state, f)
            if self.hf_config is not None:
                self.hf_config.save_pretrained(root)


def report(metrics: dict, step: int, *, writer: ShardWriter, model=None, optimizer=None) -> None:
    """``ray.train.report`` on every rank; with a ``model`` (a checkpoint step) every rank
    writes its shard and uploads it into the shared directory ``checkpoint_<step>``."""
    if model is None:
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory() as tmp:
        writer.write(tmp, step, model, optimizer)
        ray.train.report(
            metrics,
            checkpoint=ray.train.Checkpoint.from_directory(tmp),
            checkpoint_dir_name=f"checkpoint_{step + 1:06d}",
        )


def maybe_report(
    args: LoopArgs,
    stats,
    step: int,
    writer,
    timer: StepTimer,
    model,
    optimizer,
    extra_metrics: dict | None = None,
) -> None:
    """Report on the steps every rank agrees on: each ``report_every``, checkpoints, last.

    At checkpoint steps every rank first joins the collectives that gather the model
    (tensor parallel) and the optimizer state (ZeRO-1)."""
    cfg = args.cfg
    ckpt = is_checkpoint_step(cfg, step)
    if is_reported_step(args, step):
        t0 = time.perf_counter()
        epoch = step // args.plan.steps_per_epoch
        lrs = group_lrs(args, step)
        metrics = args.stats.metrics(stats, step, epoch, lrs, timer.mean_step_time)
        metrics.update(extra_metrics or {})
        if writer.module == args.adapter.llm_part and writer.lead:
            log_step(metrics, cfg.max_steps)
        if args.metrics_path and writer.lead and writer.module == args.adapter.llm_part:
            append_metrics(args.metrics_path, metrics)
        if ckpt:
            report(metrics, step, writer=writer, model=model, optimizer=optimizer)
        else:
            report(metrics, step, writer=writer)
        timer.excluded += time.perf_counter() - t0


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


def _schedule_note(module_dir: str, cfg: TrainLoopConfig) -> str | None:
    """A message when the checkpoint was trained under another lr schedule."""
    with open(os.path.join(module_dir, "trainer_state.json")) as f:
        saved = json.load(f).get("lr_schedule")
    if not saved:
        return None
    now = {k: getattr(cfg, k) for k in saved}
    if now == saved:
        return None
    diff = ", ".join(f"{k}: {saved[k]!r} -> {now[k]!r}" for k in saved if saved[k] != now[k])
    return (
        f"resuming under a different learning-rate schedule ({diff}); from here the lr "
        "follows this run's settings (ray_disagg.lr_at), so it may jump."
    )


def restore(model, optimizer, module: str, args: LoopArgs, log=None) -> int:
    """Load the latest checkpoint of this run (Ray Train hands it to restarted workers)
    or ``resume_from_checkpoint``; returns the step to start from. ``log`` gets a note
    when the checkpoint's lr schedule differs from this run's."""
    from ray_disagg.worker import checkpoint as checkpointing

    ckpt = ray.train.get_checkpoint() or args.resume_from_checkpoint
    if ckpt is None:
        return 0
    with ckpt.as_directory() as root:
        checkpointing.check_compatible(root, args.spec.load_config(), args.cfg.max_steps)
        module_dir = os.path.join(root, module)
        if not checkpointing.load_sharded(model, optimizer, module_dir):
            model_state, optimizer_state = checkpointing.read_full(module_dir)
            checkpointing.load_model(model, model_state)
            checkpointing.load_optimizer(optimizer, model, optimizer_state)
        note = _schedule_note(module_dir, args.cfg)
        if note and log is not None:
            log(f"{module}: {note}")
        return checkpointing.trained_steps(module_dir)


def maybe_inject_failure(
    cfg: TrainLoopConfig, module: str, group_rank: int, step: int, micro_batch: int | None = None
) -> None:
    """Fault drill: ``extra={"inject_failure_once": {"group", "step", "marker"[, "rank",
    "kill", "micro_batch"]}}`` kills that worker's process at the start of that step (or
    of that microbatch of it), once (the marker
    file records that it happened), to exercise ``FailureConfig`` restarts; with
    ``"kill": "coordinator"`` that worker kills the coordinator instead."""
    drill = cfg.extra.get("inject_failure_once")
    if not drill or drill["group"] != module or drill["step"] != step:
        return
    if drill.get("micro_batch") != micro_batch:
        return
    if group_rank == drill.get("rank", 0) and not os.path.exists(drill["marker"]):
        with open(drill["marker"], "w") as f:
            f.write(f"{module} rank {group_rank} killed at step {step}\n")
        if drill.get("kill") == "coordinator":  # the controller actor, not this worker
            from ray_disagg.launch.ray_compat import kill_controller

            kill_controller()
            time.sleep(600)  # dies with its owner, the coordinator
        os._exit(1)
