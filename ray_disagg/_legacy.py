"""Module paths of the previous release, kept importable for one release.

``import ray_disagg.llava`` (and the other old paths below) still works: it returns the
module at its new path, with a ``DeprecationWarning`` naming it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED_MODULES = {
    "ray_disagg.backend": "ray_disagg.launch.backend",
    "ray_disagg.cli": "ray_disagg.recipes.cli",
    "ray_disagg.recipe": "ray_disagg.recipes.recipe",
    "ray_disagg.recipe_data": "ray_disagg.recipes.data",
    "ray_disagg.plan": "ray_disagg.planner.render",
    "ray_disagg.examples_data": "ray_disagg.data.examples",
    "ray_disagg.llava": "ray_disagg.data.llava",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module path and loads it as the module at its new path."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in MOVED_MODULES:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        new = MOVED_MODULES[spec.name]
        warnings.warn(
            f"{spec.name} moved to {new}; the old path goes away in the next release.",
            DeprecationWarning,
            stacklevel=3,
        )
        return importlib.import_module(new)

    def exec_module(self, module) -> None:
        pass  # already executed under its new name


def install() -> None:
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.append(_Alias())
