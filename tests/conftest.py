import os

os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray 2.60 turns 127.0.0.1 into the external interface address unless this is 0
# (../shared/ray-train-notes.md): keep every node, worker and store on loopback.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

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


@pytest.fixture(autouse=True)
def _no_ray_below_tier_3(request, monkeypatch):
    """Tiers 1 and 2 (``tests/unit``, ``tests/gloo``) run without Ray: a cluster that this
    pytest process started for tier 3 is hidden from them, so a ``ConversationStream``
    converts in this process, as in a fresh process, instead of on Ray Data actors (~20 s
    of actor start-up per test)."""
    if request.node.path.parent.name in ("unit", "gloo"):
        monkeypatch.setattr(ray, "is_initialized", lambda: False)
