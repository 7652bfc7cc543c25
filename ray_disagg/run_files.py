"""The files a run keeps beside its checkpoints, on any storage the run can use: a local or
mounted path, S3, GCS, or any ``RunConfig(storage_filesystem=...)``, through pyarrow's
filesystems as Ray Train's own storage.

- **The metrics history**: every reported step's metrics (the merged metrics of all
  groups), written by one process, the driver, as each step reaches it
  (:class:`MetricsHistory`). Where the filesystem appends (a local or mounted path) it is
  one file, ``metrics.jsonl``, a line per step as it comes. An object store has no append:
  there the history is ``metrics/<fit>-<part>.jsonl`` segments, each holding the steps
  that arrived since the previous one, written every ``flush_every_s`` and when ``fit()``
  ends; ``<fit>`` numbers the run's fits in order (a resumed run's next ``fit()`` takes the
  next number), ``<part>`` the segments of one fit.
- **Traces** of the steps in ``trace_steps``, written by each group's rank 0
  (:func:`write_trace`): where the filesystem appends, ``trace/<group>.jsonl``, a line per
  traced step; on an object store ``trace/<group>-step<N>.json``, a file per step.

- **The trackers' run ids** (``trackers.json``, :data:`TRACKERS_FILE`), written by the
  driver's :class:`~ray_disagg.launch.trackers.Trackers` so that a resumed run continues
  the same tracker runs.

Reading (:func:`read_metrics`, :func:`load_metrics` as a DataFrame; nothing here imports
Ray or the trainer, so ``ray-disagg plot`` does not): ``metrics.jsonl`` line by line,
then the segments in name order; a step recorded more than once (a restart or a resumed
``fit()`` redid it) keeps its last record, so every step comes back once.

Example:
    >>> import tempfile
    >>> run = RunDir.of(tempfile.mkdtemp())
    >>> history = MetricsHistory(run)
    >>> for step, loss in [(1, 2.5), (2, 2.0), (2, 1.9)]:  # step 2 redone after a restart
    ...     history.add({"step": step, "loss": loss})
    >>> history.close()
    >>> [(r["step"], r["loss"]) for r in read_metrics(run)]
    [(1, 2.5), (2, 1.9)]
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import posixpath
import re
import sys
import tempfile
import time

import pyarrow.fs as pafs

logger = logging.getLogger(__name__)

__all__ = [
    "METRICS_FILE",
    "MetricsHistory",
    "RunDir",
    "TRACKERS_FILE",
    "load_metrics",
    "read_metrics",
    "read_records",
    "read_traces",
    "write_trace",
]

METRICS_FILE = "metrics.jsonl"
SEGMENTS = "metrics"
TRACES = "trace"
TRACKERS_FILE = "trackers.json"
_SEGMENT = re.compile(r"(\d+)-(\d+)\.jsonl")


@dataclasses.dataclass(frozen=True)
class RunDir:
    """A run's directory on its storage: ``fs`` (a ``pyarrow.fs.FileSystem``) and ``path``
    on it (``<storage_path>/<name>``, as Ray Train's ``Result.path``)."""

    fs: pafs.FileSystem
    path: str

    @classmethod
    def of(cls, source) -> RunDir:
        """The run directory of ``source``: a ``RunDir``, a ``ray.train.Result``, a local
        path (of the run directory or its ``metrics.jsonl``) or a URI
        (``s3://bucket/runs/name``; credentials from the environment, as for Ray Train)."""
        if isinstance(source, RunDir):
            return source
        train = sys.modules.get("ray.train")  # a Result exists only where Ray Train is loaded
        if train is not None and isinstance(source, train.Result):
            return cls(source.filesystem or pafs.LocalFileSystem(), source.path)
        text = os.fspath(source)
        if "://" in text:
            fs, path = pafs.FileSystem.from_uri(text)
        else:
            fs, path = pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(text))
        if posixpath.basename(path) == METRICS_FILE:  # the history's file: its run
            path = posixpath.dirname(path)
        return cls(fs, path)

    @property
    def appends(self) -> bool:
        """Whether files here can be appended to (a local or mounted path)."""
        return isinstance(self.fs, pafs.LocalFileSystem)

    @property
    def local_path(self) -> str | None:
        """The directory as a local path, or ``None`` on remote storage."""
        return self.path if self.appends else None

    def join(self, *parts: str) -> str:
        return posixpath.join(self.path, *parts)

    def write(self, rel: str, data: bytes) -> None:
        """``rel`` (a path below the run directory) replaced by ``data``."""
        path = self.join(rel)
        self.fs.create_dir(posixpath.dirname(path), recursive=True)
        with self.fs.open_output_stream(path) as f:
            f.write(data)

    def append(self, rel: str, data: bytes) -> None:
        """``data`` appended to ``rel`` (only where :attr:`appends`)."""
        path = self.join(rel)
        self.fs.create_dir(posixpath.dirname(path), recursive=True)
        with self.fs.open_append_stream(path) as f:
            f.write(data)

    def read(self, rel: str) -> bytes | None:
        """The bytes of ``rel``, or ``None`` when there is no such file."""
        path = self.join(rel)
        if self.fs.get_file_info(path).type != pafs.FileType.File:
            return None
        with self.fs.open_input_stream(path) as f:
            return f.read()

    def latest_checkpoint(self) -> str | None:
        """The path of the run's latest complete checkpoint (the highest
        ``checkpoint_<N>`` folder holding a ``config.json``), or ``None``."""
        selector = pafs.FileSelector(self.path, allow_not_found=True)
        names = sorted(
            i.base_name
            for i in self.fs.get_file_info(selector)
            if i.type == pafs.FileType.Directory and re.fullmatch(r"checkpoint_\d+", i.base_name)
        )
        done = [n for n in names if self.read(f"{n}/config.json") is not None]
        return self.join(done[-1]) if done else None

    def files(self, rel: str) -> list[str]:
        """The names of the files directly in folder ``rel``, sorted (none: ``[]``)."""
        selector = pafs.FileSelector(self.join(rel), allow_not_found=True)
        infos = self.fs.get_file_info(selector)
        return sorted(i.base_name for i in infos if i.type == pafs.FileType.File)


def _lines(data: bytes | None) -> list[dict]:
    rows = []
    for line in (data or b"").splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:  # blank, or cut short by a crash
            continue
    return rows


def read_metrics(source) -> list[dict]:
    """Every step the run recorded, once each (its last record), sorted by step;
    ``source`` as :meth:`RunDir.of`. ``FileNotFoundError`` when the run has no history."""
    by_step = {r["step"]: r for r in read_records(source) if "step" in r}
    return [by_step[s] for s in sorted(by_step)]


def load_metrics(source):
    """Every reported step of a run as a pandas DataFrame (one row per step, sorted):
    ``source`` is a ``ray.train.Result``, a run directory (a local path or a URI such as
    ``s3://bucket/runs/name``) or its ``metrics.jsonl`` (:func:`read_metrics`: on any
    storage the run could use).

    ``Result.metrics_dataframe`` holds only the steps that wrote a checkpoint; this holds
    them all.

    Example:
        >>> df = load_metrics(result)  # doctest: +SKIP
        >>> df[["step", "loss"]]  # doctest: +SKIP
    """
    import pandas as pd

    return pd.DataFrame(read_metrics(source))


def read_records(source) -> list[dict]:
    """Every record of the run's history in the order written, a redone step's records
    all kept (:func:`read_metrics` keeps each step's last)."""
    run = RunDir.of(source)
    data = run.read(METRICS_FILE)
    segments = [n for n in run.files(SEGMENTS) if _SEGMENT.fullmatch(n)]
    if data is None and not segments:
        raise FileNotFoundError(
            f"No metrics history in {run.path!r} (neither {METRICS_FILE} nor {SEGMENTS}/): "
            "is it the directory of a run (RunConfig storage_path/name)?"
        )
    rows = _lines(data)
    for name in sorted(segments, key=lambda n: tuple(map(int, _SEGMENT.fullmatch(n).groups()))):
        rows += _lines(run.read(posixpath.join(SEGMENTS, name)))
    return rows


class MetricsHistory:
    """The run's metrics history, written by one process (see the module docstring):
    :meth:`add` each step as it arrives, :meth:`flush_if_due` now and then,
    :meth:`close` at the end of ``fit()``. A write that fails is warned about and retried
    with the next one; it never stops the run. (Two drivers of one run at once would
    write the same segments: a run has one driver.)"""

    def __init__(self, run: RunDir, flush_every_s: float = 30.0):
        self.run, self.flush_every_s = run, flush_every_s
        self.pending: list[bytes] = []
        self.flushed_at = time.monotonic()
        self.appends, self.fit, self.part = run.appends, 0, 0
        if not self.appends:
            self._segments()

    def _segments(self) -> None:
        """Write segments from now on, after every earlier fit's (when they cannot be
        listed, numbered by the clock's seconds: after any fit's number)."""
        try:
            names = self.run.files(SEGMENTS)
            fit = max((int(m.group(1)) for n in names if (m := _SEGMENT.fullmatch(n))), default=0)
        except Exception as e:  # noqa: BLE001 - the history never stops the run
            logger.warning("Could not list %s's metrics history (%s)", self.run.path, e)
            fit = int(time.time())
        self.appends, self.fit, self.part = False, fit + 1, 0

    def add(self, metrics: dict) -> None:
        self.pending.append(json.dumps(metrics, default=float).encode() + b"\n")
        if self.appends:
            self.flush()
        else:
            self.flush_if_due()

    def flush_if_due(self) -> None:
        """Write the steps not written yet when ``flush_every_s`` has passed."""
        if self.pending and time.monotonic() - self.flushed_at >= self.flush_every_s:
            self.flush()

    def flush(self) -> bool:
        """Write the steps not written yet; whether that worked."""
        if not self.pending:
            return True
        data = b"".join(self.pending)
        try:
            if self.appends:
                try:
                    self.run.append(METRICS_FILE, data)
                except (OSError, NotImplementedError):  # a mounted object store
                    self._segments()
            if not self.appends:
                self.run.write(f"{SEGMENTS}/{self.fit:05d}-{self.part:06d}.jsonl", data)
                self.part += 1
        except Exception as e:  # noqa: BLE001 - the history never stops the run
            logger.warning("Could not write the metrics history to %s (%s); retrying with "
                           "the next step", self.run.path, e)  # fmt: skip
            return False
        self.pending, self.flushed_at = [], time.monotonic()
        return True

    def close(self) -> None:
        """Write what is left; where that fails, into a local file (named in a warning)."""
        if self.flush():
            return
        path = os.path.join(tempfile.mkdtemp(prefix="ray_disagg_metrics_"), METRICS_FILE)
        with open(path, "wb") as f:
            f.write(b"".join(self.pending))
        logger.warning("%d steps of the metrics history could not be written to %s; they "
                       "are in %s", len(self.pending), self.run.path, path)  # fmt: skip
        self.pending = []


def write_trace(run: RunDir, group: str, step: int, actions: list[dict]) -> None:
    """A traced step's actions of ``group``'s rank 0 (``step`` from 1), the record
    ``{"step", "group", "actions": [...]}`` appended to ``trace/<group>.jsonl``, or on an
    object store written as ``trace/<group>-step<N>.json`` (a redone step's replaced)."""
    record = json.dumps({"step": step, "group": group, "actions": actions}).encode()
    if run.appends:
        run.append(f"{TRACES}/{group}.jsonl", record + b"\n")
    else:
        run.write(f"{TRACES}/{group}-step{step}.json", record)


def read_traces(source) -> dict[int, dict[str, list[dict]]]:
    """Per traced step (from 1), per group: its rank-0 actions ``{"action", "start",
    "end", "waiting"}`` in order (a step recorded twice: its last record); ``source`` as
    :meth:`RunDir.of`."""
    run = RunDir.of(source)
    out: dict[int, dict[str, list[dict]]] = {}
    for name in run.files(TRACES):
        for rec in _lines(run.read(posixpath.join(TRACES, name))):
            if rec.get("actions"):
                out.setdefault(rec["step"], {})[rec["group"]] = rec["actions"]
    return out
