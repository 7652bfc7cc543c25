"""Gemma 3: a SigLIP tower on fixed-size images (each pan-and-scan crop is an image of its
own), a projector that average-pools the patches to ``mm_tokens_per_image`` rows, and a
decoder whose attention is bidirectional within each image's block of tokens (causal
elsewhere; the sliding-window layers keep their window). The LLM part of a padded batch
gets ``token_type_ids`` (1 on image tokens), from which HF builds that mask. A packed
batch gets the two masks themselves (:func:`packed_masks`): HF's sliding-window mask looks
the image blocks up at the packed samples' restarting positions instead of their places
in the row. Under context parallelism (:meth:`Gemma3Adapter.context_inputs`) no mask is
built whole: the slice carries the image blocks and each attention call masks its query
chunks (:mod:`~ray_disagg.parallel.context_mask`). Embeddings and ``lm_head`` are
tied."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from transformers import Gemma3Config, Gemma3ForConditionalGeneration
from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask

from ray_disagg.models.base import SampleError
from ray_disagg.models.flops import Flops, linear
from ray_disagg.models.gemma3.flavors import tiny_gemma3_config
from ray_disagg.models.gemma3.processing import Gemma3Processing
from ray_disagg.models.llava_common import LlavaAdapter
from ray_disagg.models.packing import PACKED_KEY, host_to_device, is_packed
from ray_disagg.parallel.context_parallel import MASK_KINDS

__all__ = ["Gemma3Adapter", "packed_masks"]


def packed_masks(batch: dict, image_token_id: int, window: int) -> dict[str, torch.Tensor]:
    """Gemma 3's ``full_attention`` / ``sliding_attention`` masks ``(B, 1, T, T)`` (True:
    attend) of a packed batch, as HF builds them for each sample alone: causal or within
    the same image block, inside the sample, and for the sliding layers less than
    ``window`` tokens back."""
    ids = batch["input_ids"]
    sample = torch.full(ids.shape, -1, dtype=torch.long)
    for i, (row, start, n, _) in enumerate(batch[PACKED_KEY]):
        sample[row, start : start + n] = i
    sample = host_to_device(sample, ids.device)
    block = get_block_sequence_ids_for_mask((ids == image_token_id).long(), ids.device)
    pos = torch.arange(ids.shape[1], device=ids.device)
    # built in place: one (B, T, T) mask per kind, few temporaries at long T
    full = block[:, :, None] == block[:, None, :]
    full &= (block >= 0)[:, :, None]
    full |= (pos[None, :] <= pos[:, None])[None]
    full &= sample[:, :, None] == sample[:, None, :]
    sliding = full & (pos[None, :] > pos[:, None] - window)[None]
    return {"full_attention": full[:, None], "sliding_attention": sliding[:, None]}


class Gemma3Adapter(Gemma3Processing, LlavaAdapter):
    model_type = "gemma3"
    config_class = Gemma3Config
    hf_class = Gemma3ForConditionalGeneration
    per_head_norms = ("q_norm", "k_norm")
    cp_parts = ("text",)  # image blocks and sliding windows masked per query chunk
    tiny_config = staticmethod(tiny_gemma3_config)

    @property
    def tokens_per_tile(self):
        return self.config.mm_tokens_per_image

    def projector_flops(self, tiles):
        """Average pooling to ``mm_tokens_per_image`` rows per tile (no FLOPs), then the
        ``mm_input_projection_weight`` product (vision width -> LLM width) on each row."""
        c = self.config
        rows = tiles * c.mm_tokens_per_image
        return Flops(forward=linear(rows, c.vision_config.hidden_size, c.text_config.hidden_size))

    def counter_names(self, part):
        return ("images",)

    def item_counts(self, part, samples):  # each tile is an image (or pan-and-scan crop)
        return {"images": sum(self.tiles(s) for s in samples)}

    def run_tokens(self, tiles):
        return [self.config.boi_token_id], [self.config.eoi_token_id]

    def validate_modalities(self, sample, ids, name):
        """Also: every run of image tokens is one image's ``mm_tokens_per_image`` (HF's
        bidirectional block is a run of image tokens, so two images' runs must be kept
        apart, by ``eoi``/``boi`` as the processor writes them)."""
        super().validate_modalities(sample, ids, name)
        image = np.asarray(ids) == self.image_token_id
        edges = np.flatnonzero(np.diff(np.concatenate([[0], image.astype(np.int8), [0]])))
        runs = (edges[1::2] - edges[::2]).tolist()
        n = self.config.mm_tokens_per_image
        if any(r != n for r in runs):
            raise SampleError(
                f"{name}: image-token runs of {runs} tokens, but each Gemma 3 image is one "
                f"run of mm_tokens_per_image={n} tokens between boi and eoi (id "
                f"{self.config.boi_token_id}, {self.config.eoi_token_id}); expand each "
                "image placeholder as Gemma3Processor does."
            )

    def extra_llm_kwargs(self, input_ids):
        return {"token_type_ids": (input_ids == self.image_token_id).long()}

    def context_inputs(self, inner, batch, context, mm=None):
        """The batch's arguments without ``token_type_ids`` and with an empty mask mapping
        (HF would build a dense ``(B, 1, S, S)`` mask from them): the slice ``context``
        carries the image blocks (each ``mm_tokens_per_image`` tokens between ``boi`` and
        ``eoi``) and the layers' attention masks query chunks from them; a text-only
        batch (``mm`` ``None``) has no block, so its rows stay plainly causal."""
        packed = is_packed(batch)
        kwargs = super().packed_llm_kwargs(inner, batch) if packed else self.llm_kwargs(batch)
        types = kwargs.pop("token_type_ids")
        if mm is not None:
            blocks = get_block_sequence_ids_for_mask(types, types.device)
            reach = self.config.mm_tokens_per_image - 1
            context = dataclasses.replace(context, blocks=blocks, lookahead=reach)
        return {**kwargs, "attention_mask": dict.fromkeys(MASK_KINDS), "context": context}

    def packed_llm_kwargs(self, inner, batch):
        kwargs = super().packed_llm_kwargs(inner, batch)
        del kwargs["token_type_ids"]
        window = self.config.text_config.sliding_window
        masks = packed_masks(batch, self.image_token_id, window)
        if inner.config.text_config._attn_implementation == "eager":  # additive float
            low = torch.finfo(inner.dtype).min
            masks = {
                k: torch.zeros(m.shape, dtype=inner.dtype, device=m.device).masked_fill(~m, low)
                for k, m in masks.items()
            }
        return {**kwargs, "attention_mask": masks}
