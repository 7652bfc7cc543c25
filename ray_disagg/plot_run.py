"""``ray-disagg plot RUN_DIR``: the pictures of a run (needs the ``plot`` extra):

- ``loss_curve.png``: :func:`ray_disagg.plotting.plot_metrics`;
- ``reward_curve.png`` (GRPO): the mean reward of each step's completions and, with
  validation prompts, ``eval_reward``;
- ``step_times.png``: per step, each group's compute and wait seconds stacked (its
  ``<group>_compute_s`` and ``<group>_wait_s`` metrics), the step time as a line;
- ``timeline_step<N>.png`` for each step traced with ``train_loop_config["trace_steps"]``
  (``<run>/trace/``, :mod:`ray_disagg.run_files`):
  each group's rank-0 actions of the schedule (``ray_disagg.pipeline.schedule``) as bars
  from their measured start to end on one time axis, waits (receives, sends' delivery)
  hatched: which group waits for which, and where the bubble is.
"""

from __future__ import annotations

import os

from ray_disagg.plotting import plot_metrics
from ray_disagg.run_files import RunDir, read_traces
from ray_disagg.trainer import load_metrics

__all__ = ["plot_run", "read_traces"]

_COLORS = {"forward": "tab:blue", "backward": "tab:orange", "train": "tab:green"}


def plot_run(run_dir: str, out_dir: str | None = None) -> list[str]:
    """Write the run's pictures (see the module docstring) into ``out_dir`` (default: the
    run directory when it is local, else ``./<run name>``); returns their paths.
    ``run_dir``: a local path or a URI of any storage a run can use (``s3://...``).

    Example:
        >>> paths = plot_run("/tmp/ray_disagg_runs/tiny-vlm")  # doctest: +SKIP
    """
    run = RunDir.of(run_dir)
    out_dir = out_dir or run.local_path or os.path.basename(run.path.rstrip("/"))
    os.makedirs(out_dir, exist_ok=True)
    paths = [plot_metrics(run, os.path.join(out_dir, "loss_curve.png"))]
    df = load_metrics(run)
    if "reward" in df.columns:
        keys = ("reward", "eval_reward")
        paths.append(plot_metrics(run, os.path.join(out_dir, "reward_curve.png"), keys))
    groups = [c.removesuffix("_compute_s") for c in df.columns if c.endswith("_compute_s")]
    if groups:
        paths.append(_step_times(df, groups, os.path.join(out_dir, "step_times.png")))
    for step, actions in sorted(read_traces(run).items()):
        paths.append(_timeline(step, actions, os.path.join(out_dir, f"timeline_step{step}.png")))
    return paths


def _figure(height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8.0, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _step_times(df, groups: list[str], path: str) -> str:
    fig = _figure(4.0)
    ax = fig.add_subplot()
    width = 0.8 / len(groups)
    for k, g in enumerate(groups):
        x = df["step"] + (k - (len(groups) - 1) / 2) * width
        compute = df[f"{g}_compute_s"].fillna(0.0)
        wait = df[f"{g}_wait_s"].fillna(0.0) if f"{g}_wait_s" in df else 0.0 * compute
        ax.bar(x, compute, width, label=f"{g} compute")
        ax.bar(x, wait, width, bottom=compute, label=f"{g} wait", alpha=0.4, hatch="//")
    if "step_time_s" in df:
        ax.plot(df["step"], df["step_time_s"], "k.-", label="step time")
    ax.set_xlabel("step")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("seconds")
    ax.legend(fontsize="small")
    ax.set_title("compute and wait per group")
    fig.savefig(path, dpi=120)
    return path


def _timeline(step: int, actions: dict[str, list[dict]], path: str) -> str:
    fig = _figure(1.0 + 0.8 * len(actions))
    ax = fig.add_subplot()
    t0 = min(a["start"] for acts in actions.values() for a in acts)
    span = max(a["end"] for acts in actions.values() for a in acts) - t0
    for row, (_, acts) in enumerate(sorted(actions.items())):
        for a in acts:
            kind = a["action"].split("(")[0]
            left, width = a["start"] - t0, max(a["end"] - a["start"], 1e-6)
            color = "lightgray" if a["waiting"] else _COLORS.get(kind, "tab:purple")
            ax.barh(row, width, left=left, height=0.6, color=color, edgecolor="black",
                    linewidth=0.3, hatch="//" if a["waiting"] else None)  # fmt: skip
            if width > 0.04 * span:  # wide enough for its name
                ax.text(left + width / 2, row, a["action"], ha="center", va="center", fontsize=6)
    ax.set_yticks(range(len(actions)), sorted(actions))
    ax.set_xlabel("seconds from the step's first action")
    ax.set_title(f"step {step}: each group's rank 0 (waits hatched)")
    fig.savefig(path, dpi=120)
    return path
