"""Conversation streams without Ray (tier 2): records indexed on the driver, converted in
a fixed order in this process, read by the LLM replicas while training runs (the
workers without Ray, ``testing.local``), resumable mid-epoch from a checkpoint, under a
token budget, with broken records counted. Ray Data's converting actors and a fit on Ray
are in ``tests/ray/test_conversation_stream.py``."""

import json
import pickle

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ray_disagg import HFModelSpec, TrainLoopConfig
from ray_disagg.data.stream import ConversationStream, RecordReader, epoch_order
from ray_disagg.testing.reference import reference_train
from tests.helpers import assert_params_close, checkpoint_state, group, vt
from tests.helpers import run_layout as fit
from tests.stream_records import STREAM_LOOP as LOOP
from tests.stream_records import record, step_ids, stream_data


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return stream_data(tmp_path_factory.mktemp("stream"))


def test_records_are_indexed_and_converted_in_order(data, tmp_path):
    proc, path, _ = data
    pq.write_table(pa.Table.from_pylist([record(20), record(21)]), tmp_path / "b.parquet")
    (tmp_path / "a.jsonl").write_text(path.read_text())
    stream = ConversationStream(paths=tmp_path, processor=proc, max_seq_len=10_000)
    assert stream.num_records == 12  # a directory: a.jsonl (10 records), b.parquet (2)
    read = RecordReader(stream.index)
    assert read(3)["id"] == "broken" and read(10)["id"] == "r20" and read(11)["id"] == "r21"
    order = [2, 10, 3, 0]
    outs = list(stream.outcomes(order))  # no Ray running here: in this process
    assert [o["record"] for o in outs] == order
    assert [o["status"] for o in outs] == ["ok", "ok", "bad", "ok"]
    assert "missing.png" in outs[2]["message"] and "'broken'" in outs[2]["message"]
    for o, i in zip([outs[0], outs[1], outs[3]], [2, 10, 0]):
        want = proc(read(i))
        got = pickle.loads(o["sample"])
        assert got["id"] == want["id"]
        assert got["input_ids"].tolist() == want["input_ids"].tolist()
        assert got["labels"].tolist() == want["labels"].tolist()
    short = ConversationStream(paths=path, processor=proc, max_seq_len=5)
    assert {o["status"] for o in short.outcomes([0, 1])} == {"long"}
    # a fixed permutation per (seed, epoch), a new one each epoch
    e0, e1 = epoch_order(12, 3, 0, True), epoch_order(12, 3, 1, True)
    assert sorted(e0) == list(range(12)) and e0.tolist() == epoch_order(12, 3, 0, True).tolist()
    assert e0.tolist() != e1.tolist()
    (tmp_path / "x.json").write_text(json.dumps([record(0)]))
    with pytest.raises(ValueError, match="reads .jsonl or .parquet"):
        ConversationStream(paths=tmp_path / "x.json", processor=proc)
    with pytest.raises(ValueError, match="does not exist"):
        ConversationStream(paths=tmp_path / "nothing.jsonl", processor=proc)
    with pytest.raises(ValueError, match="concurrency=0"):
        ConversationStream(paths=path, processor=proc, concurrency=0)


def test_a_resumed_run_reads_the_records_the_uninterrupted_one_reads(data, tmp_path):
    """Two LLM replicas read one record each per step: 9 good records, a broken one, so
    4 steps make epoch 0 (the 10th record waits for epoch 1). A run resumed from step 3's
    checkpoint reads exactly what the uninterrupted run reads, and its losses match."""
    proc, path, cfg = data
    spec = HFModelSpec(config=cfg, seed=2)
    stream = ConversationStream(paths=path, processor=proc)
    groups = vt(group(1), group(2))
    full = fit(spec, stream, dict(LOOP, max_steps=6), groups, tmp_path, "full", local=True)
    first = fit(spec, stream, dict(LOOP, max_steps=3), groups, tmp_path, "a", local=True)
    rest = dict(LOOP, max_steps=6)
    resumed = fit(spec, stream, rest, groups, tmp_path, "b", resume=first.checkpoint, local=True)
    ids = step_ids(full)
    epoch0 = [i for step in ids[:4] for i in step]
    assert len(epoch0) == 8 and len(set(epoch0)) == 8 and "broken" not in epoch0
    assert step_ids(first) == ids[:3] and step_ids(resumed) == ids[3:]
    rows = full.metrics_dataframe.sort_values("step")
    assert rows["epoch"].tolist() == [0, 0, 0, 0, 1, 1]
    assert rows["records_bad"].tolist()[4] >= 1  # read by step 5 at the latest
    got = resumed.metrics_dataframe.sort_values("step")["loss"].tolist()
    assert got == rows["loss"].tolist()[3:]


def test_a_balanced_stream_reads_the_same_samples_and_losses_as_a_contiguous_one(data, tmp_path):
    """assignment='balanced' on a stream: the vision replicas split each step by the
    costs the converting actors computed; the steps read the same records and the losses
    agree with contiguous assignment."""
    proc, path, cfg = data
    spec = HFModelSpec(config=cfg, seed=2)
    stream = ConversationStream(paths=path, processor=proc)
    runs = {}
    for assignment in ("contiguous", "balanced"):
        loop = dict(LOOP, max_steps=3, global_batch_size=4, assignment=assignment)
        groups = vt(group(2), group(2))
        runs[assignment] = fit(spec, stream, loop, groups, tmp_path, assignment, local=True)
    assert step_ids(runs["balanced"]) == step_ids(runs["contiguous"])
    losses = {a: r.metrics_dataframe.sort_values("step")["loss"].tolist() for a, r in runs.items()}
    np.testing.assert_allclose(losses["balanced"], losses["contiguous"], rtol=1e-5)


class _Steps:
    """The steps a run trained on (its ``sample_ids``), as a plan of ``samples``."""

    def __init__(self, ids, samples):
        self.ids, self.index = ids, {s["id"]: i for i, s in enumerate(samples)}

    def global_indices(self, step: int) -> list[int]:
        return [self.index[i] for i in self.ids[step]]


def test_a_budget_stream_fills_steps_resumes_before_a_waiting_sample_and_equals_hf(data, tmp_path):
    """max_tokens_per_microbatch on a stream: each LLM leader takes the records that fit
    its microbatch (19-33 tokens in 48: one or two); the record that does not waits for
    its next step, so a run resumed from a checkpoint reads it again and then exactly
    what the uninterrupted run reads; the losses and parameters equal the single-process
    model on the steps' samples. A budget no record fits fails instead of looping."""
    proc, path, cfg = data
    spec = HFModelSpec(config=cfg, seed=2)
    stream = ConversationStream(paths=path, processor=proc)
    groups = lambda: vt(group(1), group(2))  # noqa: E731
    loop = dict(LOOP, max_steps=4, global_batch_size=8, max_tokens_per_microbatch=48)
    full = fit(spec, stream, loop, groups(), tmp_path, "full", local=True)
    first = fit(spec, stream, dict(loop, max_steps=2), groups(), tmp_path, "a", local=True)
    resumed = fit(spec, stream, loop, groups(), tmp_path, "b", resume=first.checkpoint, local=True)
    ids = step_ids(full)
    assert step_ids(first) == ids[:2] and step_ids(resumed) == ids[2:]
    assert len({len(step) for step in ids}) > 1  # the lengths, not a count, end a step
    samples = list(stream.samples())
    ref_losses, _, ref_model = reference_train(
        spec, samples, TrainLoopConfig(**loop), plan=_Steps(ids, samples)
    )
    rows = full.metrics_dataframe.sort_values("step")
    np.testing.assert_allclose(rows["loss"].tolist(), ref_losses, rtol=1e-5)
    assert_params_close(checkpoint_state(full.checkpoint), ref_model.state_dict(), 1e-5)
    with pytest.raises(RuntimeError, match=r"Epoch 0 .* made no step: 1 broken and 9 too-long"):
        fit(spec, stream, dict(loop, max_tokens_per_microbatch=16), groups(), tmp_path, "none",
            local=True)  # fmt: skip


def test_more_broken_records_than_allowed_fail_the_run_naming_them(data, tmp_path):
    proc, path, cfg = data
    stream = ConversationStream(paths=path, processor=proc, max_bad_records=0)
    spec = HFModelSpec(config=cfg, seed=2)
    with pytest.raises(RuntimeError, match=r"max_bad_records=0.*missing.png"):
        fit(
            spec, stream, dict(LOOP, max_steps=4), vt(group(1), group(1)), tmp_path, "x", local=True
        )
