"""Tier 1: imports flow one way. Model adapters and parallel techniques never import the
runtime (``ray_disagg._internal``, the trainer) or Ray."""

import ast
import pathlib

import pytest

import ray_disagg

ROOT = pathlib.Path(ray_disagg.__file__).parent
FORBIDDEN = ("ray", "ray_disagg._internal", "ray_disagg.trainer", "ray_disagg.backend")


def _imports(path: pathlib.Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return names


@pytest.mark.parametrize("package", ["models", "parallel"])
def test_layers_below_the_runtime_do_not_import_it(package):
    files = sorted((ROOT / package).glob("*.py"))
    assert files
    for f in files:
        for name in _imports(f):
            bad = [x for x in FORBIDDEN if name == x or name.startswith(x + ".")]
            assert not bad, f"{f.relative_to(ROOT)} imports {name}"


def test_every_registered_adapter_has_its_own_file_and_tiny_config():
    from ray_disagg.models import ADAPTERS

    for model_type, adapter in ADAPTERS.items():
        assert adapter.model_type == model_type
        assert pathlib.Path(adapter.__module__.replace(".", "/") + ".py").name != "base.py"
        cfg = adapter.tiny_config()
        assert cfg.model_type == model_type
