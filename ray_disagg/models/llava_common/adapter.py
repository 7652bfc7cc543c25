"""What the LLaVA-shaped families share (Gemma 3, InternVL, LLaVA-OneVision): a ``vision``
part holding the tower (SigLIP, InternViT) and the multimodal projector, whose image rows
cross to the ``text`` part (``model.language_model`` + ``lm_head``) as ``image_embeds``;
HF's ``...Model.forward`` scatters them at the image placeholder tokens of
``inputs_embeds`` (``mm_encoder_outputs``), with 1-D rope.

The projector stays with the tower: it maps the tower's width to the LLM's and, for
InternVL and Gemma 3, first reduces the rows (pixel shuffle, average pooling), so what
crosses is the smallest tensor of the forward.

Images arrive as fixed-size tiles: a sample's ``pixel_values`` is ``(tiles, C, S, S)``
(Gemma 3: one tile per image or pan-and-scan crop; InternVL: the processor's tiles of every
image, thumbnails included, and every video frame, one tile each with its own placeholder
run, in media order as ``InternVLProcessor`` merges them) and each tile gives
``tokens_per_tile`` rows. A family package subclasses :class:`LlavaAdapter` and sets its
classes, the token ids of an image's placeholder run and, where it differs, the tower
call, a video path of its own (LLaVA-OneVision) and the LLM's extra inputs. Gemma 3 has
no video input.

Under ``SequenceParallel`` (tile SP, :mod:`~ray_disagg.parallel.tile_parallel`) the tiles
of a microbatch split across the SP ranks, whole tiles each: an image's tiles (InternVL)
or the images themselves (Gemma 3) land on several ranks. Every rank copies only its own
tiles to the device and runs :meth:`LlavaAdapter.image_features` on them (the tower and
the per-tile pixel shuffle or pooling and projector), and SP rank 0 gathers the rows in
tile order; a rank with no tile runs a stand-in tile whose rows are dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from ray_disagg.models.base import (
    Crossing,
    ModelAdapter,
    SampleError,
    tensor_or_none,
)
from ray_disagg.models.llava_common.costs import LlavaTowerCosts
from ray_disagg.models.llava_common.parallelize import LlavaParallelMixin
from ray_disagg.models.llava_common.processing import TileProcessing
from ray_disagg.models.packing import PackedTextMixin
from ray_disagg.models.tower_flops import pair, tile_patches
from ray_disagg.parallel.tile_parallel import tile_sp_forward
from ray_disagg.parallel.ulysses import HostRows

__all__ = ["LlavaAdapter"]


class LlavaAdapter(
    LlavaTowerCosts, LlavaParallelMixin, PackedTextMixin, TileProcessing, ModelAdapter
):
    """Shared logic of the LLaVA-shaped families (see module docstring)."""

    encoder_parts = ("vision",)
    part_modules = {
        "vision": ("model.vision_tower", "model.multi_modal_projector"),
        "text": ("model.language_model", "lm_head"),
    }
    media: ClassVar[tuple[str, ...]] = ("images",)
    video_field_refusal: ClassVar[str] = (
        "has no video input (its model and processor take images only): drop the video, "
        "or give some of its frames as images"
    )
    """Why a sample's ``pixel_values_videos`` is refused (a family with a video input of
    its own reads it instead)."""
    tiles_per_image_run: ClassVar[bool] = False
    """Whether one placeholder run holds all of an image's tiles (InternVL) rather than
    one run per tile (Gemma 3's crops are separate images)."""

    # ---- the family's numbers -----------------------------------------------------------

    @property
    def image_token_id(self) -> int:
        return self.config.image_token_id

    @property
    def tokens_per_tile(self) -> int:
        """Rows (and placeholder tokens) one tile gives."""
        raise NotImplementedError

    @property
    def tile_shape(self) -> tuple[int, int, int]:
        """``(C, S, S)`` of one tile."""
        v = self.config.vision_config
        return (v.num_channels, *pair(v.image_size))

    def run_tokens(self, tiles: int) -> tuple[list[int], list[int]]:
        """The tokens before and after the ``tiles * tokens_per_tile`` image tokens of one
        placeholder run (begin/end-of-image markers)."""
        return [], []

    def placeholder_ids(self):
        return (self.image_token_id,)

    def placeholder_tokens(self, tiles: int) -> list[int]:
        before, after = self.run_tokens(tiles)
        return [*before, *[self.image_token_id] * (tiles * self.tokens_per_tile), *after]

    # ---- samples ----------------------------------------------------------------------

    def tiles(self, sample: dict) -> int:
        pixels = sample.get("pixel_values")
        return 0 if pixels is None else int(np.shape(pixels)[0])

    def check_spec(self, spec: dict) -> None:
        """``ValueError`` naming the media of a ``synthetic_inputs`` spec the family lacks."""
        unknown = set(spec) - set(self.media)
        if unknown:
            raise ValueError(
                f"{self.model_type} samples have no {sorted(unknown)} (it takes "
                f"{', '.join(self.media)})."
            )

    def synthetic_inputs(self, spec: dict, rng) -> tuple[dict, list[int]]:
        """Random tiles for ``spec`` (``{"images": [grid...], "videos": [grid...]}``; an
        image of grid ``(t, h, w)`` becomes ``max(1, h * w // 16)`` tiles, so specs written
        for the Qwen families give images of different tile counts; a video ``t`` frames,
        one tile and one placeholder run each, after the images) and their placeholder
        tokens."""
        self.check_spec(spec)
        counts = [max(1, int(np.prod(g[1:])) // 16) for g in spec.get("images") or []]
        runs = [[n] if self.tiles_per_image_run else [1] * n for n in counts]
        runs += [[1] * int(g[0]) for g in spec.get("videos") or []]
        n_tiles = sum(map(sum, runs))
        if not n_tiles:
            return {}, []
        pixels = rng.standard_normal((n_tiles, *self.tile_shape)).astype(np.float32)
        tokens = []
        for tiles in (t for item in runs for t in item):
            tokens += self.placeholder_tokens(tiles)
        return {"pixel_values": pixels}, tokens

    def stand_in_spec(self, part):
        return {"images": [(1, 4, 4)]}

    def refuse_videos(self, sample: dict, name: str) -> None:
        """:class:`SampleError` for a ``pixel_values_videos`` the family does not read."""
        if sample.get("pixel_values_videos") is not None:
            raise SampleError(
                f"{name} has 'pixel_values_videos' but {self.model_type} "
                f"{self.video_field_refusal}."
            )

    def validate_modalities(self, sample, ids, name):
        self.refuse_videos(sample, name)
        pixels = sample.get("pixel_values")
        if pixels is not None:
            shape = tuple(np.shape(pixels))
            if len(shape) != 4 or shape[1:] != self.tile_shape:
                raise SampleError(
                    f"{name}: pixel_values has shape {shape} but {self.model_type} takes "
                    f"(tiles, {', '.join(map(str, self.tile_shape))}): fixed-size tiles as "
                    "its image processor makes them."
                )
        n_tokens = int((ids == self.image_token_id).sum())
        n_rows = self.tiles(sample) * self.tokens_per_tile
        if n_tokens != n_rows:
            raise SampleError(
                f"{name}: {n_tokens} image tokens (id {self.image_token_id}) in input_ids but "
                f"its {self.tiles(sample)} image tile(s) give {n_rows} embeddings "
                f"({self.tokens_per_tile} per tile); expand each image placeholder as the "
                f"{self.model_type} processor does."
            )

    def crossings(self, part):
        return (Crossing("image_embeds", self.config.text_config.hidden_size),)

    def crossing_rows(self, part, sample):
        return {"image_embeds": self.tiles(sample) * self.tokens_per_tile}

    def encoder_fields(self, part):
        return ("pixel_values",)

    def llm_fields(self):
        return ()

    def _tile_patches(self) -> int:
        return tile_patches(self.config.vision_config)

    def tower_tiles(self, sample: dict) -> int:
        """Tiles the tower runs for ``sample`` (images' tiles and video frames)."""
        return self.tiles(sample)

    def encoder_cost(self, part, sample):
        """Per tile of ``n`` tower patches: ``n + n**2 / 1024`` (attention is per tile)."""
        n = float(self._tile_patches())
        return self.tower_tiles(sample) * (n + n * n / 1024.0)

    def encoder_patches(self, part, sample):
        """Tiles x the tower's patches per tile."""
        return self.tower_tiles(sample) * self._tile_patches()

    def counter_names(self, part):
        return ("tiles",)

    def item_counts(self, part, samples):
        """Counted from the encoder's own fields (it never sees ``input_ids``; InternVL's
        video frames are tiles)."""
        return {"tiles": sum(self.tiles(s) for s in samples)}

    # ---- compute ----------------------------------------------------------------------

    def image_features(self, inner, pixels: torch.Tensor) -> torch.Tensor:
        """``(tiles, tokens_per_tile, width)`` from HF's own ``get_image_features``."""
        return inner.get_image_features(pixel_values=pixels, return_dict=True).pooler_output

    def encode(self, module, part, samples, device, sp=None):
        """``image_embeds``: every tile's rows in sample and tile order (:meth:`tile_rows`;
        under SP on SP rank 0, ``(0, D)`` elsewhere)."""
        arrays = [s["pixel_values"] for s in samples if s.get("pixel_values") is not None]
        if not arrays:
            return {}
        inner = module.model
        return {"image_embeds": self.tile_rows(inner, self.image_features, arrays, device, sp)}

    def tile_rows(self, inner, features, arrays, device, sp=None) -> torch.Tensor:
        """``(T * R, D)``: ``features(inner, pixels)`` (``(t, R, D)`` of ``(t, C, S, S)``
        tiles in the tower's dtype) of every tile of ``arrays`` in order. Under SP (``sp``:
        the group) each rank copies and runs only its own tiles and the rows are gathered
        to SP rank 0 (``(0, D)`` elsewhere; :func:`tile_sp_forward`)."""
        dtype = next(inner.vision_tower.parameters()).dtype

        def run(pixels):
            return features(inner, pixels.to(dtype))

        if sp is not None:  # each SP rank copies only its own tiles' pixels
            return tile_sp_forward(run, HostRows(arrays, device), sp)
        return run(tensor_or_none(arrays, np.float32).to(device)).flatten(0, 1)

    def llm_kwargs(self, batch: dict) -> dict[str, Any]:
        ids = batch["input_ids"]
        return {"input_ids": ids, "attention_mask": batch["attention_mask"]} | (
            self.extra_llm_kwargs(ids)
        )

    def encoder_output(self, rows: torch.Tensor):
        """HF's ``mm_encoder_outputs["image"]`` for the received rows."""
        return BaseModelOutputWithPooling(pooler_output=rows)

    def mm_encoder_outputs(self, received: dict) -> dict | None:
        """HF's ``mm_encoder_outputs`` argument for the received crossings."""
        emb = received.get("image_embeds")
        return None if emb is None else {"image": self.encoder_output(emb)}

    def llm_hidden(self, module, batch, received, context=None):
        mm = self.mm_encoder_outputs(received)
        inner = module.model
        kwargs = (
            self.llm_inputs(inner, batch)
            if context is None
            else self.context_inputs(inner, batch, context, mm)
        )
        return inner(**kwargs, mm_encoder_outputs=mm).last_hidden_state

    def context_inputs(self, inner, batch: dict, context, mm=None) -> dict[str, Any]:
        """``...Model.forward`` arguments under context parallelism (``cp_parts``): those
        of the batch and the slice ``context`` (``mm``: the encoders' outputs, ``None``
        for a text-only batch)."""
        return {**self.llm_inputs(inner, batch), "context": context}

    def reference_inputs(self, samples: Sequence[dict]):
        batch = self.collate_llm(samples)
        kwargs = {**batch, **self.extra_llm_kwargs(batch["input_ids"])}
        pixels = tensor_or_none([s.get("pixel_values") for s in samples], np.float32)
        if pixels is not None:
            kwargs["pixel_values"] = pixels
        return kwargs
