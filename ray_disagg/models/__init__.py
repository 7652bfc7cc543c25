"""Model-family adapters, looked up by ``config.model_type``.

Adding a family = one new package (``adapter.py``, ``parallelize.py``, ``flavors.py``)
with a :class:`~ray_disagg.models.base.ModelAdapter` subclass, registered by its
``model_type`` in ``_FAMILIES`` below (imported on first use).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator, Mapping

from ray_disagg.models.base import IGNORE_INDEX, Crossing, ModelAdapter, SampleError

# model_type -> (package under ray_disagg.models, adapter class, tiny config function).
# A family's package (and with it its transformers modeling code) is imported on first
# use, as transformers' auto classes do: a worker imports its own family only.
_FAMILIES = {
    "qwen2_vl": ("qwen2_vl", "Qwen2VLAdapter", "tiny_qwen2_vl_config"),
    "qwen2_5_vl": ("qwen2_5_vl", "Qwen2_5_VLAdapter", "tiny_qwen2_5_vl_config"),
    "qwen3_vl": ("qwen3_vl", "Qwen3VLAdapter", "tiny_qwen3_vl_config"),
    "qwen2_5_omni_thinker": (
        "qwen2_5_omni",
        "Qwen2_5OmniThinkerAdapter",
        "tiny_qwen2_5_omni_thinker_config",
    ),
    "qwen3_vl_moe": ("qwen3_vl_moe", "Qwen3VLMoeAdapter", "tiny_qwen3_vl_moe_config"),
    "qwen3_5": ("qwen3_5", "Qwen3_5Adapter", "tiny_qwen3_5_config"),
    "qwen3_5_moe": ("qwen3_5_moe", "Qwen3_5MoeAdapter", "tiny_qwen3_5_moe_config"),
    "gemma3": ("gemma3", "Gemma3Adapter", "tiny_gemma3_config"),
    "internvl": ("internvl", "InternVLAdapter", "tiny_internvl_config"),
    "llava_onevision": ("llava_onevision", "LlavaOnevisionAdapter", "tiny_llava_onevision_config"),
}
_TINY = {tiny: package for package, _, tiny in _FAMILIES.values()}


def _package(model_type: str) -> str:
    return f"ray_disagg.models.{_FAMILIES[model_type][0]}"


class _Adapters(Mapping):
    """``model_type`` -> adapter class; a family's package is imported when its class is
    first looked up (listing the model types imports nothing)."""

    def __getitem__(self, model_type: str) -> type[ModelAdapter]:
        if model_type not in _FAMILIES:
            raise KeyError(model_type)
        return getattr(importlib.import_module(_package(model_type)), _FAMILIES[model_type][1])

    def __contains__(self, model_type) -> bool:
        return model_type in _FAMILIES

    def __iter__(self) -> Iterator[str]:
        return iter(_FAMILIES)

    def __len__(self) -> int:
        return len(_FAMILIES)


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

ADAPTERS: Mapping[str, type[ModelAdapter]] = _Adapters()


def __getattr__(name: str):
    if name in _TINY:  # a family's tiny config: imports that family only
        value = getattr(importlib.import_module(f"ray_disagg.models.{_TINY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ray_disagg.models' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


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
    """:meth:`ModelAdapter.hf_param_name` of the loaded family that splits ``name`` (for
    code without an adapter at hand, e.g. reading a checkpoint directory of a part this
    process built); ``(name, None, 1)`` when none does."""
    for model_type in _FAMILIES:
        if _package(model_type) not in sys.modules:
            continue  # a family never loaded here has built no part here
        mapped = ADAPTERS[model_type].hf_param_name(name)
        if mapped[1] is not None:
            return mapped
    return name, None, 1
