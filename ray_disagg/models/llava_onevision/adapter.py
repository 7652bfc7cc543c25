"""LLaVA-OneVision: a SigLIP tower on fixed-size tiles with any-resolution crops. An image
alone in its sample is cut into the crops of its best grid pinpoint plus a base tile; in
a sample with several images each image is one tile (HF's ``batch_num_images``). The
vision part runs HF's own ``get_image_features`` (projector, crops unpadded to the image's
aspect ratio, ``image_newline`` rows appended; ``image_newline`` is a vision-part
parameter), so an image's rows depend on its ``image_sizes``: they are counted on the host
with HF's own ``pack_image_features`` on a one-channel stand-in. Samples carry
``pixel_values`` ``(tiles, C, S, S)`` (every image's tiles in order) and ``image_sizes``
``(images, 2)``. Videos have a path of their own (pooled frames, ``video_embeds``:
:mod:`~ray_disagg.models.llava_onevision.videos`).

The vision part makes one tower call per microbatch, on every image tile and video frame
(so the ranks of an FSDP2 group call the tower alike whatever their samples hold): the
tower and projector per tile, as HF's ``get_image_features`` and ``get_video_features``
run them, then HF's own ``pack_image_features`` per image and ``apply_pooling`` per frame
(and ``image_newline`` per video). Under ``SequenceParallel`` the tiles and frames of a
microbatch split across the SP ranks, whole tiles each
(:mod:`~ray_disagg.parallel.tile_parallel`; an image's crops and a video's frames may land
on several ranks): each rank runs the tower and projector on its own, SP rank 0 gathers
the rows in tile order and packs the images and pools the frames there."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration
from transformers.models.llava_onevision.modeling_llava_onevision import (
    LlavaOnevisionModel,
    image_size_to_num_patches,
)

from ray_disagg.models.base import Crossing, SampleError, tensor_or_none
from ray_disagg.models.flops import Flops, linear
from ray_disagg.models.llava_common import LlavaAdapter
from ray_disagg.models.llava_onevision.flavors import tiny_llava_onevision_config
from ray_disagg.models.llava_onevision.processing import OnevisionProcessing
from ray_disagg.models.llava_onevision.videos import OnevisionVideos

__all__ = ["LlavaOnevisionAdapter"]


class LlavaOnevisionAdapter(OnevisionVideos, OnevisionProcessing, LlavaAdapter):
    model_type = "llava_onevision"
    config_class = LlavaOnevisionConfig
    hf_class = LlavaOnevisionForConditionalGeneration
    part_modules = {
        "vision": ("model.vision_tower", "model.multi_modal_projector", "model.image_newline"),
        "text": ("model.language_model", "lm_head"),
    }
    tiles_per_image_run = True
    media = ("images", "videos")
    tiny_config = staticmethod(tiny_llava_onevision_config)
    cp_parts = ("text",)  # 1-D rope: the slice of each row, packed or padded

    def __init__(self, config):
        super().__init__(config)
        strategy = config.vision_feature_select_strategy
        if strategy != "full":
            raise ValueError(
                f"llava_onevision: vision_feature_select_strategy={strategy!r} is not "
                "supported (its crops would lose a patch and no longer form a grid); the "
                "released LLaVA-OneVision checkpoints use 'full'."
            )

    @property
    def _side(self) -> int:
        v = self.config.vision_config
        return v.image_size // v.patch_size

    def _sizes(self, sample: dict) -> np.ndarray | None:
        sizes = sample.get("image_sizes")
        return None if sizes is None else np.asarray(sizes, dtype=np.int64).reshape(-1, 2)

    def image_tiles(self, size, alone: bool) -> int:
        """Tiles of one image of ``size`` (h, w): crops + base when ``alone`` in its sample."""
        if not alone:
            return 1
        c = self.config
        pinpoints = c.image_grid_pinpoints
        return image_size_to_num_patches(
            list(map(int, size)), pinpoints, c.vision_config.image_size
        )

    def image_rows(self, size, alone: bool) -> int:
        """Rows HF's ``pack_image_features`` gives one image (newline rows included)."""
        tiles = self.image_tiles(size, alone)
        stand_in = torch.zeros(tiles, self._side**2, 1)
        packer = SimpleNamespace(config=self.config)
        _, lens = LlavaOnevisionModel.pack_image_features(
            packer,
            [stand_in],
            torch.as_tensor([list(map(int, size))]),
            image_newline=torch.zeros(1),
            vision_aspect_ratio=self.config.vision_aspect_ratio,
        )
        return int(lens[0])

    def tiles(self, sample):
        """The tiles of the sample's images (``pixel_values``)."""
        sizes = self._sizes(sample)
        if sizes is None:
            return 0
        return sum(self.image_tiles(s, len(sizes) == 1) for s in sizes)

    def tower_tiles(self, sample):
        return self.tiles(sample) + sum(self.video_frames(sample) or [])

    def projector_flops(self, tiles):
        """The projector on every patch of every tile (strategy ``"full"``), before
        ``pack_image_features`` unpads, pools and appends ``image_newline`` (no FLOPs):
        ``linear_1`` (the tower's width x the feature layers -> LLM width) and
        ``linear_2`` (LLM width -> LLM width)."""
        c = self.config
        layers = c.vision_feature_layer
        width = c.vision_config.hidden_size * (1 if isinstance(layers, int) else len(layers))
        rows, t = tiles * self._tile_patches(), c.text_config.hidden_size
        return Flops(forward=linear(rows, width, t) + linear(rows, t, t))

    def counter_names(self, part):
        return ("images", "videos", "tiles")

    def item_counts(self, part, samples):
        """Images, videos, and tiles the tower runs (images' tiles and video frames)."""
        sizes = [self._sizes(s) for s in samples]
        videos = [self.video_frames(s) or [] for s in samples]
        return {
            "images": sum(0 if z is None else len(z) for z in sizes),
            "videos": sum(map(len, videos)),
            "tiles": sum(self.tower_tiles(s) for s in samples),
        }

    def placeholder_ids(self):
        return (self.image_token_id, self.video_token_id)

    def crossings(self, part):
        width = self.config.text_config.hidden_size
        return (Crossing("image_embeds", width), Crossing("video_embeds", width))

    def crossing_rows(self, part, sample):
        sizes = self._sizes(sample)
        rows = 0 if sizes is None else sum(self.image_rows(s, len(sizes) == 1) for s in sizes)
        return {"image_embeds": rows, "video_embeds": self.video_rows(sample)}

    def synthetic_inputs(self, spec, rng):
        """An image of grid ``(t, h, w)`` in ``spec`` is ``4h x 4w`` pixels; a video ``t``
        frames (its tokens after the images', as the family's chat template puts them)."""
        self.check_spec(spec)
        fields, tokens = {}, []
        grids = spec.get("images") or []
        if grids:
            sizes = np.asarray([(4 * g[1], 4 * g[2]) for g in grids], dtype=np.int64)
            fields["image_sizes"] = sizes
            shape = (self.tiles(fields), *self.tile_shape)
            fields["pixel_values"] = rng.standard_normal(shape).astype(np.float32)
            for s in sizes:
                tokens += [self.image_token_id] * self.image_rows(s, len(sizes) == 1)
        if spec.get("videos"):
            video_fields, video_tokens = self.synthetic_videos(spec["videos"], rng)
            fields.update(video_fields)
            tokens += video_tokens
        return fields, tokens

    def validate_modalities(self, sample, ids, name):
        pixels, sizes = sample.get("pixel_values"), self._sizes(sample)
        if (pixels is None) != (sizes is None):
            raise SampleError(f"{name}: give both 'pixel_values' and 'image_sizes' or neither.")
        if pixels is not None:
            shape = tuple(np.shape(pixels))
            want = (self.tiles(sample), *self.tile_shape)
            if shape != want:
                raise SampleError(
                    f"{name}: pixel_values has shape {shape} but its image_sizes "
                    f"{sizes.tolist()} need {want} (the tiles of every image in order; an "
                    "image alone in its sample has its any-resolution crops and a base tile)."
                )
        n_tokens = int((ids == self.image_token_id).sum())
        n_rows = self.crossing_rows("vision", sample)["image_embeds"]
        if n_tokens != n_rows:
            raise SampleError(
                f"{name}: {n_tokens} image tokens (id {self.image_token_id}) in input_ids but "
                f"its images give {n_rows} embeddings; expand each image placeholder as the "
                "LLaVA-OneVision processor does."
            )
        self.validate_videos(sample, ids, name)

    def encoder_fields(self, part):
        return ("pixel_values", "image_sizes", "pixel_values_videos", "video_frames")

    def _pixel_inputs(self, samples) -> dict | None:
        with_images = [s for s in samples if s.get("pixel_values") is not None]
        if not with_images:
            return None
        return {
            "pixel_values": tensor_or_none([s["pixel_values"] for s in with_images], np.float32),
            "image_sizes": tensor_or_none([self._sizes(s) for s in with_images]),
            "batch_num_images": torch.as_tensor([len(self._sizes(s)) for s in with_images]),
        }

    def encode(self, module, part, samples, device, sp=None):
        """``image_embeds`` and ``video_embeds`` from one tower call on every image tile and
        video frame (:meth:`tile_features`), then HF's own ``pack_image_features`` per
        image and :meth:`video_embeds` per video. Under SP (``sp``: the group) each rank
        runs :meth:`tile_features` on its own tiles and SP rank 0 packs and pools the
        gathered rows (:meth:`tile_rows`; ``(0, D)`` on the other ranks)."""
        images = [s for s in samples if s.get("pixel_values") is not None]
        videos = [s for s in samples if s.get("pixel_values_videos") is not None]
        if not images and not videos:
            return {}
        inner = module.model
        arrays = [s["pixel_values"] for s in images] + [self.video_pixels(s) for s in videos]
        flat = self.tile_rows(inner, self.tile_features, arrays, device, sp)
        if sp is not None and dist.get_rank(sp) != 0:
            kinds = {"image_embeds": images, "video_embeds": videos}
            return {name: flat for name, kind in kinds.items() if kind}
        rows = flat.reshape(-1, self._side**2, flat.shape[-1])
        n, out = sum(self.tiles(s) for s in images), {}
        if images:
            out["image_embeds"] = self._pack_images(inner, rows[:n], images)
        if videos:
            out["video_embeds"] = self.video_embeds(inner, rows[n:], videos)
        return out

    def tile_features(self, inner, pixels: torch.Tensor) -> torch.Tensor:
        """``(tiles, patches, LLM width)``: what HF's ``get_image_features`` and
        ``get_video_features`` compute per tile or frame before packing or pooling (the
        ``vision_feature_layer`` hidden states, strategy ``"full"``, through the
        projector), with HF's own tower call. HF has no function that stops before the
        packing or pooling, which tile SP needs per rank (rank 0 packs after the gather)."""
        layer = self.config.vision_feature_layer
        out = inner.vision_tower(pixels, output_hidden_states=layer, return_dict=True)
        hidden = out.hidden_states
        if isinstance(layer, int):
            selected = hidden[layer]
        else:
            selected = torch.cat([hidden[i] for i in layer], dim=-1)
        return inner.multi_modal_projector(selected)

    def _pack_images(self, inner, tiles: torch.Tensor, images: list[dict]) -> torch.Tensor:
        """The images' rows from their tiles' projector rows, packed per image by HF's
        ``pack_image_features`` (crops unpadded to the image's aspect ratio,
        ``image_newline`` rows), as HF's ``get_image_features`` does."""
        sizes = [self._sizes(s) for s in images]
        counts = [self.image_tiles(z, len(zs) == 1) for zs in sizes for z in zs]
        packed, _ = inner.pack_image_features(
            list(tiles.split(counts)),
            tensor_or_none(sizes),  # on the CPU, as HF reads it
            image_newline=inner.image_newline,
            vision_aspect_ratio=self.config.vision_aspect_ratio,
        )
        return torch.cat(packed)

    def encoder_output(self, rows):
        return super().encoder_output((rows,))

    def mm_encoder_outputs(self, received):
        mm = super().mm_encoder_outputs(received) or {}
        if received.get("video_embeds") is not None:
            mm["video"] = self.video_output(received["video_embeds"])
        return mm or None

    def reference_inputs(self, samples):
        batch = self.collate_llm(samples)
        videos = self.reference_videos(samples)
        return {**batch, **(self._pixel_inputs(samples) or {}), **videos}
