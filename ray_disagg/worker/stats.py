"""The stats vector every rank of every group sums once a step (:class:`StepStats`): its
slots, and the step's metrics computed from the summed vector (MFU included)."""

from __future__ import annotations

import math

import torch

__all__ = ["StepStats"]


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
    - ``<group>_{sq,time,wait,inputs,peak,inflight,bwd}``: squared grad norm, compute and
      wait seconds, of the wait the seconds spent getting the step's inputs (the reading
      group's read of its data; another group's receipt of its inputs), peak memory (MB),
      most microbatches alive at once, backward passes run, of each group, from its rank 0;
    - ``<group>_flops``: the model FLOPs of the group's samples (:mod:`ray_disagg.worker.mfu`),
      its DP leaders; ``<group>_peak_flops``: the sum of its ranks' peak FLOP/s (NaN when
      one has none), every rank of the group;
    - counters (``images``, ``videos``, ``audios``, ``tiles``): the encoder groups' DP leaders;
    - with an objective, its ``metric_names`` (each microbatch's share of the step's
      value) and ``step_metric_names`` (the step's values, from the LLM's first DP
      leader): the LLM's DP leaders;
    - a mixture's ``loss/<source>`` (summed token loss) and ``label_tokens/<source>``:
      the LLM's DP leaders.
    """

    def __init__(self, groups: list[str], counters: list[str], objective_metrics=None,
                 sources=(), reader: str | None = None):  # fmt: skip
        self.groups, self.counters = list(groups), list(counters)
        self.reader = reader or self.groups[-1]  # the group that reads the data: the LLM
        self.objective_metrics = objective_metrics  # None: no objective (SFT)
        self.sources = tuple(sources)
        names = ["loss", "label_tokens", "llm_tokens", "samples", "cycle", "transfer_fallbacks"]
        names += ["checkpoint_writing"]
        per_group = ("sq", "time", "wait", "inputs", "peak", "inflight", "bwd", "flops",
                     "peak_flops")  # fmt: skip
        names += [f"{g}_{k}" for g in groups for k in per_group]
        names += list(counters)
        if objective_metrics is not None:
            names += list(objective_metrics)
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
        read = s[f"{self.reader}_inputs"]
        for g in self.groups:
            # waiting for the inputs counts as data wait while the reader read them
            data = min(s[f"{g}_inputs"], read)
            out[f"{g}_grad_norm"] = s[f"{g}_sq"] ** 0.5
            out[f"{g}_compute_s"] = s[f"{g}_time"]
            out[f"{g}_wait_s"] = max(s[f"{g}_wait"] - data, 0.0)
            out[f"{g}_data_wait_s"] = data
            out[f"{g}_peak_memory_mb"] = s[f"{g}_peak"]
            out[f"{g}_max_in_flight"] = int(s[f"{g}_inflight"])
            out[f"{g}_backward_passes"] = int(s[f"{g}_bwd"])
        out.update(_mfu(s, self.groups, cycle))
        out.update({c: int(s[c]) for c in self.counters})
        if self.objective_metrics is not None:
            out.update({m: s[m] for m in self.objective_metrics})
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
