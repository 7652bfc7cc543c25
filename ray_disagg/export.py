"""Export a ray_disagg checkpoint as one Hugging Face model directory."""

from __future__ import annotations

import os

import torch
from ray.train import Checkpoint
from transformers import AutoConfig

from ray_disagg._internal.checkpointing import read_full
from ray_disagg.models import get_adapter

__all__ = ["export_hf"]


def export_hf(checkpoint: Checkpoint | str | os.PathLike, out_dir: str | os.PathLike) -> str:
    """Write the model of ``checkpoint`` (a ``ray.train.Checkpoint`` of any layout, or its
    directory) to ``out_dir`` in the ``save_pretrained`` layout (safetensors + config.json)
    of the family's ``...ForConditionalGeneration``. The groups' sharded (DCP) tensors are
    assembled in this process.

    Example:
        >>> path = export_hf(result.checkpoint, "/tmp/my-vlm")  # doctest: +SKIP
        >>> Qwen2_5_VLForConditionalGeneration.from_pretrained(path)  # doctest: +SKIP
    """
    if not isinstance(checkpoint, Checkpoint):
        checkpoint = Checkpoint.from_directory(os.fspath(checkpoint))
    with checkpoint.as_directory() as root:
        config = AutoConfig.from_pretrained(root, local_files_only=True)
        adapter = get_adapter(config)
        state = {}
        for part in adapter.parts:
            state.update(read_full(os.path.join(root, part))[0])
    with torch.device("meta"):
        model = adapter.hf_class(config)
    model.load_state_dict(state, strict=True, assign=True)
    model.save_pretrained(os.fspath(out_dir))
    return os.fspath(out_dir)
