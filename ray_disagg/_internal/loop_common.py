"""Pieces shared by the vision and text training loops: optimizer, global clipping, the
per-step stats exchange, metrics, checkpoints and ``ray.train.report``."""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass

import ray.train
import torch

from ray_disagg._internal.side_group import SideGroup
from ray_disagg.config import ModuleGroup, TrainLoopConfig
from ray_disagg.data import BatchPlan
from ray_disagg.model import Qwen2_5_VLSpec

# Layout of the float64 vector that every rank all-reduces (SUM) over the side group once a
# step. Each slot is filled by exactly the ranks named in the comment, others give 0.
VISION_SQ, TEXT_SQ = 0, 1  # squared grad norm: each group's rank 0
LOSS, LABEL_TOKENS, TEXT_TOKENS = 2, 3, 4  # text data-parallel leaders
VISION_TIME, TEXT_TIME = 5, 6  # compute seconds: each group's rank 0
IMAGES = 7  # vision data-parallel leaders
VISION_WAIT, TEXT_WAIT = 8, 9  # seconds blocked on the other group: each group's rank 0
CYCLE_TIME = 10  # wall seconds since the previous step's exchange: vision rank 0
VISION_PEAK_MB, TEXT_PEAK_MB = 11, 12  # peak memory of the process: each group's rank 0
NUM_STATS = 13


def peak_memory_mb(device: torch.device) -> float:
    """Peak GPU memory allocated on CUDA; peak resident set size of the process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@dataclass
class LoopArgs:
    """Everything a worker's loop needs (pickled into the train function)."""

    spec: Qwen2_5_VLSpec
    cfg: TrainLoopConfig
    vision: ModuleGroup
    text: ModuleGroup
    plan: BatchPlan
    image_token_id: int
    spatial_merge_size: int
    text_hidden: int
    dataset_ref: list | None = None  # [ObjectRef]: a list keeps Ray from resolving it early
    resume_from_checkpoint: object = None
    samples_validated: bool = False  # the driver checked every sample before the run


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: TrainLoopConfig, zero1: bool):
    """AdamW; with ``zero1`` its state is sharded over the default (whole group's) process
    group by ``ZeroRedundancyOptimizer`` (each rank updates its shard, then broadcasts)."""
    kwargs = {"lr": cfg.lr, "betas": cfg.betas, "eps": cfg.eps, "weight_decay": cfg.weight_decay}
    if zero1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(list(params), optimizer_class=torch.optim.AdamW, **kwargs)
    return torch.optim.AdamW(list(params), **kwargs)


def is_checkpoint_step(cfg: TrainLoopConfig, step: int) -> bool:
    last = step == cfg.max_steps - 1
    return last or (cfg.checkpoint_every is not None and (step + 1) % cfg.checkpoint_every == 0)


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

    def exchange(self, side: SideGroup, stats: torch.Tensor, is_vision_rank0: bool) -> torch.Tensor:
        now = time.perf_counter()
        if is_vision_rank0:
            stats[CYCLE_TIME] = now - self.last_exchange - self.excluded
        self.last_exchange, self.excluded = now, 0.0
        stats = side.all_reduce_sum(stats)
        self.cycles.append(float(stats[CYCLE_TIME]))
        return stats

    @property
    def mean_step_time(self) -> float:
        """Mean step time without the first (warm-up) step."""
        steady = self.cycles[1:] or self.cycles
        return sum(steady) / len(steady)


def new_stats() -> torch.Tensor:
    return torch.zeros(NUM_STATS, dtype=torch.float64)


def metrics_from_stats(
    stats: torch.Tensor, step: int, epoch: int, lr: float, mean_step_time: float
) -> dict:
    s = stats.tolist()
    cycle = max(s[CYCLE_TIME], 1e-9)
    return {
        "step": step + 1,
        "epoch": epoch,
        "loss": s[LOSS],
        "grad_norm": (s[VISION_SQ] + s[TEXT_SQ]) ** 0.5,
        "vision_grad_norm": s[VISION_SQ] ** 0.5,
        "text_grad_norm": s[TEXT_SQ] ** 0.5,
        "lr": lr,
        "label_tokens": int(s[LABEL_TOKENS]),
        "images": int(s[IMAGES]),
        "step_time_s": s[CYCLE_TIME],
        "mean_step_time_s": mean_step_time,
        "tokens_per_s": s[TEXT_TOKENS] / cycle,
        "vision_compute_s": s[VISION_TIME],
        "text_compute_s": s[TEXT_TIME],
        "vision_wait_s": s[VISION_WAIT],
        "text_wait_s": s[TEXT_WAIT],
        "vision_peak_memory_mb": s[VISION_PEAK_MB],
        "text_peak_memory_mb": s[TEXT_PEAK_MB],
    }


@dataclass
class ShardWriter:
    """Writes this rank's part of a checkpoint into ``<root>/<module>/``: its DCP shard
    (every rank, see ``checkpointing``); on the group's rank 0 (``lead``) also
    ``trainer_state.json`` and, when ``hf_config`` is set, the HF ``config.json`` at the top."""

    module: str
    lead: bool
    hf_config: object = None

    def write(self, root: str, step: int, model, optimizer) -> None:
        from ray_disagg._internal import checkpointing

        d = os.path.join(root, self.module)
        checkpointing.save_sharded(model, optimizer, d)
        if self.lead:
            with open(os.path.join(d, "trainer_state.json"), "w") as f:
                json.dump({"step": step + 1}, f)
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
    cfg: TrainLoopConfig,
    steps_per_epoch: int,
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
    ckpt = is_checkpoint_step(cfg, step)
    if ckpt or (step + 1) % cfg.report_every == 0:
        t0 = time.perf_counter()
        metrics = metrics_from_stats(
            stats, step, step // steps_per_epoch, cfg.lr, timer.mean_step_time
        )
        metrics.update(extra_metrics or {})
        if writer.module == "vision" and writer.lead:
            print(
                f"[ray_disagg] step {step + 1}/{cfg.max_steps} loss {metrics['loss']:.4f} "
                f"grad_norm {metrics['grad_norm']:.3f} step_time {metrics['step_time_s']:.3f}s "
                f"tokens/s {metrics['tokens_per_s']:.0f}",
                flush=True,
            )
        if ckpt:
            report(metrics, step, writer=writer, model=model, optimizer=optimizer)
        else:
            report(metrics, step, writer=writer)
        timer.excluded += time.perf_counter() - t0


def restore(model, optimizer, module: str, args: LoopArgs) -> int:
    """Load the latest checkpoint of this run (Ray Train hands it to restarted workers)
    or ``resume_from_checkpoint``; returns the step to start from."""
    from ray_disagg._internal import checkpointing

    ckpt = ray.train.get_checkpoint() or args.resume_from_checkpoint
    if ckpt is None:
        return 0
    with ckpt.as_directory() as root:
        module_dir = os.path.join(root, module)
        model_state, optimizer_state = checkpointing.read_full(module_dir)
        checkpointing.load_model(model, model_state)
        checkpointing.load_optimizer(optimizer, model, optimizer_state)
        return checkpointing.trained_steps(module_dir)


def maybe_inject_failure(cfg: TrainLoopConfig, module: str, group_rank: int, step: int) -> None:
    """Fault drill: ``extra={"inject_failure_once": {"group", "step", "marker"[, "rank"]}}``
    kills that worker's process at the start of that step, once (the marker file records
    that it happened), to exercise ``FailureConfig`` restarts."""
    drill = cfg.extra.get("inject_failure_once")
    if not drill or drill["group"] != module or drill["step"] != step:
        return
    if group_rank == drill.get("rank", 0) and not os.path.exists(drill["marker"]):
        with open(drill["marker"], "w") as f:
            f.write(f"{module} rank {group_rank} killed at step {step}\n")
        os._exit(1)
