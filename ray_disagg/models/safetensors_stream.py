"""Write safetensors files one tensor at a time, without holding the whole state dict.

The writer is given every ``(name, dtype, shape)`` up front, writes the header, then takes
the tensors one by one in that order and appends their raw bytes. :func:`save_streaming`
plans the shards the way ``save_pretrained`` names them and writes the index.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import sys
from collections.abc import Callable, Sequence

import torch

Spec = tuple[str, torch.dtype, Sequence[int]]

_DTYPES = {  # torch dtype name -> safetensors dtype
    **{f"float{n}": f"F{n}" for n in (16, 32, 64)},
    **{f"int{n}": f"I{n}" for n in (8, 16, 32, 64)},
    **{"bfloat16": "BF16", "uint8": "U8", "bool": "BOOL"},
    **{"float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"},
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
INDEX_NAME = "model.safetensors.index.json"


def parse_size(size: int | str) -> int:
    """Bytes of ``size``: an int, or a string like ``"5GB"``, ``"500MB"``, ``"2GiB"``
    (decimal units as ``save_pretrained``'s ``max_shard_size``)."""
    m = _SIZE.fullmatch(size) if isinstance(size, str) else None
    value = size if type(size) is int else 0  # not bool
    if m and m.group(2).upper() in _UNITS:
        value = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if value <= 0:
        raise ValueError(f"max_shard_size must be a size like '5GB' or bytes > 0, got {size!r}")
    return value


def nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    return math.prod(shape) * dtype.itemsize


class SafetensorsWriter:
    """One safetensors file; :meth:`write` each tensor of ``specs``, in order, then
    :meth:`close` (or use as a context manager)."""

    def __init__(self, path: str | os.PathLike, specs: Sequence[Spec]):
        if sys.byteorder != "little":
            raise RuntimeError("safetensors data is little-endian; this host is not")
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, dtype, shape in specs:
            end = offset + nbytes(dtype, shape)
            kind = _DTYPES[str(dtype).removeprefix("torch.")]
            header[name] = {"dtype": kind, "shape": list(shape), "data_offsets": [offset, end]}
            offset = end
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
        self._specs, self._next = list(specs), 0
        self._file = open(path, "wb")  # noqa: SIM115 (closed in close())
        self._file.write(struct.pack("<Q", len(blob)) + blob)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._specs):
            raise ValueError(f"{name}: every tensor of this file is already written")
        want, dtype, shape = self._specs[self._next]
        if (name, tensor.dtype, tuple(tensor.shape)) != (want, dtype, tuple(shape)):
            raise ValueError(
                f"expected {want} {dtype} {tuple(shape)}, got {name} {tensor.dtype} "
                f"{tuple(tensor.shape)}"
            )
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        self._file.write(flat.view(torch.uint8).numpy())  # raw bytes, no extra copy
        self._next += 1

    def close(self) -> None:
        self._file.close()
        if self._next != len(self._specs):
            raise ValueError(f"{self._file.name}: only {self._next}/{len(self._specs)} written")

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is None:
            self.close()
        else:
            self._file.close()


def plan_shards(specs: Sequence[Spec], max_shard_bytes: int) -> list[tuple[str, list[Spec]]]:
    """Split ``specs`` (in order) into files of at most ``max_shard_bytes`` each (a larger
    tensor gets a file of its own), named as ``save_pretrained`` names them."""
    shards: list[list[Spec]] = []
    size = 0
    for spec in specs:
        n = nbytes(spec[1], spec[2])
        if not shards or size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += n
    # Within a file, wider dtypes first (stable) keep every tensor aligned to its itemsize.
    shards = [sorted(s, key=lambda spec: -spec[1].itemsize) for s in shards]
    if len(shards) == 1:
        return [("model.safetensors", shards[0])]
    total = len(shards)
    return [(f"model-{i + 1:05d}-of-{total:05d}.safetensors", s) for i, s in enumerate(shards)]


def save_streaming(
    out_dir: str | os.PathLike,
    specs: Sequence[Spec],
    get_tensor: Callable[[str], torch.Tensor],
    max_shard_bytes: int,
) -> list[str]:
    """Write ``specs`` to ``out_dir`` as (sharded) safetensors, asking ``get_tensor`` for
    one tensor at a time; removes stale weight files of an earlier save. Returns the files."""
    plan = plan_shards(specs, max_shard_bytes)
    files = {f for f, _ in plan}
    for f in os.listdir(out_dir):
        stale = f == INDEX_NAME or re.fullmatch(r"model(-\d{5}-of-\d{5})?\.safetensors", f)
        if stale and f not in files:
            os.remove(os.path.join(out_dir, f))
    for filename, shard in plan:
        with SafetensorsWriter(os.path.join(out_dir, filename), shard) as writer:
            for name, _, _ in shard:
                writer.write(name, get_tensor(name))
    if len(plan) > 1:
        index = {
            "metadata": {"total_size": sum(nbytes(d, s) for _, d, s in specs)},
            "weight_map": {name: f for f, shard in plan for name, _, _ in shard},
        }
        with open(os.path.join(out_dir, INDEX_NAME), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
    return [f for f, _ in plan]
