"""Tier 1: the house rules that keep the code changeable: no module over 400 lines and no
function over 60 lines anywhere in the package."""

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


def test_no_function_over_60_lines():
    long = {}
    for p in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 60:
                    long[f"{p.relative_to(ROOT)}:{node.name}"] = n
    assert long == {}
