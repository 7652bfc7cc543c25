"""Tier 1: the run's files on any storage (``ray_disagg.run_files``), on a local
directory and on a real S3-API server on 127.0.0.1 (moto's): the metrics history as one
appended ``metrics.jsonl`` or as segments where nothing appends, a later fit continuing
it, each step read back once (its last record), traces, and ``load_metrics`` / ``plot``
reading a run by its URI."""

import io
import json

import pytest

from ray_disagg import load_metrics
from ray_disagg.launch.progress import Progress
from ray_disagg.launch.step_feed import StepFeed
from ray_disagg.recipes.cli import main
from ray_disagg.run_files import (
    MetricsHistory,
    RunDir,
    read_metrics,
    read_records,
    read_traces,
    write_trace,
)


def _fit(run: RunDir, steps, flush_every_s: float = 3600.0) -> MetricsHistory:
    """One fit's driver: each step's metrics as they come, then the end of the fit."""
    history = MetricsHistory(run, flush_every_s=flush_every_s)
    for s in steps:
        history.add({"step": s, "loss": 10.0 - s, "fit": history.fit})
    history.close()
    return history


@pytest.fixture(params=["local", "s3"])
def run(request, tmp_path):
    if request.param == "local":
        return RunDir.of(tmp_path / "run")
    s3 = request.getfixturevalue("s3")
    return RunDir(s3.fs, f"runs/{request.node.name}")


def test_a_resumed_fit_continues_the_history_and_each_step_reads_back_once(run):
    _fit(run, [1, 2, 3])  # killed after step 3, checkpoint at 2: the next fit redoes 3
    second = _fit(run, [3, 4, 5])
    assert [r["step"] for r in read_records(run)] == [1, 2, 3, 3, 4, 5]
    rows = read_metrics(run)
    assert [(r["step"], r["loss"]) for r in rows] == [(s, 10.0 - s) for s in range(1, 6)]
    assert rows[2]["fit"] == second.fit  # the redone step: its last record
    if run.appends:
        assert run.read("metrics.jsonl").count(b"\n") == 6 and run.files("metrics") == []
    else:  # one segment per fit (nothing due before its end), numbered in order
        assert run.files("metrics") == ["00001-000000.jsonl", "00002-000000.jsonl"]
        assert run.read("metrics.jsonl") is None


def test_segments_are_written_while_the_fit_runs(s3):
    run = RunDir(s3.fs, "runs/segments")
    history = MetricsHistory(run, flush_every_s=0.0)  # due at every step
    for s in (1, 2):
        history.add({"step": s, "loss": 1.0})
        assert len(run.files("metrics")) == s  # readable before the fit ends
    history.close()
    assert history.pending == [] and [r["step"] for r in read_metrics(run)] == [1, 2]


def _no_new_buckets(s3):
    """The test server's filesystem without the right to make a bucket."""
    return type(s3.fs)(
        access_key="testing", secret_key="testing", region="us-east-1",
        endpoint_override=s3.endpoint, scheme="http",
    )  # fmt: skip


def test_a_failed_write_is_retried_with_the_next(s3, caplog):
    run = RunDir(_no_new_buckets(s3), "later/run")  # the bucket does not exist yet
    history = MetricsHistory(run, flush_every_s=0.0)  # (listing a missing bucket: none)
    history.add({"step": 1, "loss": 1.0})  # never raises: the run goes on
    assert "Could not write the metrics history" in caplog.text
    assert len(history.pending) == 1  # kept for the next write
    s3.fs.create_dir("later")  # the storage is back
    history.add({"step": 2, "loss": 1.0})
    assert [r["step"] for r in read_metrics(run)] == [1, 2] and history.pending == []


def test_what_cannot_be_written_at_the_end_goes_to_a_local_file(s3, caplog):
    history = MetricsHistory(RunDir(_no_new_buckets(s3), "never/run"))
    history.add({"step": 1, "loss": 1.0})
    history.close()
    path = caplog.text.split("they are in ")[1].split()[0]
    assert [r["step"] for r in read_metrics(path)] == [1] and history.pending == []


def test_the_feed_keeps_each_report_once_and_lets_go_of_what_was_taken():
    feed = StepFeed()
    feed.add({"step": 1, "loss": 2.0})
    feed.add({"step": 2, "loss": float("nan")})
    feed.add({"step": 2, "loss": float("nan")}, checkpoint=True)  # its async checkpoint
    feed.add({"epoch": 0})  # not a step's
    assert [r["step"] for r in feed.since(0)] == [1, 2]
    assert [r["step"] for r in feed.since(1)] == [2] and len(feed.rows) == 1  # 1 let go
    feed.add({"step": 2, "loss": 1.0}, checkpoint=True)  # a restart redid step 2
    assert [r["loss"] for r in feed.since(2)] == [1.0]


def test_the_poller_waits_out_a_busy_coordinator_and_stops_when_it_is_gone():
    from ray.exceptions import ActorDiedError, GetTimeoutError

    answers = [GetTimeoutError("busy"), [{"step": 1, "loss": 1.0, "lr": 1e-3,
               "tokens_per_s": 1.0, "step_time_s": 0.1}], ActorDiedError()]  # fmt: skip

    def fetch(n):
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    ticks = []
    progress = Progress(fetch, 3, stream=io.StringIO(), echo=lambda _: None,
                        on_tick=lambda: ticks.append(1))  # fmt: skip
    assert progress.poll() is None and not progress.gone  # busy: asked again later
    assert progress.poll() == 1 and ticks == [1]
    assert progress.poll() is None and progress.gone
    progress.stop()  # the last poll does not ask a coordinator that is gone
    assert [r["step"] for r in progress.rows] == [1] and answers == []


def test_a_result_is_read_where_its_run_is(s3, tmp_path):
    from ray.train import Result

    _fit(RunDir(s3.fs, "runs/result"), [1, 2])
    remote = Result(metrics={}, checkpoint=None, error=None, path="runs/result",
                    _storage_filesystem=s3.fs)  # fmt: skip
    assert load_metrics(remote)["step"].tolist() == [1, 2]
    _fit(RunDir.of(tmp_path), [1])
    local = Result(metrics={}, checkpoint=None, error=None, path=str(tmp_path))
    assert RunDir.of(local).appends and load_metrics(local)["step"].tolist() == [1]


def test_traces_on_any_storage(run):
    actions = [{"action": "F0", "start": 0.0, "end": 1.0, "waiting": False}]
    write_trace(run, "vision", 2, actions)
    write_trace(run, "text", 2, actions)
    write_trace(run, "vision", 2, [dict(actions[0], end=2.0)])  # a restart redid step 2
    traces = read_traces(run)
    assert set(traces) == {2} and set(traces[2]) == {"vision", "text"}
    assert traces[2]["vision"][0]["end"] == 2.0
    names = run.files("trace")
    assert names == (["text.jsonl", "vision.jsonl"] if run.appends
                     else ["text-step2.json", "vision-step2.json"])  # fmt: skip


def test_a_run_is_read_by_its_uri_and_plotted_from_the_bucket(s3, monkeypatch, tmp_path):
    for key, value in s3.env.items():
        monkeypatch.setenv(key, value)
    run = RunDir(s3.fs, "runs/by-uri")
    _fit(run, [1, 2, 3])
    write_trace(run, "text", 2, [{"action": "F0", "start": 0.0, "end": 1.0, "waiting": False}])
    uri = f"s3://runs/by-uri?endpoint_override={s3.endpoint}&scheme=http"
    assert load_metrics(uri)["step"].tolist() == [1, 2, 3]
    out = tmp_path / "pictures"
    paths = main(["plot", uri, "--out", str(out)])
    assert sorted(p.rsplit("/", 1)[1] for p in paths) == ["loss_curve.png", "timeline_step2.png"]
    with pytest.raises(FileNotFoundError, match=r"No metrics history in 'runs/nothing'"):
        read_metrics(RunDir(s3.fs, "runs/nothing"))


def test_a_local_run_is_read_by_its_directory_or_its_metrics_file(tmp_path):
    run = RunDir.of(tmp_path)
    _fit(run, [1, 2])
    for source in (tmp_path, str(tmp_path / "metrics.jsonl")):
        assert load_metrics(source)["loss"].tolist() == [9.0, 8.0]
    assert json.loads(run.read("metrics.jsonl").splitlines()[0])["step"] == 1


PLOT_ALONE = """
import json, sys
from ray_disagg.recipes.cli import main
run = sys.argv[1]
with open(run + "/metrics.jsonl", "w") as f:
    f.writelines(json.dumps({"step": s, "loss": 3.0 - s}) + "\\n" for s in (1, 2))
paths = main(["plot", run])
print(json.dumps({"paths": [p.rsplit("/", 1)[1] for p in paths],
                  "loaded": [m for m in ("ray", "ray_disagg.trainer") if m in sys.modules]}))
"""


def test_plot_reads_a_run_without_importing_ray_or_the_trainer(tmp_path):
    """``ray-disagg plot`` and ``load_metrics`` read the run's files through
    ``ray_disagg.run_files`` alone (a fresh interpreter: nothing else imported first)."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", PLOT_ALONE, str(tmp_path)],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"paths": ["loss_curve.png"], "loaded": []}


def test_the_latest_complete_checkpoint_and_export_refusing_what_is_neither(tmp_path, capsys):
    """A run's latest checkpoint is its highest ``checkpoint_<N>`` holding a config.json
    (one still being written is skipped); ``ray-disagg export`` of a directory that is
    neither a checkpoint nor a run with one exits 2 naming it."""
    for name, done in (("checkpoint_000001", True), ("checkpoint_000002", False)):
        (tmp_path / name).mkdir()
        if done:
            (tmp_path / name / "config.json").write_text("{}")
    (tmp_path / "checkpoint_tmp").mkdir()
    assert RunDir.of(tmp_path).latest_checkpoint() == str(tmp_path / "checkpoint_000001")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert RunDir.of(empty).latest_checkpoint() is None
    with pytest.raises(SystemExit) as e:
        main(["export", str(empty), str(tmp_path / "out")])
    assert e.value.code == 2
    assert "neither a checkpoint" in capsys.readouterr().err
