"""ray_disagg: disaggregated hybrid-parallel training of multimodal models on Ray Train.

Each part of the model (vision encoder, audio encoder, LLM) trains in its own Ray Train
worker group with its own ``ScalingConfig`` and parallelism; see
:class:`DisaggregatedTrainer`. Supported families: ``ray_disagg.models.ADAPTERS``.
"""

import importlib

# Public names -> the module defining each. Imported on first use (PEP 562), so that
# ``import ray_disagg`` is cheap: Ray starts a process per coordinator and worker, and
# each pays only for the modules it touches (a worker of one family never imports the
# other families' modeling code).
_EXPORTS = {
    "ADAPTERS": "ray_disagg.models",
    "BatchPlan": "ray_disagg.pipeline.assignment",
    "DataParallel": "ray_disagg.config.groups",
    "DisaggregatedTrainer": "ray_disagg.trainer",
    "DPO": "ray_disagg.objectives",
    "Objective": "ray_disagg.objectives",
    "GRPO": "ray_disagg.objectives",
    "TokenLogps": "ray_disagg.objectives",
    "HFModelSpec": "ray_disagg.model",
    "ModuleBackendConfig": "ray_disagg.launch.backend",
    "ModuleGroup": "ray_disagg.config.groups",
    "SampleError": "ray_disagg.pipeline.assignment",
    "SequenceParallel": "ray_disagg.config.groups",
    "ContextParallel": "ray_disagg.config.groups",
    "ExpertParallel": "ray_disagg.config.groups",
    "TensorParallel": "ray_disagg.config.groups",
    "TrainLoopConfig": "ray_disagg.config.loop",
    "export_hf": "ray_disagg.export",
    "get_adapter": "ray_disagg.models",
    "load_metrics": "ray_disagg.run_files",
    "lr_at": "ray_disagg.config.lr_schedule",
    "mix": "ray_disagg.data.mixture",
    "Mixture": "ray_disagg.data.mixture",
    "plot_metrics": "ray_disagg.plotting",
    "register_family": "ray_disagg.models",
    "tiny_gemma3_config": "ray_disagg.models",
    "tiny_internvl_config": "ray_disagg.models",
    "tiny_llava_onevision_config": "ray_disagg.models",
    "tiny_qwen2_5_omni_thinker_config": "ray_disagg.models",
    "tiny_qwen2_5_vl_config": "ray_disagg.models",
    "tiny_qwen2_vl_config": "ray_disagg.models",
    "tiny_qwen3_5_config": "ray_disagg.models",
    "tiny_qwen3_5_moe_config": "ray_disagg.models",
    "tiny_qwen3_vl_config": "ray_disagg.models",
    "tiny_qwen3_vl_moe_config": "ray_disagg.models",
}

__version__ = "0.1.0"

__all__ = sorted(_EXPORTS)  # the public API: exactly the lazily exported names


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'ray_disagg' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
