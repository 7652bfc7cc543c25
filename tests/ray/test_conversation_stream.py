"""Conversation streams: records indexed on the driver, converted in a fixed order (in
process, and on Ray Data actors), read by the LLM replicas while training runs, resumable
mid-epoch from a checkpoint (the workers without Ray), and one end-to-end fit on Ray
from a JSON Lines file and a media folder whose text worker is killed mid-epoch."""

import json
import pickle

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ray_disagg import HFModelSpec, TrainLoopConfig, tiny_qwen2_5_vl_config
from ray_disagg.data.stream import ConversationStream, RecordReader, epoch_order
from ray_disagg.testing.faults import fault_drill
from ray_disagg.testing.reference import reference_train
from tests.conversation_data import build_media, build_model_dir, make_processor
from tests.helpers import assert_params_close, checkpoint_state, group, vt
from tests.helpers import run_layout as fit

QUESTIONS = ["which digit is this?", "and now?"]
ANSWERS = ["seven.", "two."]
IMAGES = [None, "a.png", "b.jpg"]


def record(i: int, image: str | None = "auto") -> dict:
    """Record ``r<i>``: a LLaVA conversation with 0 or 1 image (by ``i``)."""
    image = IMAGES[i % 3] if image == "auto" else image
    q = ("<image>\n" if image else "") + QUESTIONS[i % 2]
    conv = [{"from": "human", "value": q}, {"from": "gpt", "value": ANSWERS[i // 2 % 2]}]
    return {"id": f"r{i}", **({"image": image} if image else {}), "conversations": conv}


BROKEN = {**record(0, image="missing.png"), "id": "broken"}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """``(processor, JSON Lines file of r0..r8 with a broken record 4th, media)``."""
    root = tmp_path_factory.mktemp("stream")
    media = build_media(root)
    model = build_model_dir(root / "model")
    records = [record(i) for i in range(9)]
    records.insert(3, BROKEN)
    lines = [json.dumps(r) for r in records]
    lines.insert(5, "")  # blank lines are not records
    (root / "train.jsonl").write_text("\n".join(lines) + "\n")
    cfg = tiny_qwen2_5_vl_config()
    return make_processor(model, media, cfg), root / "train.jsonl", cfg


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


LOOP = {"global_batch_size": 2, "checkpoint_every": 1, "report_sample_ids": True, "seed": 7}


def _ids(result) -> list[list[str]]:
    rows = result.metrics_dataframe.sort_values("step")
    return [list(ids) for ids in rows["sample_ids"]]


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
    ids = _ids(full)
    epoch0 = [i for step in ids[:4] for i in step]
    assert len(epoch0) == 8 and len(set(epoch0)) == 8 and "broken" not in epoch0
    assert _ids(first) == ids[:3] and _ids(resumed) == ids[3:]
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
    assert _ids(runs["balanced"]) == _ids(runs["contiguous"])
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
    ids = _ids(full)
    assert _ids(first) == ids[:2] and _ids(resumed) == ids[2:]
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


def test_ray_fit_from_records_and_media_sees_each_record_once_across_a_restart(
    ray_start_4_cpus, data, tmp_path
):
    """On Ray, Ray Data actors convert the records; the text worker dies at the start of
    step 3 of 4 and the restart continues from step 2's checkpoint, mid-epoch: over the
    last attempts of the steps each good record is read exactly once, in file order."""
    proc, path, cfg = data
    spec = HFModelSpec(config=cfg, seed=2)
    stream = ConversationStream(paths=path, processor=proc, num_cpus=0.5, concurrency=2)
    order = [5, 3, 0, 9, 1]  # on two Ray Data actors, in order, as converted in process
    on_ray = list(stream._ray_outcomes(np.asarray(order)))
    read = RecordReader(stream.index)
    here = [stream.convert(i, read) for i in order]
    assert [(o["record"], o["status"], o["sample"]) for o in on_ray] == [
        (o["record"], o["status"], o["sample"]) for o in here
    ]
    loop = dict(LOOP, max_steps=4, shuffle=False)  # file order: r0 r1 r2 broken r3 ...
    marker = tmp_path / "killed"
    with fault_drill(group="text", step=2, marker=marker):
        result = fit(spec, stream, loop, vt(group(1), group(1)), tmp_path, "ray", failures=1)
    assert marker.exists()
    rows = result.metrics_dataframe.sort_values("step")
    assert rows["step"].tolist() == [1, 2, 3, 4]
    assert _ids(result) == [["r0", "r1"], ["r2", "r3"], ["r4", "r5"], ["r6", "r7"]]
    assert rows["records_bad"].tolist() == [0, 1, 1, 1]
    assert all(v == v for v in rows["loss"])


def test_no_room_for_the_converting_actors_fails_naming_the_cpus(ray_start_4_cpus, data, tmp_path):
    """The groups reserve every CPU of the cluster: the driver refuses the run before any
    worker starts, naming the CPUs the stream's actors need and the fixes; actors that
    still find no CPU (here a placement group holds them all) fail after
    ``actor_start_timeout_s`` instead of waiting forever."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    proc, path, cfg = data
    stream = ConversationStream(paths=path, processor=proc, num_cpus=0.5, concurrency=2)
    big = vt(group(1, cpus=2), group(1, cpus=2))  # 4 CPUs: the whole session cluster
    with pytest.raises(ValueError, match=r"converting actors need 1 CPUs \(2 actor\(s\) x "
                       r"num_cpus=0.5 x 1 LLM replica\(s\)\) beside the groups' 4 CPUs.*"
                       r"resources_per_worker"):  # fmt: skip
        fit(HFModelSpec(config=cfg), stream, dict(LOOP, max_steps=1), big, tmp_path, "no-room")
    cpus = ray.cluster_resources()["CPU"]
    pg = placement_group([{"CPU": cpus}])
    ray.get(pg.ready(), timeout=60)
    try:
        late = ConversationStream(paths=path, processor=proc, actor_start_timeout_s=3)
        with pytest.raises(RuntimeError, match=r"did not start within actor_start_timeout_s=3s"
                           r": the cluster has 4 CPUs, 0 free"):  # fmt: skip
            list(late.outcomes([0, 1]))
    finally:
        remove_placement_group(pg)
