"""What the Qwen towers cost (``ray_disagg.models.costs`` hooks): a patch merger's
activations, and Qwen2.5's windowed attention (full attention in
``fullatt_block_indexes`` only)."""

from __future__ import annotations

from typing import ClassVar

from ray_disagg.models.costs import (
    ActivationShape,
    merger_tower_activation_bytes,
    tower_attention_flops,
)
from ray_disagg.models.flops import Flops, attention, linear

__all__ = ["QwenTowerCosts"]


class QwenTowerCosts:
    """Cost hooks of a Qwen VL adapter's tower (mixed in before ``ModelAdapter``)."""

    windowed_tower: ClassVar[bool] = False
    """Window attention but in ``fullatt_block_indexes`` (Qwen2.5-VL, Qwen2.5-Omni)."""
    gated_tower_mlp: ClassVar[bool] = False
    """The tower's blocks have a gated MLP (gate, up, down: Qwen2.5-VL, Qwen2.5-Omni)."""

    def forward_flops(self, part, params, tokens, patches, images) -> float:
        v = self.tower_config(part)
        if v is None or not self.windowed_tower:
            return super().forward_flops(part, params, tokens, patches, images)
        return 2 * params * patches + tower_attention_flops(v, patches, images, windowed=True)

    def activation_bytes(self, part: str, shape: ActivationShape) -> float | None:
        v = self.tower_config(part)
        if v is None:
            return super().activation_bytes(part, shape)
        return merger_tower_activation_bytes(v, shape)

    def tower_flops(self, part, sample) -> Flops:
        """Patch embedding (data input), the blocks (attention within each frame, or
        Qwen2.5's windows but in ``fullatt_block_indexes``), the merger and DeepStack's."""
        v = self.tower_config(part)
        if v is None:
            return super().tower_flops(part, sample)
        grids = [self._grid(sample, k) for k in ("image_grid_thw", "video_grid_thw")]
        frames = [
            (int(h), int(w))
            for grid in grids
            if grid is not None  # no such media (a missing key or None)
            for t, h, w in grid
            for _ in range(int(t))
        ]
        patches = sum(h * w for h, w in frames)
        h = getattr(v, "embed_dim", None) or v.hidden_size
        mlp = getattr(v, "intermediate_size", None) or int(h * getattr(v, "mlp_ratio", 4))
        embed = linear(patches, v.in_channels * v.temporal_patch_size * v.patch_size**2, h)
        block = linear(patches, h, 4 * h) + linear(patches, mlp, h)
        block += linear(patches, h, (2 if self.gated_tower_mlp else 1) * mlp)
        full = attention([h_ * w_ for h_, w_ in frames], h)
        blocks = v.depth * (block + full)
        if self.windowed_tower:
            windowed = v.depth - len(v.fullatt_block_indexes)
            blocks += windowed * (attention(_windows(v, frames), h) - full)
        m2 = v.spatial_merge_size**2
        out = getattr(v, "out_hidden_size", None) or v.hidden_size
        merger = linear(patches / m2, h * m2, h * m2) + linear(patches / m2, h * m2, out)
        mergers = 1 + getattr(self, "deepstack_levels", 0)
        return Flops(forward=embed + blocks + mergers * merger, data_input=embed)


def _windows(v, frames) -> list[int]:
    """Patches of every attention window of Qwen2.5's tower (HF's ``get_window_index``:
    windows of ``window_size`` px from each frame's top left; the last row and column of
    windows cut by the frame's edge)."""
    m = v.spatial_merge_size
    size = v.window_size // m // v.patch_size  # in merged tokens

    def sides(n: int) -> list[int]:
        return [min(size, n - i) for i in range(0, n, size)]

    return [a * b * m * m for h, w in frames for a in sides(h // m) for b in sides(w // m)]
