"""Export a ray_disagg checkpoint as one Hugging Face model directory.

The export streams: each output tensor is read alone from its group's DCP directory
(``dcp.load`` of that one key) and appended to the safetensors file, so the memory it needs
is about the largest tensor, not the model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from ray.train import Checkpoint
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from transformers import AutoConfig

from ray_disagg.models import get_adapter
from ray_disagg.models.lora import is_factor
from ray_disagg.models.safetensors_stream import parse_size, save_streaming
from ray_disagg.worker.shards import load_alone, read_metadata

__all__ = ["export_hf"]


@dataclass
class _Source:
    """Where an output tensor lives: one DCP key, or the row-block keys of a split Linear
    (the adapter's ``hf_param_name`` tells which)."""

    directory: str
    keys: dict[int | None, str]  # None -> key, or row block index -> key
    dtype: torch.dtype
    sizes: dict[int | None, torch.Size]
    blocks: int = 1

    @property
    def shape(self) -> tuple[int, ...]:
        if None in self.keys:
            return tuple(self.sizes[None])
        return (sum(self.sizes[i][0] for i in range(self.blocks)), *self.sizes[0][1:])


def _read_sources(directory: str, sources: dict[str, _Source], hf_name) -> None:
    """Add the ``model.*`` tensors of one module directory to ``sources`` (by HF name)."""
    meta = read_metadata(directory)
    for key, m in meta.items():
        if not (isinstance(m, TensorStorageMetadata) and key.startswith("model.")):
            continue
        name, index, blocks = hf_name(key[len("model.") :])  # vision TP stores q/k/v apart
        src = sources.setdefault(name, _Source(directory, {}, m.properties.dtype, {}, blocks))
        if src.directory != directory or index in src.keys or src.dtype != m.properties.dtype:
            raise ValueError(f"{name} is stored twice or inconsistently in the checkpoint")
        src.keys[index], src.sizes[index] = key, m.size
    for name, src in sources.items():
        if sorted(src.keys, key=str) not in ([None], list(range(src.blocks))):
            raise ValueError(
                f"{name}: the checkpoint holds only row blocks {sorted(src.keys, key=str)} "
                f"of {src.blocks}"
            )


def _load(src: _Source) -> torch.Tensor:
    """The full tensor of ``src``; row blocks are read straight into the fused tensor."""
    out = torch.empty(src.shape, dtype=src.dtype)
    if None in src.keys:
        targets = {src.keys[None]: out}
    else:  # consecutive row blocks of the fused tensor
        rows = [src.sizes[i][0] for i in range(src.blocks)]
        targets = {src.keys[i]: out.narrow(0, sum(rows[:i]), rows[i]) for i in range(src.blocks)}
    load_alone(targets, src.directory)
    return out


def export_hf(
    checkpoint: Checkpoint | str | os.PathLike,
    out_dir: str | os.PathLike,
    max_shard_size: int | str = "5GB",
) -> str:
    """Write the model of ``checkpoint`` (a ``ray.train.Checkpoint`` of any layout, or its
    directory) to ``out_dir`` in the ``save_pretrained`` layout (safetensors + config.json)
    of the family's ``...ForConditionalGeneration``, under the model's own state-dict keys.
    The groups' sharded (DCP) tensors are assembled in this process one tensor at a time,
    into files of at most ``max_shard_size`` (bytes, or a size like ``"5GB"``/``"500MB"``).

    Example:
        >>> path = export_hf(result.checkpoint, "/tmp/my-vlm")  # doctest: +SKIP
        >>> Qwen2_5_VLForConditionalGeneration.from_pretrained(path)  # doctest: +SKIP
    """
    limit = parse_size(max_shard_size)
    if not isinstance(checkpoint, Checkpoint):
        checkpoint = Checkpoint.from_directory(os.fspath(checkpoint))
    out = os.fspath(out_dir)
    with checkpoint.as_directory() as root:
        config = AutoConfig.from_pretrained(root, local_files_only=True)
        adapter = get_adapter(config)
        sources: dict[str, _Source] = {}
        for part in adapter.parts:
            _read_sources(os.path.join(root, part), sources, adapter.hf_param_name)
        if any(is_factor(k) for k in sources):
            raise ValueError(
                "This checkpoint trained a LoRA adapter; export_hf does not write LoRA "
                "checkpoints yet (merged or as a PEFT adapter directory)."
            )
        with torch.device("meta"):  # names and shapes only
            model = adapter.hf_class(config)
        expected = model.state_dict()
        missing = sorted(expected.keys() - sources.keys())
        unexpected = sorted(sources.keys() - expected.keys())
        wrong = [
            k for k in expected.keys() & sources.keys() if sources[k].shape != expected[k].shape
        ]
        if missing or unexpected or wrong:
            raise ValueError(
                f"The checkpoint does not match {adapter.hf_class.__name__}: missing "
                f"{missing[:5]}, unexpected {unexpected[:5]}, wrong shape {sorted(wrong)[:5]}"
            )
        specs = [(k, sources[k].dtype, sources[k].shape) for k in expected]
        os.makedirs(out, exist_ok=True)
        save_streaming(out, specs, lambda name: _load(sources[name]), limit)
        # as save_pretrained: the class and the dtype of the first floating-point parameter
        config.architectures = [adapter.hf_class.__name__]
        dtypes = [sources[n].dtype for n, p in model.named_parameters() if p.is_floating_point()]
        if dtypes:
            config.dtype = str(dtypes[0]).split(".")[1]
        config.save_pretrained(out)
    return out
