"""What a run is asked to do, checked before any worker starts:

- :mod:`~ray_disagg.config.groups`: each module group's ``ModuleGroup`` (its Ray
  ``ScalingConfig``, parallelism, freezing, LoRA, standby, elasticity);
- :mod:`~ray_disagg.config.loop`: the ``train_loop_config`` (``TrainLoopConfig``) and
  :mod:`~ray_disagg.config.lr_schedule`, its learning-rate schedule;
- :mod:`~ray_disagg.config.settings`: the declared settings (defaults, checks, docs);
- :mod:`~ray_disagg.config.layout`: ``resolve()``, the one place that accepts or refuses
  a run (the trainer, ``plan`` and ``train``);
- :mod:`~ray_disagg.config.freezing`: which parameters of a part train.

The objectives (SFT, DPO, GRPO) are :mod:`ray_disagg.objectives`.
"""

from ray_disagg.config.groups import (
    ContextParallel,
    DataParallel,
    ExpertParallel,
    ModuleGroup,
    Parallelism,
    SequenceParallel,
    TensorParallel,
    TrainLoopConfig,
)

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
