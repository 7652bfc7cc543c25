"""LoRA per part: which part gets which adapter (:func:`part_lora`), the driver's checks
(:func:`check_lora`, called by :func:`~ray_disagg.config.layout.resolve`) and the worker's
injection (:func:`apply_lora`). The layers, the name map and the weights:
:mod:`ray_disagg.lora.layers`.

A part is under LoRA when its group has ``peft_config`` (a fresh adapter on that part) or
the model spec has ``peft_path`` (a saved PEFT adapter directory, for every part, as
``PeftModel.from_pretrained`` puts it on the whole model). Under LoRA the part's base
weights are frozen; its factors and ``modules_to_save`` modules are trained.

Example:
    >>> from peft import LoraConfig
    >>> from ray.train import ScalingConfig
    >>> from ray_disagg import HFModelSpec, ModuleGroup, tiny_qwen2_5_vl_config
    >>> spec = HFModelSpec(config=tiny_qwen2_5_vl_config())
    >>> text = ModuleGroup(scaling_config=ScalingConfig(num_workers=1),
    ...                    peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    >>> one = ModuleGroup(scaling_config=ScalingConfig(num_workers=1))
    >>> sorted(check_lora(spec, {"vision": one, "text": text}))
    ['text']
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping

from torch import nn

from ray_disagg.config.freezing import apply_freeze
from ray_disagg.config.groups import ModuleGroup
from ray_disagg.lora.files import base_record, check_resume, config_dict
from ray_disagg.lora.layers import (
    PartLora,
    check_adapter_file,
    inject,
    saved_modules,
    tied_saved,
    unsupported_layers,
)

__all__ = [
    "apply_lora",
    "check_lora",
    "check_lora_resume",
    "lora_key",
    "lora_meta_part",
    "part_lora",
]


def part_lora(spec, part: str, group: ModuleGroup) -> PartLora | None:
    """The adapter of ``part`` (``None``: full fine-tuning)."""
    if group.peft_config is not None:
        return PartLora(group.peft_config, None, spec.seed)
    if spec.peft_path is not None:
        return PartLora(spec.adapter_config, spec.peft_path, spec.seed)
    return None


def apply_lora(model: nn.Module, lora: PartLora | None) -> list[str]:
    """Inject ``lora`` into ``model`` (a part on ``meta``); the adapted modules."""
    return [] if lora is None else inject(model, lora.config)


def lora_meta_part(spec, part: str, group: ModuleGroup, lora: PartLora):
    """``(model, adapted modules)``: a copy of ``part``'s meta model (the spec's may be a
    planner's cached one) as it trains under ``lora``, with the group's freezing."""
    model = copy.deepcopy(spec.meta_model(part))
    adapted = apply_lora(model, lora)
    apply_freeze(model, group)
    return model, adapted


def _trainable(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def check_lora(spec, groups: Mapping[str, ModuleGroup]) -> dict[str, PartLora]:
    """On the driver, on ``meta`` models: every part's adapter matches its part, is one
    this package trains, and leaves something to train. Returns the parts under LoRA
    (``ValueError`` naming the group, the setting and the fix otherwise)."""
    chosen = {p: part_lora(spec, p, g) for p, g in groups.items()}
    chosen = {p: lora for p, lora in chosen.items() if lora is not None}
    if not chosen:
        return {}
    cache = getattr(spec, "memory_cache", None)  # the planner asks for thousands of layouts
    key = ("check_lora", *((p, g.trainable, g.freeze, type(g.parallelism).__name__,
                            lora_key(g.peft_config, spec)) for p, g in groups.items()))  # fmt: skip
    if cache is not None and key in cache:
        return cache[key]
    out = _check_parts(spec, groups, chosen)
    if cache is not None:
        cache[key] = out
    return out


def lora_key(config, spec) -> str:
    """The adapter settings of a group (its ``peft_config``, else the spec's adapter
    directory's) as one string (``""``: none)."""
    config = config if config is not None else spec.adapter_config
    return "" if config is None else json.dumps(config_dict(config), sort_keys=True)


def _check_parts(spec, groups, chosen: dict[str, PartLora]) -> dict[str, PartLora]:
    if getattr(spec.load_config(), "quantization_config", None) is not None:
        raise ValueError(
            "LoRA on a quantized base (its config.json has a quantization_config) is not "
            "supported (no QLoRA); start from the unquantized weights."
        )
    injected = {}
    for part, lora in chosen.items():
        if spec.peft_path is not None and groups[part].peft_config is not None:
            raise ValueError(
                f"groups[{part!r}].peft_config and HFModelSpec(peft_path=...) both put an "
                f"adapter on the {part} part; drop one of them."
            )
        injected[part] = lora_meta_part(spec, part, groups[part], lora)
    if spec.peft_path is not None and not any(names for _, names in injected.values()):
        raise ValueError(
            f"peft_path={spec.peft_path!r}: target_modules="
            f"{spec.adapter_config.target_modules!r} matches no module of any part; it "
            "was not saved from this model."
        )
    for part, (model, adapted) in injected.items():
        _check_part(spec, part, groups[part], chosen[part], model, adapted)
    return chosen


def _check_part(spec, part: str, group: ModuleGroup, lora: PartLora, model, adapted) -> None:
    """The checks of one part under ``lora`` (``model``: its meta model, injected)."""
    own = group.peft_config is not None
    label = f"groups[{part!r}].peft_config" if own else f"peft_path={spec.peft_path!r}"
    if own and not adapted:
        names = [n for n, m in spec.meta_model(part).named_modules() if isinstance(m, nn.Linear)]
        raise ValueError(
            f"{label}: target_modules={lora.config.target_modules!r} matches no module of "
            f"the {part} part (its Linear modules are e.g. {names[:4]}); name modules of "
            "this part."
        )
    all_names = [n for n, _ in model.named_modules()]
    for key in lora.config.modules_to_save or () if own else ():
        if not saved_modules([key], all_names):
            raise ValueError(
                f"{label}: modules_to_save entry {key!r} matches no module of the {part} "
                "part; drop it or put it on the group of its part."
            )
    bad = unsupported_layers(model, adapted)
    if bad:
        raise ValueError(f"{label}: {bad}; target Linear modules (e.g. q_proj, gate_proj).")
    tied = tied_saved(model, lora.config)
    if tied:
        raise ValueError(
            f"{label}: modules_to_save {tied} holds a tied parameter (tie_word_embeddings), "
            "which is not supported; adapt it with LoRA or untie the embeddings."
        )
    if group.trainable:
        _check_layout(part, group, label)
        if not _trainable(model):
            raise ValueError(
                f"{label}: the {part} part has nothing to train (no adapted module, no "
                f"modules_to_save, or all frozen by freeze=...): set groups[{part!r}] "
                "trainable=False, or adapt modules of it."
            )
    if lora.path is not None:
        saved = saved_modules(lora.config.modules_to_save, all_names)
        check_adapter_file(lora.path, model, part, saved)


def _check_layout(part: str, group: ModuleGroup, label: str) -> None:
    """The layouts LoRA is not tested with yet."""
    from ray_disagg.config.groups import ExpertParallel

    if isinstance(group.parallelism, ExpertParallel):
        raise ValueError(
            f"{label}: LoRA on the {part} part with ExpertParallel is not supported yet; use "
            "DataParallel (zero1 or fsdp=True) or TensorParallel for this group."
        )


def check_lora_resume(root: str, spec, groups: Mapping[str, ModuleGroup]) -> None:
    """On the driver, before a resume: every part of the checkpoint under ``root`` was
    trained as this run trains it (in full, or with the same adapter on the same base)."""
    base = base_record(spec.pretrained_path, spec.seed)
    for part, group in groups.items():
        if os.path.isdir(os.path.join(root, part)):
            lora = part_lora(spec, part, group)
            config = None if lora is None else lora.config
            check_resume(os.path.join(root, part), part, config, base)
