"""The Ray Train internals ray_disagg relies on (all imported via one module).

If this fails after a Ray upgrade, update ray_disagg/launch/ray_compat.py (and the
pinned range in pyproject.toml); nothing else in the package imports Ray internals.
"""

import dataclasses
import inspect
import pathlib
import re

import ray

from ray_disagg.launch import ray_compat as rc


def _params(fn):
    return list(inspect.signature(fn).parameters)


def test_ray_version_is_tested():
    assert ".".join(ray.__version__.split(".")[:2]) in rc.TESTED_RAY_VERSIONS


def test_only_ray_compat_imports_ray_internals():
    root = pathlib.Path(rc.__file__).parents[1]
    offenders = []
    for path in root.rglob("*.py"):
        if path.name == "ray_compat.py":
            continue
        if re.search(
            r"ray\.train\.v2\._internal|ray\.train\.torch\.config|ray\._", path.read_text()
        ):
            offenders.append(path.name)
    assert offenders == []


def test_controller_hooks_we_override_or_call():
    ctrl = rc.TrainController
    assert _params(ctrl.__init__)[1:] == [
        "train_fn_ref",
        "train_run_context",
        "scaling_policy",
        "failure_policy",
        "callbacks",
        "validation_config",
    ]
    assert _params(ctrl._start_worker_group) == ["self", "num_workers", "resources_per_worker"]
    src = inspect.getsource(ctrl)
    for attr in ("self._worker_group_callbacks_to_propagate", "self._train_run_context"):
        assert attr in src
    assert callable(ctrl._get_run_attempt_id) and callable(ctrl.get_result)


def test_worker_group_api():
    assert _params(rc.WorkerGroup.create) == [
        "train_run_context",
        "worker_group_context",
        "callbacks",
    ]
    for name in ("get_workers", "poll_status", "shutdown", "abort", "has_started"):
        assert callable(getattr(rc.WorkerGroup, name))
    fields = {f.name for f in dataclasses.fields(rc.WorkerGroupContext)}
    assert {
        "run_attempt_id",
        "train_fn_ref",
        "num_workers",
        "resources_per_worker",
        "placement_strategy",
        "label_selector",
    } <= fields
    assert "worker_statuses" in {f.name for f in dataclasses.fields(rc.WorkerGroupPollStatus)}
    assert {f.name for f in dataclasses.fields(rc.TrainRunContext)} >= {
        "run_id",
        "run_config",
        "scaling_config",
        "backend_config",
    }


def test_callbacks_and_trainer_hooks():
    for cb in (rc.ReportCallbackHandler, rc.UserCallbackHandler):
        for hook in ("after_worker_group_start", "after_worker_group_poll_status"):
            assert callable(getattr(cb, hook))
    assert _params(rc.BackendSetupCallback.__init__)[1:] == ["backend_config"]
    assert _params(rc.AcceleratorSetupCallback.__init__)[1:] == ["backend_config", "scaling_config"]
    for hook in ("_initialize_and_run_controller", "_create_default_callbacks"):
        assert callable(getattr(rc.DataParallelTrainer, hook))
    assert {"config", "train_func_context", "fn_arg_name"} <= set(_params(rc.construct_train_func))
    assert issubclass(rc._TorchBackend, object) and callable(rc._TorchBackend.on_start)


def test_thread_safe_callbacks_are_ray_train_worker_group_callbacks():
    """The groups start at once only with these callbacks: each must still exist in Ray
    Train as a WorkerGroupCallback (a rename would silently make every start sequential)."""
    import importlib
    import inspect
    import pkgutil

    import ray.train.v2._internal as internal

    from ray_disagg.launch.worker_groups import _THREAD_SAFE_CALLBACKS

    found = set()
    for mod in pkgutil.walk_packages(internal.__path__, internal.__name__ + "."):
        if "callback" not in mod.name and "checkpoint" not in mod.name:
            continue
        for name, cls in inspect.getmembers(importlib.import_module(mod.name), inspect.isclass):
            if name in _THREAD_SAFE_CALLBACKS and issubclass(cls, rc.WorkerGroupCallback):
                found.add(name)
    assert found == _THREAD_SAFE_CALLBACKS
