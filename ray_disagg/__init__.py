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
from ray_disagg.launch.backend import ModuleBackendConfig, TextBackendConfig, VisionBackendConfig
from ray_disagg.loop_config import TrainLoopConfig
from ray_disagg.lr_schedule import lr_at
from ray_disagg.model import HFModelSpec, Qwen2_5_VLSpec
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
    "Qwen2_5_VLSpec",
    "SampleError",
    "SequenceParallel",
    "TensorParallel",
    "TextBackendConfig",
    "TrainLoopConfig",
    "VisionBackendConfig",
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
