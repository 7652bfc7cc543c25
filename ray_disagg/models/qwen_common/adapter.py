"""What the Qwen vision-language families share (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, and the
Qwen2.5-Omni thinker's vision side): a ``vision`` part (``model.visual``) whose images and
videos cross to the ``text`` part (``model.language_model`` + ``lm_head``) as
``image_embeds`` / ``video_embeds``. The text part lets HF's own ``...Model.forward`` do the
masked scatter and ``get_rope_index`` from the precomputed encoder outputs.

A family package subclasses :class:`QwenVLAdapter` and sets its classes, tiny config
(``flavors.py``), tower plans (``parallelize.py``) and, where it differs, the crossings
(DeepStack) and the extra LLM kwargs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from ray_disagg.models.base import (
    Crossing,
    ModelAdapter,
    SampleError,
    tensor_or_none,
)
from ray_disagg.models.packing import PackedQwenMixin
from ray_disagg.models.qwen_common.costs import QwenTowerCosts
from ray_disagg.models.qwen_common.parallelize import QwenParallelMixin
from ray_disagg.models.qwen_common.processing import QwenProcessing
from ray_disagg.parallel.ulysses import HostRows, sp_tower_forward

__all__ = ["MODALITIES", "QwenVLAdapter", "RoutedLLMMixin"]

# modality -> (pixel key, grid key, token-id config attribute, mm_token_type id)
MODALITIES = {
    "image": ("pixel_values", "image_grid_thw", "image_token_id", 1),
    "video": ("pixel_values_videos", "video_grid_thw", "video_token_id", 2),
}


class QwenVLAdapter(
    QwenTowerCosts, QwenParallelMixin, PackedQwenMixin, QwenProcessing, ModelAdapter
):
    """Shared logic of the Qwen VL families (see module docstring; the parallel plans come
    from :class:`~ray_disagg.models.qwen_common.parallelize.QwenParallelMixin`)."""

    encoder_parts = ("vision",)
    part_modules = {"vision": ("model.visual",), "text": ("model.language_model", "lm_head")}
    llm_extra_fields: tuple[str, ...] = ()
    """Per-video sample fields the LLM's rope needs besides the grids (Qwen2.5-VL:
    ``second_per_grid_ts``)."""

    # ---- samples ----------------------------------------------------------------------

    @property
    def merge(self) -> int:
        return self.config.vision_config.spatial_merge_size

    def patch_dim(self) -> int:
        v = self.config.vision_config
        return v.in_channels * v.temporal_patch_size * v.patch_size**2

    def placeholder_ids(self):
        return tuple(getattr(self.config, MODALITIES[m][2]) for m in MODALITIES)

    def placeholder_runs(self, modality: str, grid: np.ndarray) -> int:
        """Separate runs of placeholder tokens that ``grid``'s images/videos make."""
        return len(grid)

    def placeholder_tokens(self, modality: str, grid) -> list[int]:
        """The token ids that stand for one image/video of ``grid`` in ``input_ids``."""
        c = self.config
        n = int(np.prod(grid)) // self.merge**2
        return [
            c.vision_start_token_id,
            *[getattr(c, MODALITIES[modality][2])] * n,
            c.vision_end_token_id,
        ]

    def synthetic_inputs(self, spec: dict, rng) -> tuple[dict, list[int]]:
        """Random encoder inputs for ``spec`` (``{"images": [grid...], "videos": [...]}``)
        and the placeholder tokens they need (see ``examples_data.synthetic_samples``)."""
        fields, tokens = {}, []
        for modality, (pix_key, grid_key, _, _) in MODALITIES.items():
            grids = spec.get(f"{modality}s") or []
            if not grids:
                continue
            rows = [rng.standard_normal((int(np.prod(g)), self.patch_dim())) for g in grids]
            fields[pix_key] = np.concatenate(rows).astype(np.float32)
            fields[grid_key] = np.asarray(grids, dtype=np.int64).reshape(-1, 3)
            for g in grids:
                tokens += self.placeholder_tokens(modality, g)
            if modality == "video":
                for key in self.llm_extra_fields:
                    fields[key] = np.full(len(grids), 0.5, dtype=np.float32)
        return fields, tokens

    def stand_in_spec(self, part):
        return {"images": [(1, 2 * self.merge, 2 * self.merge)]}

    def _grid(self, sample: dict, key: str) -> np.ndarray | None:
        grid = sample.get(key)
        return None if grid is None else np.asarray(grid, dtype=np.int64).reshape(-1, 3)

    def encoder_cost(self, part, sample):
        """Per image and video frame of ``n`` merged tokens: ``n + n**2 / 1024`` (the
        full-attention blocks attend within a frame)."""
        if part != "vision":
            return super().encoder_cost(part, sample)
        cost, m2 = 0.0, self.merge**2
        for key in ("image_grid_thw", "video_grid_thw"):
            grid = self._grid(sample, key)
            for t, h, w in grid if grid is not None else ():
                n = float(h * w) / m2
                cost += float(t) * (n + n * n / 1024.0)
        return cost

    def encoder_patches(self, part, sample):
        """The vision tower's patch rows (``pixel_values`` rows: before the ``merge x
        merge`` patch merger)."""
        if part != "vision":
            return super().encoder_patches(part, sample)
        grids = (self._grid(sample, k) for k in ("image_grid_thw", "video_grid_thw"))
        return sum(int(g.prod(-1).sum()) for g in grids if g is not None)

    def tokens(self, sample: dict, modality: str) -> int:
        grid = self._grid(sample, MODALITIES[modality][1])
        return 0 if grid is None else int(grid.prod(-1).sum()) // self.merge**2

    def validate_modalities(self, sample, ids, name):
        for modality, (pix_key, grid_key, tok_attr, _) in MODALITIES.items():
            grid, pixels = self._grid(sample, grid_key), sample.get(pix_key)
            if (grid is None) != (pixels is None):
                raise SampleError(f"{name}: give both '{pix_key}' and '{grid_key}' or neither.")
            if grid is not None:
                if (grid[:, 1:] % self.merge).any():
                    raise SampleError(
                        f"{name}: {grid_key} {grid.tolist()} has h or w not divisible by "
                        f"spatial_merge_size={self.merge}."
                    )
                n_patches = int(grid.prod(-1).sum())
                shape = np.shape(pixels)
                if len(shape) != 2 or tuple(shape) != (n_patches, self.patch_dim()):
                    raise SampleError(
                        f"{name}: {pix_key} has shape {tuple(shape)} but {grid_key} "
                        f"{grid.tolist()} needs ({n_patches}, {self.patch_dim()}) = (patches, "
                        "in_channels * temporal_patch_size * patch_size^2)."
                    )
            token_id = getattr(self.config, tok_attr)
            runs = int(((ids == token_id) & ~np.r_[False, ids[:-1] == token_id]).sum())
            expected = 0 if grid is None else self.placeholder_runs(modality, grid)
            if runs != expected and (ids == token_id).sum() == self.tokens(sample, modality):
                raise SampleError(
                    f"{name}: its {modality} tokens form {runs} run(s) but its {modality}s need "
                    f"{expected}; separate them with vision start/end tokens as the processor "
                    "does (the LLM's rope positions each run as one image/frame)."
                )
            n_tokens, n_emb = int((ids == token_id).sum()), self.tokens(sample, modality)
            if n_tokens != n_emb:
                raise SampleError(
                    f"{name}: {n_tokens} {modality} tokens (id {token_id}) in input_ids but its "
                    f"{modality}s give {n_emb} embeddings; expand each {modality} placeholder "
                    "to t*h*w/merge^2 tokens as the Qwen processor does."
                )
        for key in self.llm_extra_fields:
            videos = self._grid(sample, "video_grid_thw")
            n_videos = 0 if videos is None else len(videos)
            if sample.get(key) is not None and len(np.ravel(sample[key])) != n_videos:
                raise SampleError(f"{name}: '{key}' needs one value per video.")

    def crossings(self, part):
        width = self.config.text_config.hidden_size
        return tuple(Crossing(f"{m}_embeds", width) for m in MODALITIES)

    def crossing_rows(self, part, sample):
        return {c.name: self.tokens(sample, c.name.split("_")[0]) for c in self.crossings(part)}

    def encoder_fields(self, part):
        return tuple(k for m in MODALITIES.values() for k in m[:2])

    def llm_fields(self):
        return ("image_grid_thw", "video_grid_thw", *self.llm_extra_fields)

    def counter_names(self, part):
        return ("images", "videos")

    def item_counts(self, part, samples):
        out = {}
        for name, (_, grid_key, _, _) in zip(("images", "videos"), MODALITIES.values()):
            grids = [self._grid(s, grid_key) for s in samples]
            out[name] = sum(0 if g is None else len(g) for g in grids)
        return out

    # ---- compute ----------------------------------------------------------------------

    def _collate_modality(self, samples, modality):
        pix_key, grid_key, _, _ = MODALITIES[modality]
        pixels = tensor_or_none([s.get(pix_key) for s in samples], np.float32)
        grids = tensor_or_none([self._grid(s, grid_key) for s in samples])
        return pixels, grids

    def tower_outputs(self, tower, pixels, grid, sp) -> list[torch.Tensor]:
        """``[merged embeddings, *extra outputs]`` of one tower call (``sp``: the Ulysses
        SP group or ``None``)."""
        plan = self.sp_plan("vision")
        if sp is not None:
            return sp_tower_forward(tower, pixels, grid, plan, sp)
        return plan.outputs(tower(pixels.to(tower.dtype), grid_thw=grid))

    def encode(self, module, part, samples, device, sp=None):
        """One tower call on the images and then the videos of ``samples`` (what HF's two
        calls compute: attention, windows and positions are per image/frame), split back
        into ``<modality>_embeds`` (and ``<modality>_deepstack_<i>``)."""
        tower = module.get_submodule(self.part_modules["vision"][0])
        arrays, grids, tokens = [], [], {}
        for modality, (pix_key, grid_key, _, _) in MODALITIES.items():
            grid = tensor_or_none([self._grid(s, grid_key) for s in samples])
            if grid is not None:
                arrays += [s[pix_key] for s in samples if s.get(pix_key) is not None]
                grids.append(grid)
                tokens[modality] = int(grid.prod(-1).sum()) // self.merge**2
        if not grids:
            return {}
        grid = torch.cat(grids).to(device)
        if sp is not None:  # each SP rank copies only its slice of the pixels
            pixels = HostRows(arrays, device)
        else:
            pixels = tensor_or_none(arrays, np.float32).to(device)
        outputs = self.tower_outputs(tower, pixels, grid, sp)
        full = outputs[0].shape[0] == sum(tokens.values())  # SP ranks but 0 hold no rows
        sizes = list(tokens.values()) if full else [0] * len(tokens)
        out = {}
        for level, output in enumerate(outputs):
            for modality, rows in zip(tokens, output.split(sizes)):
                name = f"{modality}_embeds" if level == 0 else f"{modality}_deepstack_{level - 1}"
                out[name] = rows
        return out

    def encoder_output(self, received: dict, modality: str):
        emb = received.get(f"{modality}_embeds")
        if emb is None:
            return None
        return BaseModelOutputWithPooling(pooler_output=(emb,))

    def collate_llm(self, items):
        batch = super().collate_llm(items)
        ids = batch["input_ids"]
        types = torch.zeros_like(ids, dtype=torch.int32)
        for _, _, tok_attr, type_id in MODALITIES.values():
            types[ids == getattr(self.config, tok_attr)] = type_id
        batch["mm_token_type_ids"] = types
        for m in MODALITIES.values():
            batch[m[1]] = tensor_or_none([self._grid(it, m[1]) for it in items])
        for key in self.llm_extra_fields:  # per video; HF's default 1.0 where not given
            vals = []
            for it in items:
                videos = self._grid(it, "video_grid_thw")
                if videos is not None:
                    given = it.get(key)
                    vals.append(np.ones(len(videos)) if given is None else np.ravel(given))
            batch[key] = (
                torch.as_tensor(np.concatenate(vals), dtype=torch.float32) if vals else None
            )
        return batch

    def llm_kwargs(self, batch: dict) -> dict[str, Any]:
        keys = ("input_ids", "attention_mask", "mm_token_type_ids", *self.llm_fields())
        return {k: batch[k] for k in keys if batch.get(k) is not None}

    def mm_encoder_outputs(self, received: dict) -> dict | None:
        """HF's ``mm_encoder_outputs`` argument for the received image/video crossings."""
        mm = {m: self.encoder_output(received, m) for m in MODALITIES}
        return {k: v for k, v in mm.items() if v is not None} or None

    def llm_hidden(self, module, batch, received, context=None):
        return self._llm_forward(module, batch, received, context).last_hidden_state

    def _llm_forward(self, module, batch, received, context, **extra):
        if context is not None:
            extra["context"] = context
        return module.model(
            **self.llm_inputs(module.model, batch),
            mm_encoder_outputs=self.mm_encoder_outputs(received),
            **extra,
        )

    def reference_inputs(self, samples: Sequence[dict]):
        batch = self.collate_llm(samples)
        kwargs = {k: v for k, v in batch.items() if v is not None}
        for modality in MODALITIES:
            pixels, grid = self._collate_modality(samples, modality)
            if grid is not None:
                kwargs[MODALITIES[modality][0]] = pixels
        return kwargs


class RoutedLLMMixin:
    """The MoE Qwen families: the LLM also returns its router logits when the auxiliary
    loss is on (:attr:`~ray_disagg.models.base.ModelAdapter.router`)."""

    def llm_outputs(self, module, batch, received, context=None):
        if self.router is None:
            return self.llm_hidden(module, batch, received, context), None
        out = self._llm_forward(module, batch, received, context, output_router_logits=True)
        return out.last_hidden_state, out.router_logits
