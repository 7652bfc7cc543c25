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

from ray_disagg.lora.export import LoraExport
from ray_disagg.lora.files import read_record
from ray_disagg.lora.layers import is_factor
from ray_disagg.models import get_adapter
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
    *,
    merge_lora: bool = True,
    base_path: str | os.PathLike | None = None,
) -> str:
    """Write the model of ``checkpoint`` (a ``ray.train.Checkpoint`` of any layout, or its
    directory) to ``out_dir`` in the ``save_pretrained`` layout (safetensors + config.json)
    of the family's ``...ForConditionalGeneration``, under the model's own state-dict keys.
    The groups' sharded (DCP) tensors are assembled in this process one tensor at a time,
    into files of at most ``max_shard_size`` (bytes, or a size like ``"5GB"``/``"500MB"``).

    A checkpoint of LoRA parts holds their adapters; the base is read from the model's
    weights (the checkpoint names its directory; ``base_path``: a copy elsewhere). By
    default each adapted weight is merged (``W + scaling * B @ A`` in fp32, saved in the
    base's dtype); ``merge_lora=False`` writes a PEFT adapter directory instead
    (``adapter_config.json`` + ``adapter_model.safetensors``) for
    ``PeftModel.from_pretrained(base, out_dir)``.

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
        records = {p: r for p in adapter.parts if (r := read_record(os.path.join(root, p)))}
        if not merge_lora:
            _export_adapter(records, sources, config, out, base_path)
            return out
        lora = LoraExport(config, records, base_path and os.fspath(base_path)) if records else None
        _export_model(config, adapter, sources, lora, out, limit)
    return out


def _export_adapter(records, sources, config, out: str, base_path) -> None:
    if not records:
        raise ValueError(
            "merge_lora=False: this checkpoint trained no LoRA adapter; export the model "
            "(merge_lora=True)."
        )
    lora = LoraExport(config, records, base_path and os.fspath(base_path))
    saved = lora.saved(sources)
    adapter_keys = {n for n in sources if is_factor(n) or n in saved}
    for name in sources.keys() - adapter_keys:  # a part trained in full is not an adapter's
        tensor = _load(sources[name])  # one at a time: a frozen tower may be large
        if not torch.equal(tensor, lora.base.get(name).to(tensor.dtype)):
            raise ValueError(
                f"merge_lora=False: {name} was trained in full (its group had no LoRA "
                "adapter), which a PEFT adapter directory cannot hold; export the merged "
                "model instead."
            )
    lora.write_adapter(out, {n: _load(sources[n]) for n in adapter_keys})


def _export_model(config, adapter, sources, lora, out: str, limit: int) -> None:
    with torch.device("meta"):  # names and shapes only
        model = adapter.hf_class(config)
    expected = model.state_dict()
    factors = {k for k in sources if is_factor(k)}
    from_base = set() if lora is None else (expected.keys() - sources.keys()) & lora.part_keys
    missing = sorted(expected.keys() - sources.keys() - from_base)
    unexpected = sorted(sources.keys() - expected.keys() - factors)
    held = {k: sources[k].shape for k in expected.keys() & sources.keys()}
    wrong = [k for k, shape in held.items() if shape != expected[k].shape]
    if missing or unexpected or wrong:
        raise ValueError(
            f"The checkpoint does not match {adapter.hf_class.__name__}: missing "
            f"{missing[:5]}, unexpected {unexpected[:5]}, wrong shape {sorted(wrong)[:5]}"
        )

    def dtype(name: str) -> torch.dtype:
        return sources[name].dtype if name in sources else lora.base_dtype(name)

    def get(name: str) -> torch.Tensor:
        if name in sources:
            return _load(sources[name])
        return lora.merged(name, lambda key: _load(sources[key]))

    specs = [(k, dtype(k), tuple(expected[k].shape)) for k in expected]
    os.makedirs(out, exist_ok=True)
    save_streaming(out, specs, get, limit)
    # as save_pretrained: the class and the dtype of the first floating-point parameter
    config.architectures = [adapter.hf_class.__name__]
    dtypes = [dtype(n) for n, p in model.named_parameters() if p.is_floating_point()]
    if dtypes:
        config.dtype = str(dtypes[0]).split(".")[1]
    config.save_pretrained(out)
