"""What a run is asked to do, checked before any worker starts:

- :mod:`~ray_disagg.config.groups`: each module group's ``ModuleGroup`` (its Ray
  ``ScalingConfig``, parallelism, freezing, LoRA, standby, elasticity);
- :mod:`~ray_disagg.config.loop`: the ``train_loop_config`` (``TrainLoopConfig``) and
  :mod:`~ray_disagg.config.lr_schedule`, its learning-rate schedule;
- :mod:`~ray_disagg.config.settings`: the declared settings (defaults, checks, docs);
- :mod:`~ray_disagg.config.layout`: ``resolve()``, the one place that accepts or refuses
  a run (the trainer, ``plan`` and ``train``);
- :mod:`~ray_disagg.config.freezing`: which parameters of a part train.

The objectives (SFT, DPO, GRPO) are :mod:`ray_disagg.objectives`. The group configs are
importable from here too (``from ray_disagg.config import ModuleGroup``), loaded on first
use: importing one of the modules above loads only what it imports.
"""

import importlib

__all__ = [
    "ContextParallel",
    "DataParallel",
    "ExpertParallel",
    "ModuleGroup",
    "Parallelism",
    "SequenceParallel",
    "TensorParallel",
    "TrainLoopConfig",
]


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module("ray_disagg.config.groups"), name)
    raise AttributeError(f"module 'ray_disagg.config' has no attribute {name!r}")
