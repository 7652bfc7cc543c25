"""What the LLaVA-shaped families' vision part costs (``ray_disagg.models.costs`` hooks):
a plain ViT over every tile (:func:`~ray_disagg.models.tower_flops.vit_tower_flops`) and
the family's projector (:meth:`LlavaTowerCosts.projector_flops`)."""

from __future__ import annotations

from typing import ClassVar

from ray_disagg.models.flops import Flops
from ray_disagg.models.tower_flops import vit_tower_flops

__all__ = ["LlavaTowerCosts"]


class LlavaTowerCosts:
    """Cost hooks of a LLaVA-shaped adapter's ``vision`` part (mixed in before
    ``ModelAdapter``; needs the adapter's ``tower_tiles``)."""

    tower_cls_tokens: ClassVar[int] = 0
    """Tokens the tower prepends to each tile's patches (InternViT's CLS)."""

    def tower_flops(self, part, sample) -> Flops:
        """The tower over the sample's tiles and video frames (the adapter's
        ``tower_tiles``), its blocks after the config's ``vision_feature_layer`` forward
        only, and the projector (LLaVA-OneVision's video pooling has no FLOPs)."""
        v = self.tower_config(part)
        if v is None:
            return super().tower_flops(part, sample)
        tiles = self.tower_tiles(sample)
        if not tiles:
            return Flops()
        layer = getattr(self.config, "vision_feature_layer", -1)
        tower = vit_tower_flops(v, tiles, self.tower_cls_tokens, layer)
        return tower + self.projector_flops(tiles)

    def projector_flops(self, tiles: int) -> Flops:
        """The multimodal projector over the tower's output of ``tiles`` tiles."""
        raise NotImplementedError(f"{type(self).__name__} counts no projector FLOPs")
