"""Conversation records streamed to training in a fixed order, resumable mid-epoch.

A :class:`ConversationStream` is a ``datasets={"train": ...}`` entry read by the LLM
group's data-parallel leaders while training runs. The driver only indexes the record
files (one pass: each JSON Lines record's byte range, each parquet file's row count); no
record is converted there and none is held.

Order: epoch ``e`` visits the records in a permutation seeded by ``(seed, e)`` (file
order without ``shuffle``); leader ``d`` of ``n`` takes the epoch's records ``d, d + n,
d + 2n, ...`` and converts them in that order on its own Ray Data actors (``concurrency``
of them, order preserved). A record that fails (missing media, a template error) or
makes more than ``max_seq_len`` tokens gives no sample but still counts as read. The
position (records read per leader this epoch) is saved with every checkpoint, so a
restart or resume continues with the next unread record: no repeat, no skip.
"""

from __future__ import annotations

import functools
import gc
import logging
import math
import os
import pickle
from dataclasses import dataclass, field

import numpy as np

from ray_disagg.data.conversations import ConversationProcessor
from ray_disagg.data.preference import sequence_lengths

__all__ = [
    "STREAM_FIXES",
    "ConversationStream",
    "RecordIndex",
    "conversations_dataset",
    "epoch_order",
]

logger = logging.getLogger(__name__)

OK, BAD, LONG = "ok", "bad", "long"
_FORMATS = (".jsonl", ".parquet")


def _filesystem(path: str):
    """``(pyarrow filesystem, path in it)``: local paths, or any URI pyarrow reads
    (``s3://``, ``gs://``, ``hdfs://``, ...)."""
    import pyarrow.fs as pafs

    if "://" in path:
        return pafs.FileSystem.from_uri(path)
    return pafs.LocalFileSystem(), os.path.abspath(path)


def _record_files(paths) -> list[str]:
    """The record files: each path, or a directory's ``.jsonl`` / ``.parquet`` files."""
    import pyarrow.fs as pafs

    out = []
    for p in [paths] if isinstance(paths, (str, os.PathLike)) else paths:
        p = os.fspath(p)
        fs, inner = _filesystem(p)
        info = fs.get_file_info(inner)
        if info.type == pafs.FileType.NotFound:
            raise ValueError(f"record file {p!r} does not exist.")
        if info.type == pafs.FileType.Directory:
            found = fs.get_file_info(pafs.FileSelector(inner, recursive=False))
            names = sorted(i.base_name for i in found if i.base_name.endswith(_FORMATS))
            out += [p.rstrip("/") + "/" + n for n in names]
        elif p.endswith(_FORMATS):
            out.append(p)
        else:
            raise ValueError(
                f"record file {p!r}: a stream reads .jsonl or .parquet files (convert a JSON "
                "list with ray_disagg.data.conversations.read_records and write JSON Lines)."
            )
    if not out:
        raise ValueError(f"no .jsonl or .parquet record file in {paths!r}.")
    return out


def _line_ranges(path: str, chunk: int = 1 << 24) -> np.ndarray:
    """``[records, 2]`` byte ranges ``[start, end)`` of a JSON Lines file's non-empty
    lines (a record is at least ``{}``), read in chunks."""
    fs, inner = _filesystem(path)
    newlines, size = [], 0
    with fs.open_input_stream(inner) as f:
        while data := f.read(chunk):
            newlines.append(np.flatnonzero(np.frombuffer(data, np.uint8) == 10) + size)
            size += len(data)
    nl = np.concatenate([np.zeros(0, np.int64), *newlines]).astype(np.int64)
    starts, ends = np.concatenate([[0], nl + 1]), np.concatenate([nl, [size]])
    keep = ends - starts >= 2
    return np.stack([starts[keep], ends[keep]], axis=1)


@dataclass(frozen=True)
class RecordIndex:
    """Where each record is: record ``i`` is in ``files[k]`` for ``starts[k] <= i <
    starts[k + 1]``; ``ranges[k]``: that JSON Lines file's byte ranges (``None``: parquet)."""

    files: tuple[str, ...]
    starts: np.ndarray
    ranges: tuple

    @classmethod
    def build(cls, paths) -> RecordIndex:
        import pyarrow.parquet as pq

        files, counts, ranges = _record_files(paths), [], []
        for path in files:
            if path.endswith(".jsonl"):
                ranges.append(_line_ranges(path))
                counts.append(len(ranges[-1]))
            else:
                fs, inner = _filesystem(path)
                with fs.open_input_file(inner) as f:
                    counts.append(pq.ParquetFile(f).metadata.num_rows)
                ranges.append(None)
        starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        return cls(files=tuple(files), starts=starts, ranges=tuple(ranges))

    @property
    def num_records(self) -> int:
        return int(self.starts[-1])

    def locate(self, i: int) -> tuple[int, int]:
        """``(file number, record number in it)``."""
        k = int(np.searchsorted(self.starts, i, side="right")) - 1
        return k, i - int(self.starts[k])


class RecordReader:
    """Reads single records by index (open files and the last parquet row group cached)."""

    def __init__(self, index: RecordIndex):
        self.index, self._open, self._group = index, {}, (None, None, None)

    def _file(self, k: int):
        if k not in self._open:
            fs, inner = _filesystem(self.index.files[k])
            self._open[k] = fs.open_input_file(inner)
        return self._open[k]

    def __call__(self, i: int) -> dict:
        import json

        k, j = self.index.locate(i)
        ranges = self.index.ranges[k]
        if ranges is not None:
            start, end = (int(x) for x in ranges[j])
            return json.loads(self._file(k).read_at(end - start, start))
        return self._parquet_row(k, j)

    def _parquet_row(self, k: int, j: int) -> dict:
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(self._file(k))
        first = 0
        for g in range(pf.num_row_groups):
            rows = pf.metadata.row_group(g).num_rows
            if j < first + rows:
                if self._group[:2] != (k, g):
                    self._group = (k, g, pf.read_row_group(g))
                return self._group[2].slice(j - first, 1).to_pylist()[0]
            first += rows
        raise IndexError(f"record {j} of {self.index.files[k]}")


def epoch_order(num_records: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The records in the order epoch ``epoch`` visits them."""
    if not shuffle:
        return np.arange(num_records, dtype=np.int64)
    return np.random.default_rng([seed, epoch]).permutation(num_records)


STREAM_FIXES = (  # when its converting actors find no free CPUs
    "Give the groups' workers fewer CPUs (ScalingConfig(resources_per_worker={'CPU': 0.5})), "
    "lower the stream's num_cpus or concurrency (a recipe's data.train.num_cpus, "
    "data.train.concurrency), or use a "
    "cluster with more CPUs."
)


@dataclass(kw_only=True)
class ConversationStream:
    """Conversation records (see :mod:`ray_disagg.data.conversations`) converted to
    samples while training runs, in a fixed order, resumable mid-epoch.

    Example:
        >>> stream = ConversationStream(paths="s3://bucket/train/",  # doctest: +SKIP
        ...                             processor=proc, concurrency=8, max_seq_len=8192)
        >>> trainer = DisaggregatedTrainer(..., datasets={"train": stream})  # doctest: +SKIP
    """

    paths: object
    """A ``.jsonl`` / ``.parquet`` file, a directory of them, or a list; local or any URI
    pyarrow reads."""
    processor: ConversationProcessor
    """Turns a record into a sample (chat template, image / video processors); a
    :class:`~ray_disagg.data.preference.PreferenceProcessor` makes DPO pairs."""
    concurrency: int = 1
    """Ray Data actors converting records, per LLM data-parallel replica."""
    num_cpus: float = 1.0
    """CPUs each converting actor reserves."""
    max_seq_len: int | None = None
    """A sample longer than this is dropped (counted in ``records_too_long``)."""
    max_bad_records: int = 100
    """Broken records (missing media, a template error) skipped before the run fails
    naming them."""
    actor_start_timeout_s: float = 600.0
    """How long the converting actors may take to start (waiting for CPUs included)
    before the run fails naming the CPUs they need: they never wait forever."""
    index: RecordIndex = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency={self.concurrency}: at least 1 actor is needed.")
        if self.num_cpus <= 0:
            raise ValueError(f"num_cpus={self.num_cpus}: must be > 0.")
        if self.max_seq_len is not None and self.max_seq_len < 1:
            raise ValueError(f"max_seq_len={self.max_seq_len}: must be >= 1 (or None).")
        if self.max_bad_records < 0:
            raise ValueError(f"max_bad_records={self.max_bad_records}: must be >= 0.")
        if not self.actor_start_timeout_s > 0:
            raise ValueError(
                f"actor_start_timeout_s={self.actor_start_timeout_s}: must be > 0 seconds."
            )
        self.index = RecordIndex.build(self.paths)
        if self.index.num_records == 0:
            raise ValueError(f"the record files {list(self.index.files)} hold no record.")

    @property
    def num_records(self) -> int:
        return self.index.num_records

    @functools.cached_property
    def adapter(self):
        """The model family's adapter (its parts, their cost estimates)."""
        from ray_disagg.models import get_adapter

        return get_adapter(self.processor.config)

    def convert(self, i: int, read: RecordReader) -> dict:
        """Record ``i`` as an outcome: ``{"record": i, "status": "ok" | "bad" | "long",
        "message": why not ok, "sample": the pickled sample when ok, "costs": its
        :meth:`costs`}`` (pickled: rows of one schema whatever the sample's fields)."""
        zero = [0.0] * len(self.adapter.parts)  # one row schema
        out = {"record": int(i), "status": OK, "message": "", "sample": b"", "costs": zero}
        try:
            record = read(int(i))
            sample = self.processor(record)
        except Exception as e:  # noqa: BLE001 - any failure of one record is that record's
            return {**out, "status": BAD, "message": f"record #{i}: {e}"}
        if sample.get("id") is None:
            sample["id"] = int(i)
        n = max(sequence_lengths(sample))  # a preference pair: its longer sequence
        if self.max_seq_len is not None and n > self.max_seq_len:
            msg = f"record {sample['id']!r}: {n} tokens > max_seq_len={self.max_seq_len}"
            return {**out, "status": LONG, "message": msg}
        sample = {k: v for k, v in sample.items() if v is not None}
        return {**out, "sample": pickle.dumps(sample, protocol=5), "costs": self.costs(sample)}

    def costs(self, sample: dict) -> list[float]:
        """The sample's cost to each part (the adapter's ``parts`` order): LLM tokens, each
        encoder's estimate; what balanced assignment splits by."""
        adapter = self.adapter
        return [
            float(sum(sequence_lengths(sample)))
            if part == adapter.llm_part
            else float(adapter.encoder_cost(part, sample))
            for part in adapter.parts
        ]

    def outcomes(self, records):
        """The outcomes of ``records`` in their order: on Ray Data actors when Ray is
        running, else in this process."""
        import ray

        records = np.asarray(records, dtype=np.int64)
        if not ray.is_initialized():
            read = RecordReader(self.index)
            return (self.convert(i, read) for i in records)
        return self._ray_outcomes(records)

    def _ray_outcomes(self, records: np.ndarray):
        import ray.data

        n = len(records)
        if n == 0:
            return iter(())
        ds = ray.data.range(n, override_num_blocks=max(1, math.ceil(n / 16))).flat_map(
            _Convert,
            fn_constructor_kwargs={"stream": self, "records": records},
            concurrency=self.concurrency,
            num_cpus=self.num_cpus,
        )
        ds.context.execution_options.preserve_order = True
        ds.context.wait_for_min_actors_s = self.actor_start_timeout_s
        return self._rows_or_fail(ds)

    def _rows_or_fail(self, ds):
        """``ds``'s rows; converting actors that cannot start in time (no free CPUs:
        Ray Data would wait forever) fail with the CPUs they need and the fixes."""
        import ray
        from ray.exceptions import GetTimeoutError

        try:
            yield from ds.iter_rows()
            return
        except GetTimeoutError as e:
            reason = str(e)
        # The failed start's actor pool lives in reference cycles (Ray Data's executor and
        # operators, the timeout's traceback): collected now, its actors are cancelled;
        # left to a later collection, they start once CPUs free up and keep them.
        del ds
        gc.collect()
        total = ray.cluster_resources().get("CPU", 0)
        free = ray.available_resources().get("CPU", 0)
        raise RuntimeError(
            f"The conversation stream's {self.concurrency} converting actor(s) "
            f"(num_cpus={self.num_cpus:g} each) did not start within "
            f"actor_start_timeout_s={self.actor_start_timeout_s:g}s: the cluster has "
            f"{total:g} CPUs, {free:g} free. {STREAM_FIXES} (Ray Data: {reason})"
        )

    def samples(self):
        """Every record's sample in file order (failures logged and skipped): for small
        sets, e.g. validation."""
        for out in self.outcomes(range(self.num_records)):
            if out["status"] == OK:
                yield pickle.loads(out["sample"])
            else:
                logger.warning("skipped %s", out["message"])


class _Convert:
    """A Ray Data actor: position ``id`` of the reader's list in, its outcome out."""

    def __init__(self, stream: ConversationStream, records: np.ndarray):
        self.stream, self.records = stream, records
        self.read = RecordReader(stream.index)

    def __call__(self, row: dict) -> list[dict]:
        return [self.stream.convert(int(self.records[int(row["id"])]), self.read)]


def conversations_dataset(
    paths,
    processor: ConversationProcessor,
    *,
    concurrency: int = 1,
    max_seq_len: int | None = None,
    max_bad_records: int = 100,
) -> ConversationStream:
    """A :class:`ConversationStream` for ``datasets={"train": ...}``: the records are
    converted by ``processor`` on ``concurrency`` CPU actors per LLM replica while training
    runs, in an order a checkpoint can resume.

    Example:
        >>> ds = conversations_dataset("train.jsonl", proc,  # doctest: +SKIP
        ...                            concurrency=8, max_seq_len=8192)
    """
    return ConversationStream(
        paths=paths,
        processor=processor,
        concurrency=concurrency,
        max_seq_len=max_seq_len,
        max_bad_records=max_bad_records,
    )
