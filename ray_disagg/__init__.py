"""ray_disagg: disaggregated hybrid-parallel training of multimodal models on Ray Train.

Each part of the model (vision encoder, audio encoder, LLM) trains in its own Ray Train
worker group with its own ``ScalingConfig`` and parallelism; see
:class:`DisaggregatedTrainer`. Supported families: ``ray_disagg.models.ADAPTERS``.
"""

from ray_disagg import _legacy
from ray_disagg.config import (
    DataParallel,
    ModuleGroup,
    SequenceParallel,
    TensorParallel,
)
from ray_disagg.export import export_hf
from ray_disagg.launch.backend import ModuleBackendConfig
from ray_disagg.loop_config import TrainLoopConfig
from ray_disagg.lr_schedule import lr_at
from ray_disagg.model import HFModelSpec
from ray_disagg.models import (
    ADAPTERS,
    get_adapter,
    tiny_qwen2_5_omni_thinker_config,
    tiny_qwen2_5_vl_config,
    tiny_qwen2_vl_config,
    tiny_qwen3_vl_config,
)
from ray_disagg.pipeline.assignment import BatchPlan, SampleError
from ray_disagg.plotting import plot_metrics
from ray_disagg.trainer import DisaggregatedTrainer, load_metrics

_legacy.install()

__version__ = "0.1.0"

__all__ = [
    "ADAPTERS",
    "BatchPlan",
    "DataParallel",
    "DisaggregatedTrainer",
    "HFModelSpec",
    "ModuleBackendConfig",
    "ModuleGroup",
    "SampleError",
    "SequenceParallel",
    "TensorParallel",
    "TrainLoopConfig",
    "export_hf",
    "get_adapter",
    "load_metrics",
    "lr_at",
    "plot_metrics",
    "tiny_qwen2_5_omni_thinker_config",
    "tiny_qwen2_5_vl_config",
    "tiny_qwen2_vl_config",
    "tiny_qwen3_vl_config",
]

# Names of the previous release, importable for one more (not in __all__): importing one
# from here, and constructing one from anywhere, emits a DeprecationWarning naming its
# replacement.
_DEPRECATED = {
    "Qwen2_5_VLSpec": ("ray_disagg.model", "HFModelSpec(config=...)"),
    "VisionBackendConfig": ("ray_disagg.launch.backend", "ModuleBackendConfig(...)"),
    "TextBackendConfig": ("ray_disagg.launch.backend", "ModuleBackendConfig(...)"),
}


def __getattr__(name: str):
    if name in _DEPRECATED:
        import importlib
        import warnings

        module, replacement = _DEPRECATED[name]
        warnings.warn(
            f"ray_disagg.{name} is deprecated and is removed in the next release; use "
            f"ray_disagg.{replacement}.",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module 'ray_disagg' has no attribute {name!r}")
