"""Loss curves of a ``DisaggregatedTrainer`` run as an image (needs the ``plot`` extra:
``pip install 'ray_disagg[plot]'``, i.e. matplotlib)."""

from __future__ import annotations

import math
import os
import posixpath
from collections.abc import Sequence

from ray_disagg.run_files import RunDir
from ray_disagg.trainer import load_metrics

__all__ = ["plot_metrics"]


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
        rows = df[["step", key]].dropna()
        few = len(rows) <= 30  # show the points of a short run
        ax.plot(rows["step"], rows[key], marker="o" if few else None, markersize=3, label=key)
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
