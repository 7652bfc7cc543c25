"""The driver's side of a training mixture (:mod:`ray_disagg.data.mixture`): the draws a
run can take, each source scanned once (validation, costs, sizes) and expanded to the
draws, and the check that a resumed run trains the mixture its checkpoint was made with."""

from __future__ import annotations

import json
import os

import numpy as np

from ray_disagg.data.mixture import Mixture
from ray_disagg.worker.shards import MIXTURE

__all__ = ["check_mixture_resume", "draws", "scan_mixture"]


def draws(cfg) -> int:
    """The draws a run's plan covers: a step takes at most ``global_batch_size``, and a
    budget's last waiting samples need room (one step more)."""
    return (cfg.max_steps + 1) * cfg.global_batch_size


def scan_mixture(mixture: Mixture, scan, n: int):
    """``scan(source, name)`` of each source once (``(costs, sizes)`` per sample, or
    ``(None, None)``), as per-draw arrays of the first ``n`` draws."""
    src, index = mixture.locate(np.arange(n))
    scanned = {name: scan(mixture.sources[name], name) for name in mixture.names}
    first = scanned[mixture.names[0]]
    costs = None if first[0] is None else _expand(scanned, 0, mixture.names, src, index)
    sizes = None if first[1] is None else _expand(scanned, 1, mixture.names, src, index)
    return costs, sizes


def _expand(scanned: dict, which: int, names, src, index) -> dict:
    """The per-sample columns ``scanned[name][which]`` taken at each draw."""
    out = {}
    for key in scanned[names[0]][which]:
        columns = [scanned[name][which][key] for name in names]
        if key == "lengths":  # a list of tuples per sample
            out[key] = [columns[s][i] for s, i in zip(src.tolist(), index.tolist())]
            continue
        values = np.zeros(len(src), np.asarray(columns[0]).dtype)
        for s, column in enumerate(columns):
            values[src == s] = np.asarray(column)[index[src == s]]
        out[key] = values
    return out


def check_mixture_resume(root: str, data, llm_part: str) -> None:
    """The checkpoint under ``root`` was trained on the same mixture as ``data`` (or on no
    mixture, and ``data`` is none): else a ``ValueError`` naming what changed."""
    path, saved = os.path.join(root, llm_part, MIXTURE), None
    if os.path.isfile(path):
        with open(path) as f:
            saved = json.load(f)
    now = data.fingerprint() if isinstance(data, Mixture) else None
    if saved == now:
        return
    if saved is None or now is None:
        was, is_ = ("no mixture", "a mixture") if saved is None else ("a mixture", "no mixture")
        changed = f"the checkpoint was trained on {was}, this run on {is_}"
    else:
        changed = "; ".join(
            f"{k}: checkpoint {saved.get(k)!r} vs run {now.get(k)!r}"
            for k in ("sources", "weights", "seed")
            if saved.get(k) != now.get(k)
        )
    raise ValueError(
        f"Resuming from {root} with a changed training mixture ({changed}): the run would "
        "not continue the draws it made. Resume with the mixture it was trained on, or "
        "start a new run."
    )
