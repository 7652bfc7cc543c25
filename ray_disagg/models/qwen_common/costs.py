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

__all__ = ["QwenTowerCosts"]


class QwenTowerCosts:
    """Cost hooks of a Qwen VL adapter's tower (mixed in before ``ModelAdapter``)."""

    windowed_tower: ClassVar[bool] = False
    """Window attention but in ``fullatt_block_indexes`` (Qwen2.5-VL, Qwen2.5-Omni)."""

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
