"""End to end under Ray Jobs: examples/train_tiny_vlm.py submitted with the Jobs SDK to a
local head node that this test starts and stops itself (independent of the session cluster
of conftest.py, which it never touches: no ``ray stop``)."""

from __future__ import annotations

import contextlib
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
from ray.job_submission import JobStatus, JobSubmissionClient

from ray_disagg import load_metrics

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "train_tiny_vlm.py"
RAY_CLI = Path(sys.executable).parent / "ray"  # this venv's, next to its python
RUN_NAME = "tiny-vlm-digits"  # the example's RunConfig(name=...)
GROUPS = ("vision", "text")
STEPS = 3
START_TIMEOUT_S = 120
JOB_TIMEOUT_S = 360
STOP_PATIENCE_S = 30


@dataclass
class HeadNode:
    root: Path  # everything of this head lives under it: Ray's temp dir, the runs
    dashboard_url: str
    headers: dict
    log: Path

    def client(self) -> JobSubmissionClient:
        return JobSubmissionClient(self.dashboard_url, headers=self.headers)


def _free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on 127.0.0.1 now (all held open while choosing)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _live_processes(pgid: int, marker: str) -> dict[int, str]:
    """Live (not zombie) processes of the head: in its process group, or whose command
    line names its private directory ``marker`` (raylet, gcs_server, dashboard, workers,
    the job's driver: each is given a path under it)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        pid = int(entry)
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue  # gone meanwhile
        fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp
        if fields[0] == "Z":
            continue
        if int(fields[2]) == pgid or marker in cmd:
            found[pid] = cmd[:200]
    return found


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # the group is empty
        os.killpg(pgid, sig)


def _stop_head(proc: subprocess.Popen, marker: str) -> dict[int, str]:
    """Stop this head node only (never ``ray stop``: it stops every Ray on the machine).
    SIGTERM makes ``ray start --block`` stop its node in order (raylet, GCS, the rest; each
    SIGKILLed after a second); then whatever is left of the head's process group or names
    its directory is SIGKILLed, by pid. Returns the processes still alive (should be none)."""
    pgid = proc.pid  # start_new_session=True: the group (and session) leader
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=STOP_PATIENCE_S)
    deadline = time.monotonic() + 10  # workers exit once their raylet is gone
    while time.monotonic() < deadline and _live_processes(pgid, marker):
        time.sleep(0.5)
    for pid in _live_processes(pgid, marker):  # ours by construction: named by pid
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _signal_group(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
    time.sleep(1)
    return _live_processes(pgid, marker)


def _tail(path: Path, n: int = 6000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError as e:
        return f"<{path}: {e}>"


@pytest.fixture
def head_node():
    """A Ray head node on 127.0.0.1 in its own process group, with its own temp dir, every
    port pinned to a free one (no clash with the session cluster or other Ray runs on the
    machine) and token authentication with its own token (not ~/.ray/auth_token)."""
    root = Path(tempfile.mkdtemp(prefix="rdj_", dir="/tmp"))  # short: Unix socket paths
    token = secrets.token_hex(32)
    (
        gcs,
        dashboard,
        agent_http,
        agent_grpc,
        runtime_env_agent,
        metrics,
        node_manager,
        object_manager,
        client_server,
    ) = _free_ports(9)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_")}
    # a user's head: Ray's default log monitor (conftest.py slows the session clusters')
    log_monitor = ("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "LOG_NAME_UPDATE_INTERVAL_S")
    for name in ("RAY_ADDRESS", *log_monitor):
        env.pop(name, None)
    env.update(
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",  # node, workers and driver on 127.0.0.1
        RAY_AUTH_MODE="token",  # explicit: the default depends on ~/.ray/auth_token
        RAY_AUTH_TOKEN=token,  # inherited by the raylet, the job supervisor and the driver
        RAY_USAGE_STATS_ENABLED="0",
        # Ray 2.60: on SIGTERM `ray start --block` first drains the node, up to 30 s by
        # default; nothing here needs draining.
        RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",
    )
    cmd = [
        str(RAY_CLI),
        "start",
        "--head",
        "--block",
        "--node-ip-address=127.0.0.1",
        f"--port={gcs}",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dashboard}",
        f"--dashboard-agent-listen-port={agent_http}",
        f"--dashboard-agent-grpc-port={agent_grpc}",
        f"--runtime-env-agent-port={runtime_env_agent}",
        f"--metrics-export-port={metrics}",
        f"--node-manager-port={node_manager}",
        f"--object-manager-port={object_manager}",
        f"--ray-client-server-port={client_server}",
        "--num-cpus=2",
        f"--object-store-memory={256 * 1024**2}",
        f"--temp-dir={root / 'ray'}",
        "--disable-usage-stats",
    ]
    log = root / "ray_start.log"
    node = HeadNode(
        root=root,
        dashboard_url=f"http://127.0.0.1:{dashboard}",
        headers={"Authorization": f"Bearer {token}"},
        log=log,
    )
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stopped alone, by pgid
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:  # up when the Jobs API answers (the client checks the connection)
            if proc.poll() is not None:
                pytest.fail(f"ray start exited with {proc.returncode}:\n{_tail(log)}")
            try:
                node.client()
                break
            except Exception as e:
                if time.monotonic() > deadline:
                    pytest.fail(f"Jobs API not up after {START_TIMEOUT_S}s ({e}):\n{_tail(log)}")
                time.sleep(1)
        yield node
    finally:
        leftovers = _stop_head(proc, str(root))
        shutil.rmtree(root, ignore_errors=True)
    assert not leftovers, f"processes of the test's head node left running: {leftovers}"


def test_example_as_ray_job(head_node):
    client = head_node.client()
    storage = head_node.root / "runs"
    entrypoint = shlex.join(
        [
            sys.executable,  # this venv's python (no runtime_env: it would upload the .venv)
            str(EXAMPLE),
            f"--steps={STEPS}",
            "--samples=24",
            "--batch-size=4",
            f"--storage={storage}",
            "--skip-loss-check",  # 3 steps do not halve the loss
        ]
    )
    # The Jobs API answers before the head's job agent has registered ("No available
    # agent to submit job, please try again later"), or drops the connection while it
    # starts: retry those, under one submission id (a dropped submission may have been
    # taken: then that job is the one).
    deadline, job_id = time.monotonic() + START_TIMEOUT_S, f"example-{uuid.uuid4().hex[:8]}"
    while True:
        try:
            client.submit_job(entrypoint=entrypoint, submission_id=job_id)
            break
        except requests.exceptions.ConnectionError:
            if time.monotonic() > deadline:
                raise
            with contextlib.suppress(Exception):
                client.get_job_status(job_id)  # taken after all
                break
        except RuntimeError as e:
            if "try again later" not in str(e) or time.monotonic() > deadline:
                raise
        time.sleep(1)

    terminal = {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}
    deadline = time.monotonic() + JOB_TIMEOUT_S
    status = _job_status(head_node, job_id)
    while status not in terminal and time.monotonic() < deadline:
        time.sleep(2)
        status = _job_status(head_node, job_id)
    if status not in terminal:
        client.stop_job(job_id)
    logs = client.get_job_logs(job_id)
    assert status == JobStatus.SUCCEEDED, (
        f"job {job_id} ended {status} (timeout {JOB_TIMEOUT_S}s); its logs:\n{logs[-8000:]}"
        f"\n--- ray start log:\n{_tail(head_node.log, 3000)}"
    )

    run_dir = storage / RUN_NAME
    checkpoints = sorted(p for p in run_dir.glob("checkpoint_*") if p.is_dir())
    assert checkpoints, f"no checkpoint in {run_dir}: {sorted(os.listdir(run_dir))}\n{logs}"
    last = checkpoints[-1]
    for group in GROUPS:
        shards = list((last / group).glob("*.distcp"))
        assert (last / group / ".metadata").is_file() and shards, (
            f"{last / group}: no DCP shards of group {group!r}: "
            f"{sorted(os.listdir(last)) if last.is_dir() else 'missing'}"
        )
    assert list(load_metrics(run_dir)["step"]) == list(range(1, STEPS + 1))
    png = run_dir / "loss_curve.png"
    assert png.is_file(), f"no {png}; job logs:\n{logs[-4000:]}"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"loss curve: {png}" in logs
    # each step's line reaches the job's output exactly once (Ray Train's patched print
    # used to put every line there twice), and the groups logged their weight loading
    for step in range(1, STEPS + 1):
        assert logs.count(f"[ray_disagg] step {step}/{STEPS} ") == 1, logs[-4000:]
    assert "[ray_disagg] text: loading weights from random init" in logs


def _job_status(node: HeadNode, job_id: str, patience_s: float = 60.0) -> JobStatus:
    """The job's status; a refused connection (the dashboard's HTTP server restarting
    under a loaded machine) is retried for ``patience_s``, then fails with the dashboard's
    log."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            return node.client().get_job_status(job_id)
        except (requests.exceptions.ConnectionError, ConnectionError) as e:
            if time.monotonic() > deadline:
                logs = node.root / "ray" / "session_latest" / "logs"
                pytest.fail(
                    f"the dashboard stopped answering ({e}):\n{_tail(logs / 'dashboard.log')}"
                    f"\n--- ray start log:\n{_tail(node.log, 3000)}"
                )
            time.sleep(2)
