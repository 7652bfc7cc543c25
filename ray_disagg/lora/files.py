"""A LoRA part's files: what its checkpoint records about the adapter and the base
(``lora.json`` beside the part's DCP shards, checked at resume), and the PEFT adapter
directory an export writes (``adapter_config.json`` + ``adapter_model.safetensors``,
PEFT's key names) for every part's adapters together.

A LoRA part's checkpoint holds only its adapter's tensors (factors and
``modules_to_save``) and their AdamW state; the frozen base is read again from the model
spec's weights (``pretrained_path``, or the random init's ``seed``) at resume and at
export.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ray_disagg.lora.layers import CONFIG_FILE, WEIGHTS_FILE, file_key

__all__ = [
    "RECORD",
    "adapter_config",
    "base_record",
    "check_resume",
    "config_dict",
    "read_record",
    "write_adapter_dir",
    "write_record",
]

RECORD = "lora.json"
# the config fields that change what a checkpoint's tensors mean or how they train
_SAME_ON_RESUME = (
    "r",
    "lora_alpha",
    "use_rslora",
    "target_modules",
    "exclude_modules",
    "modules_to_save",
    "rank_pattern",
    "alpha_pattern",
    "layers_to_transform",
    "layers_pattern",
    "lora_dropout",
    "fan_in_fan_out",
)


def config_dict(config: Any) -> dict:
    """A ``LoraConfig`` as JSON-able data (sets as sorted lists), as PEFT writes it."""
    out = {}
    for key, value in config.to_dict().items():
        if isinstance(value, set | frozenset):
            value = sorted(value)
        out[key] = value
    return json.loads(json.dumps(out, default=str))


def base_record(pretrained_path: str | None, seed: int) -> dict:
    """What identifies the frozen base: its directory and the names and sizes of its
    weight files (a moved copy is the same base), or the random init's seed."""
    if pretrained_path is None:
        return {"pretrained_path": None, "seed": seed, "files": {}}
    files = {
        f: os.path.getsize(os.path.join(pretrained_path, f))
        for f in sorted(os.listdir(pretrained_path))
        if f.endswith(".safetensors")
    }
    return {"pretrained_path": pretrained_path, "seed": None, "files": files}


def write_record(module_dir: str, config: Any, base: dict) -> None:
    with open(os.path.join(module_dir, RECORD), "w") as f:
        json.dump({"peft_config": config_dict(config), "base": base}, f, indent=1)


def read_record(module_dir: str) -> dict | None:
    """The LoRA record of a part's checkpoint directory (``None``: trained in full)."""
    path = os.path.join(module_dir, RECORD)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def check_resume(module_dir: str, part: str, config: Any | None, base: dict) -> None:
    """``ValueError`` unless the checkpoint's ``part`` was trained as this run trains it:
    both in full, or both with the same adapter settings on the same base."""
    saved = read_record(module_dir)
    if saved is None and config is None:
        return
    if saved is None:
        raise ValueError(
            f"The checkpoint's {part} part was trained in full, but this run trains a LoRA "
            f"adapter on it; resume without peft_config / peft_path for the {part} group, "
            "or export the checkpoint (export_hf) and start a LoRA run from that model."
        )
    if config is None:
        raise ValueError(
            f"The checkpoint's {part} part trained a LoRA adapter, but this run trains it in "
            "full; resume with the same peft_config / peft_path, or export the merged model "
            "(export_hf) and fine-tune that."
        )
    now = config_dict(config)
    diff = [k for k in _SAME_ON_RESUME if saved["peft_config"].get(k) != now.get(k)]
    if diff:
        shown = ", ".join(f"{k}: {saved['peft_config'].get(k)!r} -> {now.get(k)!r}" for k in diff)
        raise ValueError(
            f"The checkpoint's {part} adapter was trained with other LoRA settings ({shown}); "
            "resume with the settings it was trained with."
        )
    was = saved["base"]
    same = was["files"] == base["files"] and (base["files"] or was["seed"] == base["seed"])
    if not same:
        raise ValueError(
            f"The checkpoint's {part} adapter was trained on another base model "
            f"({_base_text(was)}); this run's is {_base_text(base)}. Resume with the base it "
            "was trained on."
        )


def _base_text(base: dict) -> str:
    return base["pretrained_path"] or f"random init, seed {base['seed']}"


def adapter_config(records: dict[str, dict], adapted: dict[str, dict[str, tuple]]) -> dict:
    """One ``adapter_config.json`` for the adapters of every part: the common config when
    the parts share one, else their adapted modules by full name with per-module ranks
    and alphas (``rank_pattern`` / ``alpha_pattern``). ``records``: part -> its
    :data:`RECORD`; ``adapted``: part -> module name -> ``(r, lora_alpha)``."""
    configs = {p: r["peft_config"] for p, r in records.items()}
    first = next(iter(configs.values()))
    out = dict(first, inference_mode=True)
    base = next(iter(records.values()))["base"]["pretrained_path"]
    out["base_model_name_or_path"] = base
    if all(c == first for c in configs.values()):
        return out
    for key in ("use_rslora", "lora_dropout", "fan_in_fan_out"):
        if len({json.dumps(c.get(key)) for c in configs.values()}) > 1:
            values = {p: c.get(key) for p, c in configs.items()}
            raise ValueError(
                f"The parts' adapters differ in {key} ({values}), which one PEFT adapter "
                "directory cannot express; export them merged (merge_lora=True)."
            )
    modules = {m: ra for part in adapted.values() for m, ra in part.items()}
    r, alpha = first["r"], first["lora_alpha"]
    out.update(
        target_modules=sorted(modules),
        exclude_modules=None,
        layers_to_transform=None,
        layers_pattern=None,
        rank_pattern={m: ra[0] for m, ra in modules.items() if ra[0] != r},
        alpha_pattern={m: ra[1] for m, ra in modules.items() if ra[1] != alpha},
        modules_to_save=sorted({m for c in configs.values() for m in c["modules_to_save"] or []})
        or None,
    )
    return out


def write_adapter_dir(out: str, config: dict, tensors: dict) -> None:
    """A PEFT adapter directory: ``config`` and ``tensors`` (part name -> tensor) under
    PEFT's file keys."""
    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, CONFIG_FILE), "w") as f:
        json.dump(config, f, indent=2)
    data = {file_key(n): t.contiguous() for n, t in tensors.items()}
    save_file(data, os.path.join(out, WEIGHTS_FILE), metadata={"format": "pt"})
