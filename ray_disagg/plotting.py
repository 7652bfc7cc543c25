"""A run's pictures, drawn from its files (:mod:`ray_disagg.run_files`; needs the ``plot``
extra: ``pip install 'ray_disagg[plot]'``, i.e. matplotlib): :func:`plot_metrics`, the
curves of any reported metrics, and :func:`plot_run`, what ``ray-disagg plot RUN_DIR``
writes:

- ``loss_curve.png``: :func:`ray_disagg.plotting.plot_metrics`;
- ``reward_curve.png`` (a run with TRL's reward metrics; none for SFT): DPO's implicit
  rewards of the chosen and rejected completions and their margin, the pairs' accuracy
  on a second panel; GRPO's mean reward of each step's completions with a band of one
  ``reward_std``, each reward function's mean and, with validation prompts,
  ``eval_reward``;
- ``step_times.png``: per step, each group's compute, data wait and wait seconds stacked
  (its ``<group>_compute_s``, ``<group>_data_wait_s``: waiting for the step's input data,
  and ``<group>_wait_s``: waiting for other groups), the step time as a line;
- ``timeline_step<N>.png`` for each step traced with ``train_loop_config["trace_steps"]``
  (``<run>/trace/``, :mod:`ray_disagg.run_files`):
  each group's rank-0 actions of the schedule (``ray_disagg.pipeline.schedule``) as bars
  from their measured start to end on one time axis, waits (receives, sends' delivery)
  hatched: which group waits for which, and where the bubble is.
"""

from __future__ import annotations

import math
import os
import posixpath
import re
from collections.abc import Sequence

from ray_disagg.run_files import RunDir, load_metrics, read_traces

__all__ = ["plot_metrics", "plot_run"]


def plot_metrics(source, path, keys: Sequence[str] | str = ("loss", "val_loss")) -> str:
    """Plot every reported step of a run, one line per metric in ``keys`` against ``step``,
    into the image file ``path`` (PNG, or any format matplotlib infers from the suffix).
    Returns ``path``.

    ``source`` is what :func:`ray_disagg.load_metrics` reads: a ``ray.train.Result``, a run
    directory (a local path or a URI: ``s3://...``) or its ``metrics.jsonl``. Keys the run
    did not report are left out (e.g. ``val_loss`` without a validation set); steps without
    a value for a key (``val_loss`` is computed only every few steps) are skipped for that
    key. A ``ValueError`` when none of ``keys`` was reported.

    Uses matplotlib's Agg canvas directly: no display is needed and pyplot's global state
    (the backend of a notebook, open figures) is left alone.

    Example:
        >>> import json, os, tempfile
        >>> from ray_disagg.plotting import plot_metrics
        >>> run_dir = tempfile.mkdtemp()
        >>> with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        ...     for step, loss in [(1, 6.2), (2, 4.1), (3, 2.9)]:
        ...         _ = f.write(json.dumps({"step": step, "loss": loss}) + "\\n")
        >>> png = plot_metrics(run_dir, os.path.join(run_dir, "loss_curve.png"))
        >>> os.path.getsize(png) > 0
        True

        After ``result = DisaggregatedTrainer(...).fit()``, next to the checkpoints:

        >>> plot_metrics(result, os.path.join(result.path, "loss_curve.png"))  # doctest: +SKIP
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(
            "ray_disagg.plotting.plot_metrics needs matplotlib: install the 'plot' extra, "
            "pip install 'ray_disagg[plot]' (or pip install matplotlib)."
        ) from e

    keys = (keys,) if isinstance(keys, str) else tuple(keys)
    df = load_metrics(source)
    present = [k for k in keys if k in df.columns and df[k].notna().any()]
    if "step" not in df.columns or not present:
        raise ValueError(
            f"No metric of {list(keys)} was reported in {_describe(source)}; "
            f"reported: {sorted(df.columns)}."
        )

    fig = Figure(figsize=(6.4, 4.0), layout="constrained")
    FigureCanvasAgg(fig)  # attaches itself to fig: savefig renders with Agg
    _draw(fig.add_subplot(), df, present, _describe(source))
    path = os.fspath(path)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


def _draw(ax, df, present: list[str], title: str) -> None:
    """One line per metric of ``present`` against ``step`` (log scale for a loss falling
    by orders of magnitude)."""
    for key in present:
        _curve(ax, df, key, key)
    ax.set_xlabel("step")
    ax.set_ylabel("loss" if all(k.endswith("loss") for k in present) else ", ".join(present))
    finite = [v for k in present for v in df[k].dropna() if math.isfinite(v)]
    if finite and min(finite) > 0 and max(finite) / min(finite) > 100:
        ax.set_yscale("log")  # a loss falling by orders of magnitude
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title(title)


def _describe(source) -> str:
    """The run's name for titles and messages: its directory's name (on any storage)."""
    path = RunDir.of(source).path.rstrip("/")
    return posixpath.basename(path) or path


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
    rewards = _rewards(df, os.path.join(out_dir, "reward_curve.png"))
    if rewards is not None:
        paths.append(rewards)
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


_STACK = (  # a group's seconds in a step, bottom up: metric, legend label, bar style
    ("compute_s", "compute", {}),
    ("data_wait_s", "data wait", {"alpha": 0.6, "hatch": "xx"}),
    ("wait_s", "wait", {"alpha": 0.4, "hatch": "//"}),
)


def _stack(df, group: str) -> list[tuple[str, object, dict]]:
    """``group``'s stacked segments ``(label, seconds per step, bar style)``: those the
    run reported (one from before ``data_wait_s`` has no data wait)."""
    return [
        (label, df[f"{group}_{metric}"].fillna(0.0), style)
        for metric, label, style in _STACK
        if f"{group}_{metric}" in df
    ]


def _step_times(df, groups: list[str], path: str) -> str:
    fig = _figure(4.0)
    ax = fig.add_subplot()
    width = 0.8 / len(groups)
    for k, g in enumerate(groups):
        x = df["step"] + (k - (len(groups) - 1) / 2) * width
        bottom = 0.0 * df["step"]
        for label, seconds, style in _stack(df, g):
            ax.bar(x, seconds, width, bottom=bottom, label=f"{g} {label}", **style)
            bottom = bottom + seconds
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


_DPO_CURVES = ("rewards/chosen", "rewards/rejected", "rewards/margins")
_PER_FUNCTION = re.compile(r"rewards/(.+)/mean")


def _rewards(df, path: str) -> str | None:
    """``reward_curve.png`` of a run with TRL's reward metrics (DPO's implicit rewards, or
    GRPO's ``reward``), else ``None`` (nothing drawn)."""
    if any(k in df and df[k].notna().any() for k in _DPO_CURVES):
        return _dpo_rewards(df, path)
    if "reward" in df and df["reward"].notna().any():
        return _grpo_rewards(df, path)
    return None


def _curve(ax, df, key: str, label: str, **style) -> None:
    """``key`` against ``step`` where reported (the points shown in a short run)."""
    rows = df[["step", key]].dropna()
    ax.plot(rows["step"], rows[key], marker="o" if len(rows) <= 30 else None, markersize=3,
            label=label, **style)  # fmt: skip


def _dpo_rewards(df, path: str) -> str:
    """DPO: the chosen and rejected completions' implicit rewards and their margin on one
    panel, the share of pairs ranked right (``rewards/accuracies``) below."""
    fig = _figure(5.5)
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[2, 1])
    for key in (k for k in _DPO_CURVES if k in df):
        _curve(top, df, key, key.removeprefix("rewards/"))
    top.axhline(0.0, color="gray", linewidth=0.5)
    top.set_ylabel("reward (beta x log-ratio)")
    top.legend(fontsize="small")
    top.set_title("DPO rewards")
    if "rewards/accuracies" in df:
        _curve(bottom, df, "rewards/accuracies", "accuracy", color="tab:green")
    bottom.set_ylim(-0.05, 1.05)
    bottom.set_ylabel("accuracy")
    bottom.set_xlabel("step")
    bottom.xaxis.get_major_locator().set_params(integer=True)
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
    fig.savefig(path, dpi=120)
    return path


def _grpo_rewards(df, path: str) -> str:
    """GRPO: the mean reward of each step's completions with a band of one ``reward_std``
    either side, each reward function's mean and, with validation prompts,
    ``eval_reward``."""
    fig = _figure(4.0)
    ax = fig.add_subplot()
    _curve(ax, df, "reward", "reward", color="black", zorder=3)  # over a function's own mean
    if "reward_std" in df:
        rows = df[["step", "reward", "reward_std"]].dropna()
        low, high = rows["reward"] - rows["reward_std"], rows["reward"] + rows["reward_std"]
        ax.fill_between(rows["step"], low, high, color="gray", alpha=0.25, label="± reward_std")
    for key in df.columns:
        name = _PER_FUNCTION.fullmatch(key)
        if name and df[key].notna().any():
            _curve(ax, df, key, name.group(1), linestyle="--", linewidth=1.0)
    if "eval_reward" in df and df["eval_reward"].notna().any():
        _curve(ax, df, "eval_reward", "eval_reward", color="tab:red")
    ax.set_xlabel("step")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("reward")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    ax.set_title("GRPO rewards")
    fig.savefig(path, dpi=120)
    return path
