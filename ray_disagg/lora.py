"""LoRA per part: which part gets which adapter (:func:`part_lora`), the driver's checks
(:func:`check_lora`, called by :func:`~ray_disagg.layout.resolve`) and the worker's
injection (:func:`apply_lora`). The layers, the name map and the weights:
:mod:`ray_disagg.models.lora`.

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
from collections.abc import Mapping

from torch import nn

from ray_disagg.config import ModuleGroup
from ray_disagg.models.lora import PartLora, check_adapter_file, inject

__all__ = ["apply_lora", "check_lora", "part_lora"]


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


def _trainable(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def check_lora(spec, groups: Mapping[str, ModuleGroup]) -> dict[str, PartLora]:
    """On the driver, on ``meta`` models: every part's adapter matches its part and
    leaves something to train. Returns the parts under LoRA (``ValueError`` naming the
    group, the setting and the fix otherwise)."""
    out, adapted = {}, {}
    if not any(part_lora(spec, p, g) for p, g in groups.items()):
        return out
    if getattr(spec.load_config(), "quantization_config", None) is not None:
        raise ValueError(
            "LoRA on a quantized base (its config.json has a quantization_config) is not "
            "supported (no QLoRA); start from the unquantized weights."
        )
    for part, group in groups.items():
        lora = part_lora(spec, part, group)
        if lora is None:
            continue
        label = f"groups[{part!r}].peft_config" if group.peft_config is not None else None
        if spec.peft_path is not None and label is not None:
            raise ValueError(
                f"{label} and HFModelSpec(peft_path=...) both put an adapter on the {part} "
                "part; drop one of them."
            )
        _check_layout(part, group, label or f"peft_path={spec.peft_path!r}")
        model = copy.deepcopy(spec.meta_model(part))  # a planner caches its meta models
        names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        adapted[part] = apply_lora(model, lora)
        if label is not None and not adapted[part]:
            raise ValueError(
                f"{label}: target_modules={lora.config.target_modules!r} matches no module "
                f"of the {part} part (its Linear modules are e.g. {names[:4]}); name modules "
                "of this part."
            )
        if group.trainable and not _trainable(model):
            raise ValueError(
                f"peft_path={spec.peft_path!r} adapts nothing in the {part} part and trains "
                f"no module of it in full, so it has nothing to train: set "
                f"groups[{part!r}] trainable=False, or give it its own peft_config."
            )
        if lora.path is not None:
            check_adapter_file(lora.path, model, part)
        out[part] = lora
    if spec.peft_path is not None and not any(adapted.values()):
        raise ValueError(
            f"peft_path={spec.peft_path!r}: target_modules="
            f"{spec.adapter_config.target_modules!r} matches no module of any part; it "
            "was not saved from this model."
        )
    return out


def _check_layout(part: str, group: ModuleGroup, label: str) -> None:
    """The layouts LoRA is not tested with yet."""
    from ray_disagg.config import ExpertParallel

    p = group.parallelism
    if isinstance(p, ExpertParallel) or group.model_parallel_size > 1:
        raise ValueError(
            f"{label}: LoRA on the {part} part with {type(p).__name__} is not supported "
            "yet; use DataParallel (zero1 or fsdp=True) for this group."
        )
