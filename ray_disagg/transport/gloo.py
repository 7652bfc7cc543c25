"""Fallback tier: gloo send/recv over TCP. Device tensors are staged through the host."""

from __future__ import annotations

import torch

from ray_disagg.transport.base import TensorSpec, as_bytes, from_bytes

__all__ = ["GlooTier"]


class GlooTier:
    """Sends each tensor's bytes after the header, over the peer's link (``route(peer)``:
    its gloo group and the peer's rank in it)."""

    name = "gloo"

    def __init__(self, route):
        self.route = route

    def pack(self, tensors: list[torch.Tensor], dst: int):
        return None

    def after_header(self, tensors: list[torch.Tensor], dst: int) -> list:
        """Posts the sends; returns ``(work, buffer)`` pairs to wait on."""
        out = []
        for t in tensors:
            if t.numel():
                buf = as_bytes(t.cpu())
                pg, rank = self.route(dst)
                out.append((pg.send([buf], rank, 0), buf))
        return out

    def unpack(self, specs: list[TensorSpec], payload, src: int, device) -> list[torch.Tensor]:
        out = []
        for spec in specs:
            buf = torch.empty(spec.nbytes, dtype=torch.uint8)
            if spec.nbytes:
                pg, rank = self.route(src)
                pg.recv([buf], rank, 0).wait()
            out.append(from_bytes(buf, spec).to(device))
        return out
