"""LoRA on a part, with PEFT's own configs, layers and adapter files.

A part under LoRA is its pruned HF model with PEFT's ``LoraLayer``s injected where the
config's ``target_modules`` (PEFT's matching: name suffixes or a regex, against the full
HF module names, so ``["gate_proj"]`` adapts the tower's and the LLM's alike) match, on
the ``meta`` device before any parallel plan. Its base weights are frozen; the factors
and the ``modules_to_save`` modules are trained. A ``modules_to_save`` module is trained
in place (PEFT trains a copy beside the frozen original; both start equal, so the
numerics are PEFT's at half the memory).

The one name map between the part's parameters and everything outside it:

=============================================  ============================================
part parameter                                 HF weights / PEFT adapter file
=============================================  ============================================
``<module>.base_layer.weight``                 ``<module>.weight`` (the base model's)
``<module>.lora_A.default.weight``             ``base_model.model.<module>.lora_A.weight``
``<module under modules_to_save>.<param>``     ``base_model.model.<module>.<param>``
=============================================  ============================================

Factor dtypes: always fp32 (as PEFT's ``autocast_adapter_dtype``), also beside a bf16 base
with ``param_dtype="bfloat16"``; under ``bf16=True`` FSDP2's policy computes them in bf16
like the base (its master copy stays fp32).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ray_disagg.models.loading import name_seed
from ray_disagg.parallel.row_blocks import block_rows

__all__ = [
    "ADAPTER",
    "adapter_names",
    "adapters_disabled",
    "scalings",
    "FILE_PREFIX",
    "PartLora",
    "base_name",
    "check_adapter_file",
    "check_lora_config",
    "file_key",
    "hf_name_map",
    "inject",
    "is_factor",
    "lora_weights",
    "read_adapter_config",
    "require_peft",
    "saved_modules",
    "tied_saved",
    "unsupported_layers",
]

ADAPTER = "default"  # PEFT's adapter name inside the layers
FILE_PREFIX = "base_model.model."  # PeftModel's prefix of every key in its files
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_INITS = (True, False, "gaussian")
# LoraConfig fields this package does not train with, and their off values
_UNSUPPORTED = {
    "use_dora": (False, "DoRA"),
    "lora_bias": (False, "LoRA biases"),
    "target_parameters": (None, "target_parameters (LoRA on raw parameters, e.g. MoE experts)"),
    "trainable_token_indices": (None, "trainable_token_indices"),
    "layer_replication": (None, "layer_replication"),
    "use_qalora": (False, "QALoRA"),
    "alora_invocation_tokens": (None, "aLoRA"),
    "ensure_weight_tying": (False, "ensure_weight_tying"),
    "use_bdlora": (None, "BD-LoRA"),
    "velora_config": (None, "VeLoRA"),
    "monteclora_config": (None, "MonteCLoRA"),
    "arrow_config": (None, "Arrow"),
    "kasa_config": (None, "KaSA"),
}
# initializations whose factors pair with a rewritten base (PiSSA, OLoRA, CorDA, LoftQ,
# LoRA-GA subtract their start from the base weights)
_REWRITES_BASE = ("pissa", "olora", "corda", "loftq", "lora_ga")


def require_peft():
    """The ``peft`` module (``ValueError`` naming the extra when it is not installed)."""
    try:
        import peft
    except ImportError as e:
        raise ValueError("LoRA needs PEFT: pip install 'ray_disagg[lora]' (peft 0.21).") from e
    return peft


def check_lora_config(config: Any, label: str, saved: bool = False) -> None:
    """``ValueError`` naming ``label`` (e.g. ``"groups['text'].peft_config"``) unless
    ``config`` is a ``peft.LoraConfig`` this package trains with (``saved``: the config of
    an adapter directory, whose factors are read rather than initialized)."""
    peft = require_peft()
    if not isinstance(config, peft.LoraConfig):
        raise ValueError(
            f"{label}: a {type(config).__name__}; only LoRA is supported "
            "(peft.LoraConfig(r=..., lora_alpha=..., target_modules=[...]))."
        )
    if not config.target_modules:
        raise ValueError(
            f"{label}: target_modules is not set; name the modules to adapt, e.g. "
            "target_modules=['q_proj', 'k_proj', 'v_proj', 'o_proj'] or 'all-linear'."
        )
    if config.bias != "none":
        raise ValueError(f"{label}: bias={config.bias!r} is not supported; use bias='none'.")
    init = config.init_lora_weights
    if saved and str(init).lower().startswith(_REWRITES_BASE):
        raise ValueError(
            f"{label}: made with init_lora_weights={init!r}, whose factors pair with a "
            "rewritten base, not the pretrained weights; convert it to a plain LoRA first "
            "(PEFT: save_pretrained(path_initial_model_for_weight_conversion=...))."
        )
    if not saved and init not in _INITS:
        raise ValueError(
            f"{label}: init_lora_weights={init!r} is not supported (PiSSA, OLoRA, LoftQ, "
            "CorDA and LoRA-GA rewrite the base weights; EVA needs data): use True, False "
            "or 'gaussian'."
        )
    for field, (off, what) in _UNSUPPORTED.items():
        if getattr(config, field, off) not in (off, None, False, [], {}):
            raise ValueError(f"{label}: {what} is not supported; leave {field} unset.")


def read_adapter_config(path: str) -> Any:
    """The ``LoraConfig`` of a PEFT adapter directory (``PeftModel.save_pretrained``),
    checked (``ValueError`` naming the missing file or the unsupported setting)."""
    peft = require_peft()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not os.path.isfile(os.path.join(path, name)):
            raise ValueError(
                f"peft_path={path!r} has no {name}; pass a directory written by "
                "PeftModel.save_pretrained (safetensors)."
            )
    with open(os.path.join(path, CONFIG_FILE)) as f:
        kind = json.load(f).get("peft_type")
    if kind != "LORA":
        raise ValueError(f"peft_path={path!r}: a {kind} adapter; only LoRA is supported.")
    config = peft.LoraConfig.from_pretrained(path)
    check_lora_config(config, f"peft_path={path!r}", saved=True)
    return config


@dataclass(frozen=True)
class PartLora:
    """The adapter of one part: PEFT's config and where its initial factors come from."""

    config: Any
    """The ``peft.LoraConfig``."""
    path: str | None = None
    """A PEFT adapter directory the factors (and ``modules_to_save``) start from; ``None``:
    fresh factors, initialized as ``init_lora_weights`` says."""
    seed: int = 0
    """Seed of fresh factors (a function of the seed and the parameter's name alone)."""


def inject(model: nn.Module, config: Any) -> list[str]:
    """Put PEFT's LoRA layers into ``model`` in place (on ``meta`` their factors stay on
    ``meta``), freeze every other parameter and train the ``modules_to_save`` modules in
    place; returns the adapted modules' names (empty: nothing matched; the base is
    frozen all the same)."""
    peft = require_peft()
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper
    from peft.utils.error import NoMatchingPeftModuleError

    # trained here whatever the saved config says (PeftModel.from_pretrained(is_trainable=True))
    config = dataclasses.replace(config, inference_mode=False)
    try:
        peft.inject_adapter_in_model(config, model, ADAPTER, low_cpu_mem_usage=True)
    except NoMatchingPeftModuleError:
        # nothing of this part matched: its base is frozen all the same (PEFT's meaning)
        model.requires_grad_(False)
        for name in saved_modules(config.modules_to_save, [n for n, _ in model.named_modules()]):
            model.get_submodule(name).requires_grad_(True)
        return []
    for name, mod in list(model.named_modules()):
        if isinstance(mod, ModulesToSaveWrapper):
            trained = mod.modules_to_save[ADAPTER]
            trained.requires_grad_(True)
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, trained)
    if hasattr(model, "peft_config"):
        del model.peft_config  # PEFT's bookkeeping; the config travels with the spec
    return [n for n, m in model.named_modules() if isinstance(m, LoraLayer)]


def check_adapter_file(path: str, module: nn.Module, part: str, saved: set[str]) -> None:
    """On the driver: the adapter file in ``path`` holds every factor of ``module`` (a
    part with the adapter injected, on ``meta``) and every parameter of its ``saved``
    modules (``modules_to_save``), in the shapes the base needs."""
    from safetensors import safe_open

    with safe_open(os.path.join(path, WEIGHTS_FILE), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    for name, p in module.named_parameters():
        if not (is_factor(name) or _in_module(name, saved)):
            continue
        key = file_key(name)
        if key not in shapes:
            raise ValueError(
                f"peft_path={path!r}: {WEIGHTS_FILE} has no {key!r} although its config "
                f"adapts or saves that module of the {part} part; the file is incomplete."
            )
        if shapes[key] != tuple(p.shape):
            raise ValueError(
                f"peft_path={path!r}: {key} has shape {shapes[key]} but the base model's "
                f"module needs {tuple(p.shape)}; the adapter was saved from another model."
            )


def is_factor(name: str) -> bool:
    """A LoRA factor of the part (``....lora_A.default.weight``)."""
    return f".lora_A.{ADAPTER}." in name or f".lora_B.{ADAPTER}." in name


def base_name(name: str) -> str:
    """The HF name of a part parameter that comes from the base model."""
    return name.replace(".base_layer.", ".")


def file_key(name: str) -> str:
    """The key of a factor or a ``modules_to_save`` parameter in PEFT's adapter file."""
    return FILE_PREFIX + name.replace(f".{ADAPTER}.", ".")


def saved_modules(keys, names) -> set[str]:
    """The modules of ``names`` that the ``modules_to_save`` entries ``keys`` train in
    full (PEFT's rule: the module name ends with an entry)."""
    return {n for n in names if any(n.endswith(k) for k in keys or ())}


def adapter_names(model: nn.Module, config: Any) -> set[str]:
    """The parameters of ``model`` (a part under ``config``) that its adapter owns: the
    factors and the ``modules_to_save`` parameters (what a checkpoint keeps)."""
    saved = saved_modules(config.modules_to_save, [n for n, _ in model.named_modules()])
    return {n for n, _ in model.named_parameters() if is_factor(n) or _in_module(n, saved)}


def scalings(model: nn.Module) -> dict[str, tuple[float, int, float]]:
    """PEFT's own ``(scaling, r, lora_alpha)`` of every LoRA layer of ``model``."""
    from peft.tuners.lora import LoraLayer

    return {
        n: (m.scaling[ADAPTER], m.r[ADAPTER], m.lora_alpha[ADAPTER])
        for n, m in model.named_modules()
        if isinstance(m, LoraLayer)
    }


def unsupported_layers(model: nn.Module, adapted: list[str]) -> str:
    """What is wrong with the first adapted module that is not a plain LoRA ``Linear``
    (PEFT's ``lora.Linear`` without a variant such as DoRA); ``""`` when none."""
    from peft.tuners.lora import Linear

    for name in adapted:
        layer = model.get_submodule(name)
        if type(layer) is not Linear or layer.lora_variant:
            what = type(layer.get_base_layer()).__name__
            return f"LoRA on {name} (a {what}) is not supported"
    return ""


def tied_saved(model: nn.Module, config: Any) -> list[str]:
    """The ``modules_to_save`` modules of ``model`` that hold a tied parameter."""
    from ray_disagg.models.loading import tied_parameters

    tied = {n for pair in tied_parameters(model).items() for n in pair}
    saved = saved_modules(config.modules_to_save, [n for n, _ in model.named_modules()])
    return sorted(m for m in saved if any(t.startswith(m + ".") for t in tied))


def _in_module(name: str, modules) -> bool:
    """Whether ``name`` is a parameter inside one of ``modules``."""
    return any(name.startswith(m + ".") for m in modules)


def fresh_factor(name: str, shape, config: Any, seed: int) -> torch.Tensor:
    """A new factor as PEFT initializes it: ``init_lora_weights=True``: ``A`` as
    ``nn.Linear`` (Kaiming uniform), ``B`` zeros; ``"gaussian"``: ``A`` normal with std
    ``1/r``, ``B`` zeros; ``False``: both as ``nn.Linear``. A function of ``(seed, name)``
    alone, so every layout starts from the same factors."""
    out = torch.empty(shape)
    gen = torch.Generator().manual_seed(name_seed(seed, name))
    init, is_b = config.init_lora_weights, f".lora_B.{ADAPTER}." in name
    if is_b and init is not False:
        return out.zero_()
    if init == "gaussian":
        return out.normal_(0.0, 1.0 / shape[0], generator=gen)
    return nn.init.kaiming_uniform_(out, a=math.sqrt(5), generator=gen)


class LoraWeights:
    """A part's initial tensors by part name (see the module's name map): the factors
    from the adapter file or :func:`fresh_factor`, ``modules_to_save`` parameters from
    the adapter file when it holds them, the rest from ``base`` (``.get(hf_name)``)."""

    def __init__(self, base, lora: PartLora, module: nn.Module, hf_param_name):
        self.base, self.lora = base, lora
        names = [n for n, _ in module.named_modules()]
        self.saved = saved_modules(lora.config.modules_to_save, names)
        self.shapes = {}  # every factor's global shape, a split one's as the fused factor
        blocks = block_rows(module, hf_param_name)
        for name, p in module.named_parameters():
            if is_factor(name):
                fused = hf_param_name(name)[0]
                rows = blocks[name][2] if name in blocks else p.shape[0]
                self.shapes[fused] = (rows, *p.shape[1:])
        self.file = None
        if lora.path is not None:
            from safetensors import safe_open

            self.file = safe_open(os.path.join(lora.path, WEIGHTS_FILE), "pt")
            self.keys = set(self.file.keys())

    def _from_file(self, name: str) -> bool:
        if self.file is None:
            return False
        return is_factor(name) or (_in_module(name, self.saved) and file_key(name) in self.keys)

    def get(self, name: str) -> torch.Tensor:
        if self._from_file(name):
            key = file_key(name)
            if key not in self.keys:
                raise ValueError(f"{WEIGHTS_FILE} in {self.lora.path!r} has no {key!r}")
            return self.file.get_tensor(key)
        if is_factor(name):
            return fresh_factor(name, self.shapes[name], self.lora.config, self.lora.seed)
        return self.base.get(base_name(name))


class _RegionLoraWeights(LoraWeights):
    """:class:`LoraWeights` over a base that reads blocks (``SafetensorsSource``)."""

    def shape(self, name: str) -> tuple[int, ...]:
        if self._from_file(name):
            return tuple(self.file.get_slice(file_key(name)).get_shape())
        if is_factor(name):
            return self.shapes[name]
        return self.base.shape(base_name(name))

    def read(self, name: str, region) -> torch.Tensor:
        if self._from_file(name) or is_factor(name):
            return self.get(name)[region]
        return self.base.read(base_name(name), region)


def lora_weights(base, lora: PartLora, module: nn.Module, hf_param_name) -> LoraWeights:
    """The initial tensors of ``module`` (a part under ``lora``) over the base model's
    source ``base``; ``hf_param_name``: the family's (row blocks of split Linears)."""
    cls = _RegionLoraWeights if hasattr(base, "read") else LoraWeights
    return cls(base, lora, module, hf_param_name)


def hf_name_map(hf_param_name):
    """The family's ``hf_param_name`` for the part's names under LoRA: a base parameter's
    fused HF name (``base_layer`` dropped), a factor's fused factor name (a split
    ``lora_B``'s row blocks re-joined)."""

    def mapped(name: str):
        fused, index, blocks = hf_param_name(name)
        return (fused if is_factor(fused) else base_name(fused)), index, blocks

    return mapped


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """Within the block, PEFT's layers in ``model`` compute their base layer only (the
    model without its adapters: a fresh adapter's reference model). PEFT's own switch
    (``BaseTunerLayer.disable_adapters``) is set directly: ``enable_adapters`` would also
    turn ``requires_grad`` of the trained factors off and on in the middle of a step."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    before = [m.disable_adapters for m in layers]
    try:
        for m in layers:
            m._disable_adapters = True
        yield
    finally:
        for m, b in zip(layers, before):
            m._disable_adapters = b
