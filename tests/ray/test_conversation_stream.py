"""Ray Data on Ray (tier 3): a Ray Dataset read by the LLM's shards, each sample once per
epoch; conversation streams, whose Ray Data actors convert the records in the order this
process would, and one end-to-end fit on Ray from a JSON Lines file and a media folder
whose text worker is killed mid-epoch, restarting every group (the run that checks a
whole-run restart); a cluster without room for the converting actors is refused. The
stream's numerics without Ray are in ``tests/gloo/test_conversation_stream.py``."""

import gc
import logging

import numpy as np
import pytest
import ray

from ray_disagg import HFModelSpec, TrainLoopConfig
from ray_disagg.config.lr_schedule import lr_at
from ray_disagg.data.examples import synthetic_samples
from ray_disagg.data.stream import ConversationStream, RecordReader
from ray_disagg.testing.faults import fault_drill
from tests.helpers import (
    RESTART_LOOP,
    assert_bit_identical,
    every_cpu_free,
    group,
    restart_setup,
    vt,
)
from tests.helpers import run_layout as fit
from tests.stream_records import STREAM_LOOP as LOOP
from tests.stream_records import step_ids, stream_data


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return stream_data(tmp_path_factory.mktemp("stream"))


def test_ray_fit_from_records_and_media_sees_each_record_once_across_a_restart(
    ray_start_4_cpus, data, tmp_path
):
    """On Ray, Ray Data actors convert the records; the text worker dies at the start of
    step 3 of 4 and every group restarts from step 2's checkpoint, mid-epoch: over the
    last attempts of the steps each good record is read exactly once, in file order, the
    learning-rate schedule continues, and the result equals the uninterrupted run without
    Ray (records converted in process) bit for bit."""
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
    # file order: r0 r1 r2 broken r3 ...; a schedule that changes every step: the restart
    # must continue it
    loop = dict(LOOP, max_steps=4, shuffle=False, lr_schedule="cosine", warmup_steps=2,
                min_lr_ratio=0.1)  # fmt: skip
    marker = tmp_path / "killed"
    # one converting actor per attempt: the order over two is checked above
    stream = ConversationStream(paths=path, processor=proc, num_cpus=0.5, concurrency=1)
    with fault_drill(group="text", step=2, marker=marker):
        result = fit(spec, stream, loop, vt(group(1), group(1)), tmp_path, "ray", failures=1)
    assert marker.exists()
    rows = result.metrics_dataframe.sort_values("step")
    assert rows["step"].tolist() == [1, 2, 3, 4]
    assert step_ids(result) == [["r0", "r1"], ["r2", "r3"], ["r4", "r5"], ["r6", "r7"]]
    assert rows["records_bad"].tolist() == [0, 1, 1, 1]
    assert all(v == v for v in rows["loss"])
    lrs = rows["lr"].tolist()
    assert lrs == [lr_at(TrainLoopConfig(**loop), s) for s in range(4)] and len(set(lrs)) == 4
    clean = fit(spec, stream, loop, vt(group(1), group(1)), tmp_path, "clean", local=True)
    assert step_ids(clean) == step_ids(result)
    assert_bit_identical(result, clean)


def test_no_room_for_the_converting_actors_fails_naming_the_cpus(ray_start_4_cpus, data, tmp_path):
    """The groups reserve every CPU of the cluster: the driver refuses the run before any
    worker starts, naming the CPUs the stream's actors need and the fixes; actors that
    still find no CPU (here a placement group holds them all) fail after
    ``actor_start_timeout_s`` instead of waiting forever, and leave no actor behind."""
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
        # pytest's log handlers keep the records logged meanwhile with Ray Data's
        # traceback, and so its failed executor (a user's driver keeps none)
        for handler in logging.getLogger().handlers:
            for record in getattr(handler, "records", []):
                record.exc_info = None
        gc.collect()
    finally:
        remove_placement_group(pg)
    # the failed start's actor does not take the CPUs once they are free (it would hold
    # them for good, and the next fit in this driver would wait on them)
    assert every_cpu_free(60.0) == cpus  # a loaded 2-core machine takes its time


def test_ray_data_ingest_uses_every_sample_once_per_epoch(ray_start_4_cpus, tmp_path):
    """A Ray Dataset read by 2 LLM shards (``streaming_split``): each epoch every sample
    once, none dropped or duplicated; the driver's Ray Data contexts are as before (the
    progress bars, off while the trainer read them: ``tests/unit/test_progress.py``)."""
    cfg, spec, _ = restart_setup()
    samples = synthetic_samples(cfg, 12, grids=[(1, 4, 4), (1, 8, 4)])
    ds = ray.data.from_items(samples)
    here = ray.data.DataContext.get_current()
    before = [(c.enable_progress_bars, c.enable_operator_progress_bars) for c in (here, ds.context)]
    loop = dict(RESTART_LOOP, max_steps=6, report_sample_ids=True)
    result = fit(spec, ds, loop, vt(group(1), group(2)), tmp_path, "raydata")  # 2 LLM shards
    after = [(c.enable_progress_bars, c.enable_operator_progress_bars) for c in (here, ds.context)]
    assert after == before == [(True, True)] * 2
    rows = result.metrics_dataframe.sort_values("step")
    per_step = [list(ids) for ids in rows["sample_ids"]]
    assert all(len(ids) == 4 for ids in per_step)
    for epoch in (per_step[:3], per_step[3:]):  # 12 samples, 4 per step: 3 steps an epoch
        ids = [i for step in epoch for i in step]
        assert sorted(ids) == list(range(12))  # none dropped, none duplicated
    assert all(v == v for v in rows["loss"])  # finite (not NaN)
    # the LLM's reads are its data wait (the encoder's share of it: at most the reads)
    assert (rows["text_data_wait_s"] > 0).all()
    assert (rows["vision_data_wait_s"] <= rows["text_data_wait_s"]).all()
