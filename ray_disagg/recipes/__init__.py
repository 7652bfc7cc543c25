"""Recipes (YAML files naming a model, data, groups and loop settings), the
``ray-disagg`` command line, and the per-worker memory estimate of a layout."""
