"""Model-family adapters, looked up by ``config.model_type``.

Adding a family = one new package (``adapter.py``, ``parallelize.py``, ``flavors.py``)
with a :class:`~ray_disagg.models.base.ModelAdapter` subclass: inside this package a line
in ``_FAMILIES`` below, outside it :func:`register_family` (imported on first use).
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Iterator, Mapping

from ray_disagg.models.base import IGNORE_INDEX, Crossing, ModelAdapter, SampleError

# model_type -> (module holding the adapter, adapter class or None to find it, tiny config
# function or None). A family's module (and with it its transformers modeling code) is
# imported on first use, as transformers' auto classes do: a worker imports its own
# family only.
_FAMILIES: dict[str, tuple[str, str | None, str | None]] = {
    t: (f"ray_disagg.models.{pkg}", cls, tiny)
    for t, (pkg, cls, tiny) in {
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
        "llava_onevision": (
            "llava_onevision",
            "LlavaOnevisionAdapter",
            "tiny_llava_onevision_config",
        ),
    }.items()
}
_TINY = {tiny: module for module, _, tiny in _FAMILIES.values() if tiny}


def _package(model_type: str) -> str:
    return _FAMILIES[model_type][0]


def register_family(model_type: str, module: str, *, exist_ok: bool = False) -> None:
    """Add a model family kept in a package of your own, without editing this one:
    ``module`` (``"package.module"`` or ``"package.module:AdapterClass"``) holds its
    :class:`ModelAdapter` subclass (without a class name: the one whose ``model_type``
    is ``model_type``), imported when a config of that ``model_type`` is first looked up.
    Call it where your package is imported (its ``__init__``), beside transformers'
    ``AutoConfig.register`` for a new ``model_type``: workers import it when they unpickle
    your config, and register it there too. Registering the same module again is a no-op;
    another module for a known ``model_type`` is a ``ValueError`` unless ``exist_ok``.
    See ``docs/families.md``."""
    if not isinstance(model_type, str) or not model_type:
        raise ValueError(f"register_family: model_type must be a non-empty str, got {model_type!r}")
    path, _, cls = module.partition(":")
    entry = (path, cls or None, None)
    old = _FAMILIES.get(model_type)
    if old is not None and old[:2] != entry[:2] and not exist_ok:
        raise ValueError(
            f"register_family: model_type {model_type!r} is already served by "
            f"{old[0]}{':' + old[1] if old[1] else ''}; pass exist_ok=True to replace it."
        )
    _FAMILIES[model_type] = entry


def _adapter_class(model_type: str) -> type[ModelAdapter]:
    path, name, _ = _FAMILIES[model_type]
    module = importlib.import_module(path)
    if name is not None:
        return getattr(module, name)
    found = [
        c
        for c in vars(module).values()
        if inspect.isclass(c)
        and issubclass(c, ModelAdapter)
        and getattr(c, "model_type", None) == model_type
    ]
    if len(found) != 1:
        raise ValueError(
            f"{path} has {len(found)} ModelAdapter subclasses with model_type "
            f"{model_type!r}; name one: register_family({model_type!r}, '{path}:Class')."
        )
    return found[0]


class _Adapters(Mapping):
    """``model_type`` -> adapter class; a family's package is imported when its class is
    first looked up (listing the model types imports nothing)."""

    def __getitem__(self, model_type: str) -> type[ModelAdapter]:
        if model_type not in _FAMILIES:
            raise KeyError(model_type)
        return _adapter_class(model_type)

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
    "register_family",
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
        value = getattr(importlib.import_module(_TINY[name]), name)
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
