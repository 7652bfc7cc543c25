"""LoRA on the parts of a model, with PEFT's own configs, layers and files:

- :mod:`~ray_disagg.lora.parts`: which part gets which adapter, the driver's checks and
  the worker's injection (the names below);
- :mod:`~ray_disagg.lora.layers`: PEFT's layers on a part, the one name map between the
  part's parameters and PEFT's files, the factors' init and weights;
- :mod:`~ray_disagg.lora.files`: what a checkpoint records of the adapter and its base,
  and the PEFT adapter directory an export writes;
- :mod:`~ray_disagg.lora.export`: a checkpoint's merged model or adapter directory.
"""

import importlib

__all__ = [
    "apply_lora",
    "check_lora",
    "check_lora_resume",
    "lora_key",
    "lora_meta_part",
    "part_lora",
]


def __getattr__(name: str):  # loaded on first use: importing lora.layers loads no more
    if name in __all__:
        return getattr(importlib.import_module("ray_disagg.lora.parts"), name)
    raise AttributeError(f"module 'ray_disagg.lora' has no attribute {name!r}")
