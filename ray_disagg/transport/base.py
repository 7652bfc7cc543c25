"""What every tier shares: tensor descriptions in the message header and the byte views
the host tiers move."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

import torch

__all__ = [
    "ChannelSpec",
    "TIERS",
    "Tier",
    "TransferError",
    "TensorSpec",
    "describe",
    "as_bytes",
    "from_bytes",
    "dtype_from_name",
]

Tier = Literal["gloo", "shm", "nccl", "cuda_ipc"]
"""A transfer tier between two workers."""
TIERS = get_args(Tier)


class TransferError(TimeoutError, RuntimeError):
    """A cross-group transfer timed out or failed; the message names the peer."""


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and dtype of one tensor of a message (sent in the header)."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # e.g. "bfloat16"

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def nbytes(self) -> int:
        n = self.torch_dtype.itemsize
        for s in self.shape:
            n *= s
        return n


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r} in a transfer header")
    return dtype


def describe(tensors: dict[str, torch.Tensor]) -> list[TensorSpec]:
    return [
        TensorSpec(name, tuple(t.shape), str(t.dtype).removeprefix("torch."))
        for name, t in tensors.items()
    ]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of a contiguous tensor (no copy; any dtype, bf16 included)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def from_bytes(buf: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """The tensor ``spec`` describes, viewing the ``uint8`` buffer ``buf`` (no copy)."""
    return buf.view(spec.torch_dtype).view(spec.shape)


@dataclass(frozen=True)
class ChannelSpec:
    """Where and how to rendezvous (sent by the coordinator to every worker)."""

    master_addr: str
    master_port: int
    offsets: dict[str, int]
    sizes: dict[str, int]
    timeout_s: float
    prefix: str
    locations: list = field(default_factory=list)
    """Where each side rank runs (:class:`~ray_disagg.transport.select.Location`s,
    reported by the workers)."""
    tiers: dict[tuple[int, int], str] = field(default_factory=dict)
    """Transfer tier of each pair of side ranks ``(low, high)`` in different groups."""
    generation: int = 0
    """How many times the channel was rebuilt in this run attempt (a group restarted)."""
    restarts: dict[str, int] = field(default_factory=dict)
    """Group -> how many times it alone was restarted in this run attempt."""
    takeovers: dict[str, int] = field(default_factory=dict)
    """Group with a standby -> how many of those restarts its standby took."""

    @property
    def world_size(self) -> int:
        return sum(self.sizes.values())

    def tier(self, a: int, b: int) -> str:
        return self.tiers.get((min(a, b), max(a, b)), "gloo")

    def group(self, rank: int) -> str:
        """The group of side rank ``rank`` (``ValueError`` when it is in none)."""
        for name, off in self.offsets.items():
            if off <= rank < off + self.sizes[name]:
                return name
        raise ValueError(f"side rank {rank} is in no group of {self.sizes}")

    def label(self, rank: int) -> str:
        try:
            name = self.group(rank)
        except ValueError:
            return f"side rank {rank}"
        return f"{name} rank {rank - self.offsets[name]}"
