"""Tier 3, a real Ray cluster: an asynchronous checkpoint lost with its worker, on object
storage (an S3-API server on 127.0.0.1), and a failure without retries; and, without Ray
(numerics), resume into another layout and Hugging Face export. A vision worker killed
mid-step, restarting its group alone, is in ``tests/ray/test_colocated.py``; a text
worker's death restarting every group (the learning-rate schedule continued,
bit-identical to the uninterrupted run) and Ray Data ingest in
``tests/ray/test_conversation_stream.py`` (one cluster starts Ray Data's actors)."""

import pyarrow.fs as pafs
import pytest
import ray
import torch
from transformers import Qwen2_5_VLForConditionalGeneration

from ray_disagg import (
    DisaggregatedTrainer,
    HFModelSpec,
    SequenceParallel,
    TensorParallel,
    TrainLoopConfig,
    export_hf,
    load_metrics,
    tiny_qwen2_5_vl_config,
)
from ray_disagg.data.examples import synthetic_samples
from ray_disagg.recipes.cli import main
from ray_disagg.run_files import RunDir, read_records
from ray_disagg.testing.faults import fault_drill
from ray_disagg.testing.reference import reference_batch, reference_train
from ray_disagg.worker.shards import read_full
from tests.helpers import (
    RESTART_LOOP,
    assert_params_close,
    checkpoint_state,
    group,
    losses,
    restart_setup,
    vt,
)
from tests.helpers import run_layout as fit

LOOP = RESTART_LOOP


@pytest.fixture(scope="module")
def setup():
    return restart_setup()


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
    return out


def test_on_object_storage_an_async_checkpoint_lost_with_its_worker_resumes_from_the_last(
    ray_start_4_cpus, setup, s3, tmp_path, monkeypatch, capfd
):
    """A run whose storage is an S3-API server on 127.0.0.1 (nothing of it on a local
    path), with ``async_checkpoint``: checkpoint 6 is written in the background after
    step 6 and reported at the end of step 7 at the earliest; the vision worker dies at
    the start of step 7, so it is never registered and the run resumes from checkpoint 3
    (or from the start, should checkpoint 3 not be registered yet). Checkpoints written in
    the background equal synchronous ones. Read back from the bucket: the history holds
    every step once, the driver printed every step, the tracker logged every step,
    ``export_hf`` and ``ray-disagg plot`` work."""
    _, spec, data = setup
    trackers = tmp_path / "trackers"  # (by default ~/ray_results/async on the driver)
    monkeypatch.setattr(DisaggregatedTrainer, "tracker_dir", lambda self: str(trackers))
    loop = dict(LOOP, max_steps=7, checkpoint_every=3, async_checkpoint=True, trace_steps=[2])
    marker = tmp_path / "killed"
    with fault_drill(group="vision", step=6, marker=marker):
        result = fit(spec, data, loop, vt(group(1), group(1)), "runs", "async", failures=1,
                     storage_filesystem=s3.fs, report_to="tensorboard")  # fmt: skip
    assert marker.exists() and RunDir.of(result).path == "runs/async"
    steps = [r["step"] for r in read_records(result)]  # as the driver got them, in order
    restart = next(i for i in range(len(steps) - 1) if steps[i + 1] <= steps[i])
    assert steps[: restart + 1] == list(range(1, restart + 2))  # before the kill: in order
    assert steps[restart + 1] in (1, 4)  # from checkpoint 3 (or none), never 6
    assert steps[restart + 1 :] == list(range(steps[restart + 1], 8))
    assert load_metrics(result)["step"].tolist() == list(range(1, 8))  # each step once
    printed = capfd.readouterr().out
    assert all(f"[ray_disagg] step {s}/7 loss" in printed for s in range(1, 8)), printed
    assert _tensorboard_steps(trackers) == list(range(1, 8))

    sync = fit(spec, data, dict(loop, async_checkpoint=False), vt(group(1), group(1)),
               tmp_path, "sync", local=True)  # fmt: skip
    assert losses(result) == losses(sync)  # bit-identical on CPU
    pafs.copy_files("runs/async", str(tmp_path / "async"), source_filesystem=s3.fs)
    for name in ("checkpoint_000003", "checkpoint_000006", "checkpoint_000007"):
        for module in ("vision", "text"):  # the model and the AdamW state
            got = read_full(str(tmp_path / "async" / name / module))
            ref = read_full(str(tmp_path / "sync" / name / module))
            for g, r in zip(got, ref):
                g, r = _flat(g), _flat(r)
                assert g.keys() == r.keys() and all(torch.equal(g[k], r[k]) for k in r)

    exported = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        export_hf(result.checkpoint, tmp_path / "hf")
    )
    state = checkpoint_state(sync.checkpoint)
    assert all(torch.equal(v, state[k]) for k, v in exported.state_dict().items())
    for key, value in s3.env.items():  # a URI's credentials come from the environment
        monkeypatch.setenv(key, value)
    uri = f"s3://runs/async?endpoint_override={s3.endpoint}&scheme=http"
    pictures = main(["plot", uri, "--out", str(tmp_path / "pictures")])
    assert sorted(p.rsplit("/", 1)[1] for p in pictures) == [
        "loss_curve.png", "step_times.png", "timeline_step2.png"
    ]  # fmt: skip


def _tensorboard_steps(run_dir) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return [e.step for e in events.Scalars("loss")]


def test_failure_without_retries_names_the_group_and_rank(ray_start_4_cpus, setup, tmp_path):
    _, spec, data = setup
    with (
        fault_drill(group="vision", step=1, rank=1, marker=tmp_path / "killed"),
        pytest.raises(ray.train.TrainingFailedError, match="vision group rank 1"),
    ):
        fit(spec, data, LOOP, vt(group(2), group(1)), tmp_path, "fail")


def test_resume_into_another_layout_then_export_to_hugging_face(tmp_path):
    """A 1 + 1 checkpoint continues in SP=2 / TP=2 with a 135-token vocabulary (TP2: 68 +
    67 rows a rank), whose checkpoint keeps and exports HF's shapes."""
    cfg = tiny_qwen2_5_vl_config(vocab_size=135)
    spec = HFModelSpec(config=cfg, seed=4)
    data = synthetic_samples(cfg, 12, grids=[(1, 4, 4), (1, 8, 4), None, (1, 4, 8)])
    first = fit(
        spec,
        data,
        dict(LOOP, max_steps=2),
        vt(group(1), group(1)),
        tmp_path,
        "layout-a",
        local=True,  # numerics only: Ray's part is the restart test's
    )
    second = fit(
        spec,
        data,
        LOOP,
        vt(group(2, SequenceParallel(size=2)), group(2, TensorParallel(size=2))),
        tmp_path,
        "layout-b",
        resume=first.checkpoint,
        local=True,
    )
    ref_losses, _, ref_model = reference_train(spec, data, TrainLoopConfig(**LOOP))
    both = losses(first) + losses(second)
    torch.testing.assert_close(torch.tensor(both), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    state = checkpoint_state(second.checkpoint)
    assert_params_close(state, ref_model.state_dict())

    out = export_hf(second.checkpoint, tmp_path / "hf")
    exported = Qwen2_5_VLForConditionalGeneration.from_pretrained(out).eval()
    assert exported.lm_head.weight.shape == (135, cfg.text_config.hidden_size)
    for k, v in exported.state_dict().items():
        assert torch.equal(v, state[k]), k
    batch = reference_batch(spec, data[:4])
    batch.pop("labels")
    with torch.no_grad():
        logits = exported(**batch).logits
        ref_logits = ref_model.eval()(**batch).logits
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
