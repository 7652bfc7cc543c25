"""Model-family adapters, looked up by ``config.model_type``.

Adding a family = one new package (``adapter.py``, ``parallelize.py``, ``flavors.py``)
with a :class:`~ray_disagg.models.base.ModelAdapter` subclass, registered in ``ADAPTERS``
below.
"""

from __future__ import annotations

from ray_disagg.models.base import IGNORE_INDEX, Crossing, ModelAdapter, SampleError
from ray_disagg.models.gemma3 import Gemma3Adapter, tiny_gemma3_config
from ray_disagg.models.internvl import InternVLAdapter, tiny_internvl_config
from ray_disagg.models.llava_onevision import LlavaOnevisionAdapter, tiny_llava_onevision_config
from ray_disagg.models.qwen2_5_omni import (
    Qwen2_5OmniThinkerAdapter,
    tiny_qwen2_5_omni_thinker_config,
)
from ray_disagg.models.qwen2_5_vl import Qwen2_5_VLAdapter, tiny_qwen2_5_vl_config
from ray_disagg.models.qwen2_vl import Qwen2VLAdapter, tiny_qwen2_vl_config
from ray_disagg.models.qwen3_5 import Qwen3_5Adapter, tiny_qwen3_5_config
from ray_disagg.models.qwen3_5_moe import Qwen3_5MoeAdapter, tiny_qwen3_5_moe_config
from ray_disagg.models.qwen3_vl import Qwen3VLAdapter, tiny_qwen3_vl_config
from ray_disagg.models.qwen3_vl_moe import Qwen3VLMoeAdapter, tiny_qwen3_vl_moe_config

__all__ = [
    "ADAPTERS",
    "IGNORE_INDEX",
    "Crossing",
    "ModelAdapter",
    "SampleError",
    "get_adapter",
    "hf_param_name",
    "tiny_gemma3_config",
    "tiny_internvl_config",
    "tiny_llava_onevision_config",
    "tiny_qwen2_5_omni_thinker_config",
    "tiny_qwen2_5_vl_config",
    "tiny_qwen2_vl_config",
    "tiny_qwen3_5_config",
    "tiny_qwen3_5_moe_config",
    "tiny_qwen3_vl_config",
    "tiny_qwen3_vl_moe_config",
]

ADAPTERS: dict[str, type[ModelAdapter]] = {
    a.model_type: a
    for a in (
        Qwen2VLAdapter,
        Qwen2_5_VLAdapter,
        Qwen3VLAdapter,
        Qwen2_5OmniThinkerAdapter,
        Qwen3VLMoeAdapter,
        Qwen3_5Adapter,
        Qwen3_5MoeAdapter,
        Gemma3Adapter,
        InternVLAdapter,
        LlavaOnevisionAdapter,
    )
}


def get_adapter(config) -> ModelAdapter:
    """The adapter of ``config.model_type``; ``ValueError`` listing the supported types."""
    model_type = getattr(config, "model_type", None)
    if model_type not in ADAPTERS:
        raise ValueError(
            f"model_type {model_type!r} is not supported; supported model types: "
            f"{sorted(ADAPTERS)}."
        )
    return ADAPTERS[model_type](config)


def hf_param_name(name: str) -> tuple[str, int | None, int]:
    """:meth:`ModelAdapter.hf_param_name` of the registered family that splits ``name``
    (for code without an adapter at hand, e.g. reading a checkpoint directory);
    ``(name, None, 1)`` when none does."""
    for adapter in ADAPTERS.values():
        mapped = adapter.hf_param_name(name)
        if mapped[1] is not None:
            return mapped
    return name, None, 1
