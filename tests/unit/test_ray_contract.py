"""The Ray Train internals ray_disagg relies on (all imported via one module).

If this fails after a Ray upgrade, update the package ray_disagg/launch/ray_compat (and the
pinned range in pyproject.toml); nothing else in ray_disagg imports Ray internals or
names Ray's private attributes (``RAY_PRIVATES`` lists each one ray_compat touches).
"""

import ast
import dataclasses
import inspect
import pathlib
import re
import textwrap

import pytest
import ray

import ray_disagg
from ray_disagg.launch import ray_compat as rc

COMPAT = pathlib.Path(rc.__file__).parent


def _params(fn):
    return list(inspect.signature(fn).parameters)


def test_ray_version_is_tested():
    assert ".".join(ray.__version__.split(".")[:2]) in rc.TESTED_RAY_VERSIONS


def _modules_outside_ray_compat():
    root = pathlib.Path(ray_disagg.__file__).parent
    return [p for p in sorted(root.rglob("*.py")) if COMPAT not in p.parents]


def test_only_ray_compat_imports_ray_internals():
    offenders = []
    for path in _modules_outside_ray_compat():
        if re.search(
            r"ray\.train\.v2\._internal|ray\.train\.torch\.config|ray\._", path.read_text()
        ):
            offenders.append(path.name)
    assert offenders == []


def _assigned_on_self(cls) -> set[str]:
    """Every ``self.<name> = ...`` in the source of ``cls`` and its bases."""
    names = set()
    for klass in cls.__mro__:
        if klass.__module__ == "builtins":
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                targets = [node.target]
            targets = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
            names |= {
                t.attr
                for t in targets
                if isinstance(t, ast.Attribute)
                and isinstance(t.value, ast.Name)
                and t.value.id == "self"
            }
    return names


@pytest.mark.parametrize("private", rc.RAY_PRIVATES, ids=lambda p: p.name)
def test_every_wrapped_ray_private_exists(private):
    """Each private attribute the wrappers touch exists in the installed Ray."""
    if private.instance:
        assert private.name in _assigned_on_self(private.owner), private
    else:
        assert hasattr(private.owner, private.name), private


def _overrides(node) -> bool:
    """A method of one of ray_compat's subclasses of a Ray class that Ray defines."""
    return any(
        node.name in vars(klass)
        for owner in (
            rc.ControllerBase,
            rc.TrainerBase,
            rc.SharedPlacementWorkerGroup,
            rc.NamedPlacementWorkerGroup,
        )
        for klass in owner.__mro__[1:]
    )


def test_the_wrapped_privates_are_the_ones_ray_compat_touches():
    """Every ``_``-prefixed name ray_compat reads, calls, overrides or imports from Ray
    is listed in ``RAY_PRIVATES`` (its own private names aside)."""
    tree = ast.Module(
        body=[n for p in sorted(COMPAT.glob("*.py")) for n in ast.parse(p.read_text()).body],
        type_ignores=[],
    )
    own = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if not _overrides(node):
                own.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            own.add(node.attr)
    own -= {p.name for p in rc.RAY_PRIVATES if p.instance}  # Ray's, also assigned here
    touched = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            touched.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _overrides(node):
            touched.add(node.name)
        elif isinstance(node, ast.ImportFrom):
            touched |= {a.name for a in node.names}
            touched |= {m for m in (node.module or "").split(".") if m != "_internal"}
    touched = {n for n in touched if n.startswith("_") and not n.startswith("__")} - own
    assert touched == {p.name for p in rc.RAY_PRIVATES if p.name.startswith("_")}


def test_no_module_outside_ray_compat_names_a_ray_private():
    """Ray's private attributes are read, written and overridden in ray_compat only."""
    privates = {p.name for p in rc.RAY_PRIVATES if p.name.startswith("_")}
    offenders = []
    for path in _modules_outside_ray_compat():
        tree = ast.parse(path.read_text())
        methods = [
            f for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for f in c.body
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
        ]  # fmt: skip
        attrs = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute)]
        offenders += [
            f"{path.name}:{n.lineno} {getattr(n, 'attr', None) or n.name}"
            for n in attrs + methods
            if (getattr(n, "attr", None) or n.name) in privates
        ]
    assert offenders == []


def test_the_wrappers_on_ray_s_objects():
    """Ray's defaults filled in."""
    from ray.train import ScalingConfig

    sc = ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5})
    assert rc.resources_per_worker(sc) == {"CPU": 0.5}
    assert rc.resources_per_worker(ScalingConfig(num_workers=1)) == {"CPU": 1}
    assert not rc.label_selector_per_worker(sc, 2) or len(rc.label_selector_per_worker(sc, 2)) == 2


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
    assert inspect.iscoroutinefunction(ctrl._poll_workers)
    assert _params(ctrl._poll_workers) == ["self"]
    assert callable(ctrl.get_worker_group) and callable(ctrl.get_result)


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
    assert callable(rc.TorchBackend.on_start)


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


def test_the_files_pyproject_names_exist():
    """The Ray pin's comment points at the one module that imports Ray's internals."""
    repo = pathlib.Path(ray_disagg.__file__).parents[1]
    named = re.findall(r"ray_disagg/[\w/.]+", (repo / "pyproject.toml").read_text())
    assert "ray_disagg/launch/ray_compat/" in named
    assert all((repo / p).exists() for p in named), named
