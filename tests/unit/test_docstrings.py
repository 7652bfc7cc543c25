"""Tier 1: every ``Example:`` in the package's docstrings runs and prints what it shows
(``doctest`` over each module of ``ray_disagg``)."""

import doctest
import importlib
import pkgutil

import pytest

import ray_disagg

MODULES = sorted(m.name for m in pkgutil.walk_packages(ray_disagg.__path__, prefix="ray_disagg."))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed"
