"""Tier 1: the house rules that keep a step changeable: no module over 400 lines, no
function over 60 lines in the worker and the pipeline (where one step lives)."""

import ast
import pathlib

import ray_disagg

ROOT = pathlib.Path(ray_disagg.__file__).parent


def test_no_module_over_400_lines():
    long = {
        str(p.relative_to(ROOT)): n
        for p in ROOT.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 400
    }
    assert long == {}


def test_no_function_over_60_lines_in_the_step():
    long = {}
    for package in ("worker", "pipeline"):
        for p in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(p.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = node.end_lineno - node.lineno + 1
                    if n > 60:
                        long[f"{p.relative_to(ROOT)}:{node.name}"] = n
    assert long == {}
