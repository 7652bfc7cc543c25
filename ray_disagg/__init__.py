"""ray_disagg: disaggregated hybrid-parallel training of vision-language models on Ray Train.

Each submodule of the model (vision encoder, LLM) trains in its own Ray Train worker group
with its own ``ScalingConfig`` and parallelism; see :class:`DisaggregatedTrainer`.
"""

from ray_disagg.backend import ModuleBackendConfig, TextBackendConfig, VisionBackendConfig
from ray_disagg.config import (
    DataParallel,
    ModuleGroup,
    SequenceParallel,
    TensorParallel,
    TrainLoopConfig,
)
from ray_disagg.data import BatchPlan, SampleError
from ray_disagg.export import export_hf
from ray_disagg.model import Qwen2_5_VLSpec, tiny_qwen2_5_vl_config
from ray_disagg.trainer import DisaggregatedTrainer

__version__ = "0.1.0"

__all__ = [
    "BatchPlan",
    "DataParallel",
    "DisaggregatedTrainer",
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
    "tiny_qwen2_5_vl_config",
]
