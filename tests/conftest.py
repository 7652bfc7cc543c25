import os
import types

os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray 2.60 turns 127.0.0.1 into the external interface address unless this is 0
# (../shared/ray-train-notes.md): keep every node, worker and store on loopback.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
# Ray's log monitor lists the session's log files every 0.1 s below 1,000 files (a Ray
# worker writes two; a session starts a few hundred): every 5 s is enough where no log
# reaches the driver (log_to_driver=False below).
os.environ.setdefault("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0")
os.environ.setdefault("LOG_NAME_UPDATE_INTERVAL_S", "5")

import pytest  # noqa: E402
import ray  # noqa: E402


@pytest.fixture(scope="session")
def ray_start_4_cpus():
    """A real local Ray cluster on loopback with 4 logical CPUs (fractional CPUs per worker
    let 4+2 layouts run on a 2-core machine). Each pytest-xdist worker starts its own."""
    ray.init(
        address="local",  # a cluster of its own: never one another test process started
        num_cpus=4,
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        log_to_driver=False,
        logging_level="WARNING",
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def s3():
    """A real S3-API server (moto's) on 127.0.0.1 with fixed credentials and a bucket
    ``runs``: the pyarrow ``S3FileSystem`` a run is given, its endpoint, and the
    credentials as environment variables (for URIs, as AWS's tools read them)."""
    import logging

    import pyarrow.fs as pafs
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1"}  # fmt: skip
    fs = pafs.S3FileSystem(
        access_key="testing", secret_key="testing", region="us-east-1",
        endpoint_override=endpoint, scheme="http", allow_bucket_creation=True,
    )  # fmt: skip
    fs.create_dir("runs")
    yield types.SimpleNamespace(fs=fs, endpoint=endpoint, env=env)
    server.stop()


@pytest.fixture(autouse=True)
def _no_ray_below_tier_3(request, monkeypatch):
    """Tiers 1 and 2 (``tests/unit``, ``tests/gloo``) run without Ray: a cluster that this
    pytest process started for tier 3 is hidden from them, so a ``ConversationStream``
    converts in this process, as in a fresh process, instead of on Ray Data actors (~20 s
    of actor start-up per test)."""
    if request.node.path.parent.name in ("unit", "gloo"):
        monkeypatch.setattr(ray, "is_initialized", lambda: False)


def pytest_collection_modifyitems(items):
    """Files in an order that overlaps the tiers: Ray files (waiting on process start-up,
    polls and restarts) alternate with gloo files (computing), and the short unit files
    come last to fill the end of the run; tests keep their order within a file. Every
    pytest-xdist worker collects the same order (``--dist loadfile`` hands out files in
    it)."""
    by_file: dict = {}
    for item in items:
        by_file.setdefault(item.path, []).append(item)
    tiers = {"ray": [], "gloo": [], "unit": []}
    rest = []
    for path in by_file:
        tiers.get(path.parent.name, rest).append(path)
    ray_files, gloo_files = tiers["ray"], tiers["gloo"]
    mixed = []
    for i in range(max(len(ray_files), len(gloo_files))):
        mixed += ray_files[i : i + 1] + gloo_files[i : i + 1]
    items[:] = [item for path in mixed + tiers["unit"] + rest for item in by_file[path]]


TIER_BUDGETS_S = {"unit": 120, "gloo": 480, "ray": 600}
"""Each tier's budget: the sum of its tests' durations (setup, call and teardown) in one
``make test`` on the 2-core CI machine, both pytest-xdist workers together; 1,200 s over
two workers is the 10 minutes that keep ``.ci/run`` (install and lint included) under
12 (``tests/README.md``). Printed at the end of a run against what the run took; never
asserted (tests do not assert wall time)."""


def pytest_terminal_summary(terminalreporter):
    spent = dict.fromkeys(TIER_BUDGETS_S, 0.0)
    for reports in terminalreporter.stats.values():
        for report in reports:
            tier = getattr(report, "nodeid", "").split("/")[1:2]
            if tier and tier[0] in spent and hasattr(report, "duration"):
                spent[tier[0]] += report.duration
    if any(spent.values()):
        terminalreporter.section("time per tier (summed over workers)")
        for tier, budget in TIER_BUDGETS_S.items():
            flag = "" if spent[tier] <= budget else "  OVER BUDGET"
            terminalreporter.write_line(f"{tier:5s} {spent[tier]:7.1f} s of {budget} s{flag}")
