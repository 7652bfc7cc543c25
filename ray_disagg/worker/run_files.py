"""The files a run keeps beside its checkpoints: ``metrics.jsonl``, one line per reported
step (the trace files of traced steps: :mod:`ray_disagg.worker.clock`)."""

from __future__ import annotations

import json
import os

__all__ = ["append_metrics"]


def append_metrics(path: str, metrics: dict) -> None:
    """One JSON line per reported step (a restarted run appends the steps it redoes;
    :func:`ray_disagg.load_metrics` keeps the last line of each step)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(metrics, default=float) + "\n")
