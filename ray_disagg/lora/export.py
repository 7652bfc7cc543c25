"""Exporting a checkpoint whose parts trained LoRA adapters (called by
:func:`ray_disagg.export_hf`): the merged model (each adapted weight ``W + scaling * B @ A``
merged in fp32 and saved in the base's dtype, the base read from the model's weights), or
one PEFT adapter directory for every part's adapter (``merge_lora=False``) that
``PeftModel.from_pretrained(base, out)`` loads."""

from __future__ import annotations

import os

import torch

from ray_disagg.lora.files import adapter_config, write_adapter_dir
from ray_disagg.lora.layers import ADAPTER, inject, is_factor, scalings
from ray_disagg.models import get_adapter, loading

__all__ = ["LoraExport"]


class LoraExport:
    """The LoRA parts of one checkpoint: their records, PEFT's scalings of their adapted
    modules, and the base's tensors (``base_path``: another copy of the base's
    directory)."""

    def __init__(self, config, records: dict[str, dict], base_path: str | None = None):
        self.adapter, self.records, self.base_path = get_adapter(config), records, base_path
        base = next(iter(records.values()))["base"]
        self.meta = loading.meta_model(self.adapter)
        path = base_path or base["pretrained_path"]
        if path is not None and not os.path.isdir(path):
            raise ValueError(
                f"The adapter's base model {path!r} is not there; pass export_hf(..., "
                "base_path=<a copy of it>)."
            )
        self.base = (
            loading.InitSource(self.meta, base["seed"])
            if path is None
            else loading.SafetensorsSource(path, self.meta)
        )
        from peft import LoraConfig

        self.scaling, self.ranks, self.part_keys = {}, {}, set()
        for part, record in records.items():
            config = LoraConfig(**_config_fields(record["peft_config"]))
            model = self.adapter.prune(loading.meta_model(self.adapter), part)
            self.part_keys |= set(model.state_dict())  # what the base gives
            inject(model, config)
            found = scalings(model)
            self.scaling.update({m: s for m, (s, _, _) in found.items()})
            self.ranks[part] = {m: (r, a) for m, (_, r, a) in found.items()}

    def base_dtype(self, name: str) -> torch.dtype:
        if isinstance(self.base, loading.SafetensorsSource):
            return self.base.dtype(name)
        return torch.float32

    def merged(self, name: str, factors) -> torch.Tensor:
        """The base tensor ``name``, merged with its module's adapter (``factors(name)``:
        a factor from the checkpoint) when the module is adapted."""
        base = self.base.get(name)
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or module not in self.scaling:
            return base
        a = factors(f"{module}.lora_A.{ADAPTER}.weight").float()
        b = factors(f"{module}.lora_B.{ADAPTER}.weight").float()
        delta = (b.flatten(1) @ a.flatten(1)).reshape(base.shape)
        return (base.float() + self.scaling[module] * delta).to(base.dtype)

    def saved(self, sources: dict) -> set[str]:
        """The ``modules_to_save`` parameters among a checkpoint's ``sources`` (a LoRA
        part's checkpoint holds nothing else but factors)."""
        parts = set(self.records)
        return {
            n
            for n, src in sources.items()
            if not is_factor(n) and os.path.basename(os.path.normpath(src.directory)) in parts
        }

    def write_adapter(self, out: str, tensors: dict[str, torch.Tensor]) -> None:
        """The PEFT adapter directory of every LoRA part (``tensors``: their factors and
        ``modules_to_save`` parameters)."""
        config = adapter_config(self.records, self.ranks)
        if self.base_path is not None:
            config["base_model_name_or_path"] = self.base_path
        if config.get("task_type") is None:  # as PeftModel.save_pretrained: AutoPeftModel
            cls = self.adapter.hf_class  # loads the base with this class
            config["auto_mapping"] = {"base_model_class": cls.__name__,
                                      "parent_library": cls.__module__}  # fmt: skip
        write_adapter_dir(out, config, tensors)


def _config_fields(saved: dict) -> dict:
    """A saved config's fields that ``LoraConfig`` takes."""
    import dataclasses

    from peft import LoraConfig

    names = {f.name for f in dataclasses.fields(LoraConfig)}
    return {k: v for k, v in saved.items() if k in names and k != "peft_type"}
