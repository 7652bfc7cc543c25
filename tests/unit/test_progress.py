"""Tier 1: what the driver prints while a run trains (``ray_disagg.launch.progress``): the
step line, the start and end summaries, and the poller reading the metrics file as the
LLM group's rank 0 appends to it (complete lines only; a restart's repeated steps
replace theirs); a step's data wait from the workers' clocks to the line and the
step-times picture's bars; Ray Data's progress bars off where a run reads."""

import io
import time

import pandas as pd
import pytest
from ray.data import DataContext
from ray.train import ScalingConfig

from ray_disagg import DataParallel, ModuleGroup
from ray_disagg.launch import ray_compat as rc
from ray_disagg.launch.datasets import progress_bars
from ray_disagg.launch.progress import (
    Progress,
    end_lines,
    format_count,
    format_eta,
    start_lines,
    step_line,
)
from ray_disagg.plotting import _stack
from ray_disagg.worker.clock import StepClock
from ray_disagg.worker.stats import StepStats

STEP = {"step": 3, "loss": 1.25, "lr": 1e-3, "tokens_per_s": 900.4, "step_time_s": 0.5,
        "mean_step_time_s": 0.75}  # fmt: skip


def test_step_line_and_eta():
    assert step_line(STEP, 10) == (
        "step 3/10 loss 1.2500 lr 0.001 tokens/s 900 step 0.500s ETA 0:00:05"
    )
    line = step_line({**STEP, "val_loss": 2.0, "rewards/margins": 0.125}, 3)
    assert "val_loss 2.0000 margin 0.1250" in line and line.endswith("ETA 0:00:00")
    assert "tokens/s 900 MFU 41.3% step" in step_line({**STEP, "mfu": 0.4126}, 10)
    assert format_eta(3725) == "1:02:05" and format_eta(None) == "?" and format_eta(-1) == "?"
    assert [format_count(n) for n in (49_056, 306.8e6, 32.5e9, 12)] == [
        "49.1K",
        "306.8M",
        "32.5B",
        "12",
    ]


def test_a_steps_data_wait_is_its_own_figure():
    """Time getting the step's inputs (within the waiting spans) is ``<group>_data_wait_s``,
    out of ``<group>_wait_s``: the reading (LLM) group's read, another group's wait for
    its inputs as far as the read explains it; the line shows it from a tenth of the step,
    the picture stacks it between compute and wait."""
    clock = StepClock()
    with clock.span(waiting=True), clock.awaiting_inputs():
        time.sleep(0.01)
    with clock.span(waiting=False):
        pass
    with clock.paused(), clock.span(waiting=True), clock.awaiting_inputs():
        time.sleep(0.2)  # a validation pass: no step's time
    compute, wait, inputs = clock.take()
    assert 0.01 <= inputs <= wait < 0.2 and compute < wait
    assert clock.take() == (0.0, 0.0, 0.0)

    stats = StepStats(["vision", "text"], [], reader="text")
    s, ix = stats.new(), stats.index
    s[ix["cycle"]], s[ix["text_wait"]], s[ix["text_inputs"]] = 6.0, 5.9, 5.8  # read 5.8 s
    s[ix["vision_wait"]], s[ix["vision_inputs"]] = 6.5, 6.0  # 6 s for its inputs
    m = stats.metrics(s, 0, 0, {"lr": 1e-3}, 6.0)
    assert m["text_data_wait_s"] == m["vision_data_wait_s"] == 5.8
    assert m["text_wait_s"] == pytest.approx(0.1) and m["vision_wait_s"] == pytest.approx(0.7)
    s[ix["vision_inputs"]] = 2.0  # its inputs came 2 s into the read: all of it data wait
    m = stats.metrics(s, 0, 0, {"lr": 1e-3}, 6.0)
    assert m["vision_data_wait_s"] == 2.0 and m["vision_wait_s"] == pytest.approx(4.5)

    line = step_line({**STEP, "text_data_wait_s": 0.06, "vision_data_wait_s": 0.05}, 10)
    assert "step 0.500s (data wait 0.060s) ETA" in line
    assert "data wait" not in step_line({**STEP, "text_data_wait_s": 0.04}, 10)

    df = pd.DataFrame({"step": [1], "text_compute_s": [1.0], "text_wait_s": [0.5],
                       "text_data_wait_s": [2.0], "vision_compute_s": [1.0]})  # fmt: skip
    assert [(label, list(v)) for label, v, _ in _stack(df, "text")] == [
        ("compute", [1.0]), ("data wait", [2.0]), ("wait", [0.5])
    ]  # fmt: skip
    assert [label for label, _, _ in _stack(df, "vision")] == ["compute"]  # an older run


def test_ray_data_progress_bars_are_off_where_a_run_reads():
    """Unless ``verbose``: while the trainer reads its datasets on the driver (the user's
    context restored after), and for good in a worker (its group's start)."""
    here = DataContext.get_current().copy()
    with DataContext.current(here):
        with progress_bars([[{"id": 0}]], shown=False):
            assert not here.enable_progress_bars and not here.enable_operator_progress_bars
        assert here.enable_progress_bars and here.enable_operator_progress_bars
        with progress_bars([], shown=True):
            assert here.enable_progress_bars and here.enable_operator_progress_bars
        rc.quiet_data_progress()
        assert not here.enable_progress_bars and not here.enable_operator_progress_bars


def test_start_and_end_summaries():
    groups = {
        "vision": ModuleGroup(scaling_config=ScalingConfig(num_workers=1), trainable=False),
        "text": ModuleGroup(scaling_config=ScalingConfig(num_workers=2),
                            parallelism=DataParallel(fsdp=True)),
    }  # fmt: skip
    lines = start_lines(groups, {"vision": 4_760_000, "text": 306_800_000}, 60, "run-a")
    assert lines == [
        "run 'run-a': 60 steps, groups:",
        "  vision: 1 worker(s), parallelism DataParallel(), frozen, 4.8M parameters",
        "  text: 2 worker(s), parallelism DataParallel(fsdp=True), 306.8M parameters",
    ]
    rows = [
        {**STEP, "step": 1, "step_time_s": 2.0, "tokens_per_s": 100.0},
        {**STEP, "step": 2, "step_time_s": 1.0, "tokens_per_s": 200.0, "vision_restarts": 1},
    ]
    for row, mfu in zip(rows, (0.3, 0.6)):  # the mean weights each step by its time
        row.update(mfu=mfu, text_mfu=mfu)
    rows[0]["text_peak_memory_mb"], rows[1]["text_peak_memory_mb"] = 900.0, 950.0
    out = end_lines(rows, groups, 125.0, "/runs/a/checkpoint_000002")
    assert out[0] == (
        "done: 2 steps in 0:02:05 (wall), final loss 1.2500, 400 tokens in the reported "
        "steps, 133 tokens/s, MFU 40.0%"
    )
    assert out[1:] == [
        "  vision: peak memory 0 MB (rank 0), restarts 1",
        "  text: peak memory 950 MB (rank 0), restarts 0, MFU 40.0%",
        "  last checkpoint: /runs/a/checkpoint_000002",
    ]
    assert end_lines([], groups, 3.0, None) == ["done in 0:00:03: no step was reported"]


def test_the_poller_takes_each_new_report_and_keeps_each_steps_last():
    reports, lines, seen = [], [], []

    def fetch(n):  # the coordinator's feed: the reports after the first n
        return reports[n:]

    progress = Progress(fetch, 4, stream=io.StringIO(), echo=lines.append, on_step=seen.append)
    assert progress.poll() == 0 and lines == []  # nothing reported yet
    reports += [{**STEP, "step": 1}, {**STEP, "step": 2}]
    progress.poll()
    assert [line.split(" loss")[0] for line in lines] == ["step 1/4", "step 2/4"]
    reports.append({**STEP, "step": 2, "loss": 0.5})  # a restart redoes step 2
    progress.poll()
    assert len(lines) == 3 and [r["step"] for r in progress.rows] == [1, 2]
    assert progress.rows[-1]["loss"] == 0.5 and len(seen) == 3
