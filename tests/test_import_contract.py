"""Tier 1: imports flow one way. The layers below the runtime (model adapters, parallel
techniques, transports, the pipeline) never import the worker, the launcher, the trainer,
the test machinery or Ray; nothing in the package but ``ray_disagg.testing`` itself and the
tests imports ``ray_disagg.testing`` from a user's path."""

import ast
import pathlib

import pytest

import ray_disagg

ROOT = pathlib.Path(ray_disagg.__file__).parent
LOWER = ("models", "parallel", "transport", "pipeline")
FORBIDDEN = (
    "ray",
    "ray_disagg.worker",
    "ray_disagg.launch",
    "ray_disagg.recipes",
    "ray_disagg.testing",
    "ray_disagg.trainer",
)


def _imports(path: pathlib.Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return names


def _bad(name: str, forbidden) -> list[str]:
    return [x for x in forbidden if name == x or name.startswith(x + ".")]


@pytest.mark.parametrize("package", LOWER)
def test_layers_below_the_runtime_do_not_import_it(package):
    files = sorted((ROOT / package).rglob("*.py"))  # every subpackage too
    assert files
    for f in files:
        for name in _imports(f):
            assert not _bad(name, FORBIDDEN), f"{f.relative_to(ROOT)} imports {name}"


# The one door from the package into the test machinery: the workers' fault-drill hook,
# which imports ``ray_disagg.testing.faults`` only when RAY_DISAGG_FAULT_DRILL is set.
TEST_MACHINERY_DOORS = {pathlib.Path("worker", "faults_hook.py")}


def test_only_tests_reach_the_test_machinery():
    """``ray_disagg.testing`` (reference runner, fault injection) is imported by no module
    of the package outside it but the fault-drill hook: a user's configuration cannot
    reach it."""
    doors = set()
    for f in sorted(ROOT.rglob("*.py")):
        rel = f.relative_to(ROOT)
        if rel.parts[0] == "testing":
            continue
        for name in _imports(f):
            if _bad(name, ("ray_disagg.testing",)):
                assert rel in TEST_MACHINERY_DOORS, f"{rel} imports {name}"
                assert name in ("ray_disagg.testing", "ray_disagg.testing.faults"), name
                doors.add(rel)
    assert doors == TEST_MACHINERY_DOORS  # the hook really is the door


def test_nothing_outside_tests_benchmarks_and_testing_imports_the_reference_runner():
    """The single-process reference runner is for tests and benchmarks only."""
    repo = ROOT.parent
    allowed = ("tests", "benchmarks", "ray_disagg/testing")
    for f in sorted(repo.rglob("*.py")):
        rel = f.relative_to(repo).as_posix()
        if rel.startswith((".", "build/")) or "/.venv/" in f"/{rel}" or rel.startswith(allowed):
            continue
        text = f.read_text()
        assert "testing.reference" not in text and "reference_train" not in text, rel


def test_every_registered_adapter_has_its_own_module_and_tiny_config():
    from ray_disagg.models import ADAPTERS

    for model_type, adapter in ADAPTERS.items():
        assert adapter.model_type == model_type
        assert adapter.__module__.rsplit(".", 1)[-1] != "base"
        cfg = adapter.tiny_config()
        assert cfg.model_type == model_type
