"""Tier 2 (the groups' workers without Ray): a traced 1F1B step records each group's
rank-0 actions in the order of the schedule's action lists, with their measured times,
and ``ray-disagg plot RUN_DIR`` draws the run (loss, step times, the traced step's
timeline); each group's data wait is apart from its wait; the step's MFU per group is its
samples' counted FLOPs over step time x workers x ``peak_tflops``."""

import os

import pytest

from ray_disagg import HFModelSpec, tiny_qwen2_5_vl_config
from ray_disagg.data.examples import synthetic_samples
from ray_disagg.pipeline.schedule import encoder_actions, llm_actions
from ray_disagg.recipes.cli import main
from ray_disagg.run_files import read_traces
from tests.helpers import group, run_layout, vt


def test_a_traced_1f1b_step_follows_the_schedule_and_is_plotted(tmp_path):
    cfg = tiny_qwen2_5_vl_config()
    loop = {"max_steps": 2, "global_batch_size": 6, "micro_batches": 3, "trace_steps": [2],
            "peak_tflops": 0.5, "report_sample_ids": True}  # fmt: skip
    data = synthetic_samples(cfg, 12)
    spec = HFModelSpec(config=cfg, seed=1)
    result = run_layout(spec, data, loop, vt(group(1), group(2)), tmp_path, "trace", local=True)
    _assert_mfu(spec.adapter, data, result.metrics, peak=0.5e12, workers={"vision": 1, "text": 2})
    m = result.metrics  # the LLM's reads are its data wait, not counted as waiting
    assert m["text_data_wait_s"] > 0 and 0 <= m["vision_data_wait_s"] <= m["text_data_wait_s"]
    assert m["text_wait_s"] >= 0 and m["vision_wait_s"] >= 0

    traces = read_traces(result.path)
    assert list(traces) == [2]  # only the traced step
    want = {  # 1F1B over 3 microbatches, 2 in flight (the default)
        "text": [str(a) for a in llm_actions(3, 2, sends_grads=True)],
        "vision": [str(a) for a in encoder_actions(3, 2, trains=True)],
    }
    for name, actions in traces[2].items():
        assert [a["action"] for a in actions] == want[name]
        starts = [a["start"] for a in actions]
        assert starts == sorted(starts) and all(a["end"] >= a["start"] for a in actions)
        assert any(a["waiting"] for a in actions) and not all(a["waiting"] for a in actions)

    out = tmp_path / "pictures"
    paths = main(["plot", result.path, "--out", str(out)])
    names = sorted(os.path.basename(p) for p in paths)
    assert names == ["loss_curve.png", "step_times.png", "timeline_step2.png"]
    assert all(os.path.getsize(p) > 1000 for p in paths)


def _assert_mfu(adapter, data, m, peak: float, workers: dict) -> None:
    samples = [data[i] for i in m["sample_ids"]]
    flops = {p: sum(adapter.sample_flops(p, s).training for s in samples) for p in workers}
    for p, n in workers.items():
        assert m[f"{p}_mfu"] == pytest.approx(flops[p] / (m["step_time_s"] * n * peak))
    total = sum(flops.values()) / (m["step_time_s"] * sum(workers.values()) * peak)
    assert m["mfu"] == pytest.approx(total)
    assert m["tflops_per_s"] == pytest.approx(sum(flops.values()) / m["step_time_s"] / 1e12)
