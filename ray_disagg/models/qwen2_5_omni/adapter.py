"""Qwen2.5-Omni thinker: the Qwen2.5-VL vision side (windowed tower with separate q/k/v,
mrope LLM whose video positions scale with ``video_second_per_grid``) plus a Whisper-like
``audio`` part (``model.audio_tower``) whose embeddings cross to the text part as
``audio_embeds``. The text part scatters them into the audio placeholders itself (HF's
thinker has no precomputed-audio input) and passes ``feature_attention_mask`` only so that
HF's ``get_rope_index`` knows each audio's length."""

from __future__ import annotations

import numpy as np
import torch
from transformers import Qwen2_5OmniThinkerConfig, Qwen2_5OmniThinkerForConditionalGeneration

from ray_disagg.models.base import Crossing, SampleError, tensor_or_none
from ray_disagg.models.flops import Flops
from ray_disagg.models.processing import ProcessingHooks
from ray_disagg.models.qwen2_5_omni.costs import audio_tower_flops
from ray_disagg.models.qwen2_5_omni.flavors import tiny_qwen2_5_omni_thinker_config
from ray_disagg.models.qwen2_5_omni.parallelize import TOWER_PLAN, OmniParallelMixin
from ray_disagg.models.qwen_common.adapter import QwenVLAdapter

__all__ = ["Qwen2_5OmniThinkerAdapter", "audio_rows"]

AUDIO_FIELDS = ("input_features", "feature_attention_mask")


def audio_rows(frames) -> np.ndarray:
    """Embeddings (= audio tokens) the audio tower makes of audios of ``frames`` mel frames
    (``Qwen2_5OmniAudioEncoder._get_feat_extract_output_lengths``)."""
    after_cnn = (np.asarray(frames, dtype=np.int64) - 1) // 2 + 1
    return (after_cnn - 2) // 2 + 1


class Qwen2_5OmniThinkerAdapter(OmniParallelMixin, QwenVLAdapter):
    """Three parts: ``vision`` (images, videos), ``audio`` and ``text``."""

    model_type = "qwen2_5_omni_thinker"
    config_class = Qwen2_5OmniThinkerConfig
    hf_class = Qwen2_5OmniThinkerForConditionalGeneration
    encoder_parts = ("vision", "audio")
    media = ("images", "videos", "audios")
    part_modules = {
        "vision": ("model.visual",),
        "audio": ("model.audio_tower",),
        "text": ("model.language_model", "lm_head"),
    }
    tower_plan = TOWER_PLAN
    llm_extra_fields = ("video_second_per_grid",)
    windowed_tower = True
    gated_tower_mlp = True
    cp_parts = ("text",)  # mrope over text, images, videos and audio: sliced like Qwen2.5's
    tiny_config = staticmethod(tiny_qwen2_5_omni_thinker_config)

    # ---- samples ----------------------------------------------------------------------

    def placeholder_ids(self):
        return (*super().placeholder_ids(), self.config.audio_token_id)

    def placeholder_tokens(self, modality, grid):
        """For ``modality == "audio"``, ``grid`` is the audio's number of mel frames."""
        if modality != "audio":
            return super().placeholder_tokens(modality, grid)
        c = self.config
        n = int(audio_rows(grid))
        return [c.audio_start_token_id, *[c.audio_token_id] * n, c.audio_end_token_id]

    def tiny_chat(self):
        """Not written: the thinker's template has its own vision and audio markers."""
        return ProcessingHooks.tiny_chat(self)

    def media_ids(self, kind, item, token, tokenizer):
        """An audio ``(features, mask)``: one ``token`` per audio-tower output."""
        if kind != "audio":
            return super().media_ids(kind, item, token, tokenizer)
        return [token] * int(audio_rows(int(item[1].sum())))

    def media_fields(self, items):
        """Also ``input_features`` and ``feature_attention_mask`` of the audios, cut to
        the longest (frames past it are never read by the tower)."""
        out = super().media_fields(items)
        if items["audio"]:
            frames = max(int(mask.sum()) for _, mask in items["audio"])
            out["input_features"] = np.stack([f[:, :frames] for f, _ in items["audio"]])
            out["feature_attention_mask"] = np.stack([m[:frames] for _, m in items["audio"]])
        return out

    def synthetic_inputs(self, spec, rng):
        """Also ``spec["audios"]``: a list of mel-frame counts (random log-mel features)."""
        fields, tokens = super().synthetic_inputs(spec, rng)
        frames = [int(f) for f in spec.get("audios") or []]
        if frames:
            mel, longest = self.config.audio_config.num_mel_bins, max(frames)
            mask = (np.arange(longest)[None] < np.asarray(frames)[:, None]).astype(np.int64)
            feats = rng.standard_normal((len(frames), mel, longest)).astype(np.float32)
            fields["input_features"] = feats * mask[:, None]
            fields["feature_attention_mask"] = mask
            for f in frames:
                tokens += self.placeholder_tokens("audio", f)
        return fields, tokens

    def stand_in_spec(self, part):
        return {"audios": [16]} if part == "audio" else super().stand_in_spec(part)

    def audio_lengths(self, sample: dict) -> np.ndarray:
        """Mel frames of each of the sample's audios (empty when it has none)."""
        mask = sample.get("feature_attention_mask")
        return np.zeros(0, np.int64) if mask is None else np.asarray(mask).sum(-1).reshape(-1)

    def validate_modalities(self, sample, ids, name):
        super().validate_modalities(sample, ids, name)
        if self._grid(sample, "video_grid_thw") is not None and (
            sample.get("video_second_per_grid") is None
        ):
            raise SampleError(
                f"{name} has videos but no 'video_second_per_grid' (one value per video: "
                "temporal_patch_size / fps, as the Qwen2.5-Omni processor gives)."
            )
        feats, mask = (sample.get(k) for k in AUDIO_FIELDS)
        if (feats is None) != (mask is None):
            raise SampleError(f"{name}: give both {AUDIO_FIELDS} or neither.")
        c = self.config
        n_audios = 0
        if feats is not None:
            fshape, mshape, mel = np.shape(feats), np.shape(mask), c.audio_config.num_mel_bins
            if (
                len(fshape) != 3
                or fshape[1] != mel
                or len(mshape) != 2
                or ((mshape[0], mshape[1]) != (fshape[0], fshape[2]))
            ):
                raise SampleError(
                    f"{name}: input_features {tuple(fshape)} / feature_attention_mask "
                    f"{tuple(mshape)} must be (num_audios, {mel}, frames) / (num_audios, "
                    "frames), as the Qwen2.5-Omni feature extractor gives."
                )
            n_audios = fshape[0]
            if (audio_rows(self.audio_lengths(sample)) < 1).any():
                raise SampleError(f"{name}: every audio needs >= 3 mel frames in its mask.")
        n_starts = int((ids == c.audio_start_token_id).sum())
        if n_starts != n_audios:
            raise SampleError(
                f"{name}: {n_starts} audio-start tokens (id {c.audio_start_token_id}) but "
                f"{n_audios} audios; wrap each audio's tokens in audio start/end tokens."
            )
        n_tokens, n_emb = int((ids == c.audio_token_id).sum()), self.audio_tokens(sample)
        if n_tokens != n_emb:
            raise SampleError(
                f"{name}: {n_tokens} audio tokens (id {c.audio_token_id}) in input_ids but its "
                f"audios give {n_emb} embeddings; expand each audio placeholder to "
                "((frames - 1) // 2 + 1 - 2) // 2 + 1 tokens as the Qwen2.5-Omni processor does."
            )

    def audio_tokens(self, sample: dict) -> int:
        return int(audio_rows(self.audio_lengths(sample)).sum())

    def crossings(self, part):
        if part == "audio":
            return (Crossing("audio_embeds", self.config.text_config.hidden_size),)
        return super().crossings(part)

    def crossing_rows(self, part, sample):
        if part == "audio":
            return {"audio_embeds": self.audio_tokens(sample)}
        return super().crossing_rows(part, sample)

    def encoder_fields(self, part):
        return AUDIO_FIELDS if part == "audio" else super().encoder_fields(part)

    def llm_fields(self):
        return (*super().llm_fields(), "feature_attention_mask")

    def counter_names(self, part):
        return ("audios",) if part == "audio" else super().counter_names(part)

    def item_counts(self, part, samples):
        if part == "audio":
            return {"audios": sum(len(self.audio_lengths(s)) for s in samples)}
        return super().item_counts(part, samples)

    def tower_flops(self, part, sample) -> Flops:
        """``audio``: the audio tower over the sample's audios (:func:`audio_tower_flops`,
        their mel frames from ``feature_attention_mask``); the vision tower otherwise."""
        if part != "audio":
            return super().tower_flops(part, sample)
        return audio_tower_flops(self.config.audio_config, self.audio_lengths(sample))

    # ---- compute ----------------------------------------------------------------------

    def collate_audio(self, samples) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(input_features, feature_attention_mask)`` of all audios in sample order,
        frames right-padded to the longest (padded frames are masked out)."""
        masks = [np.asarray(s["feature_attention_mask"]) for s in samples if _has_audio(s)]
        if not masks:
            return None, None
        longest = max(m.shape[-1] for m in masks)
        pad = [(0, 0)] * 2
        masks = [np.pad(m, [pad[0], (0, longest - m.shape[-1])]) for m in masks]
        if any("input_features" not in s for s in samples if _has_audio(s)):
            return None, tensor_or_none(masks)  # the LLM part gets the masks only
        feats = [np.asarray(s["input_features"]) for s in samples if _has_audio(s)]
        feats = [np.pad(f, [*pad, (0, longest - f.shape[-1])]) for f in feats]
        return tensor_or_none(feats, np.float32), tensor_or_none(masks)

    def encode(self, module, part, samples, device, sp=None):
        if part != "audio":
            return super().encode(module, part, samples, device, sp)
        if sp is not None:
            raise ValueError("the audio part does not support sequence parallelism.")
        feats, mask = self.collate_audio(samples)
        if feats is None:
            return {}
        tower = module.get_submodule(self.part_modules["audio"][0])
        feats, mask = feats.to(device), mask.to(device)
        # as Qwen2_5OmniThinkerModel.get_audio_features: keep only the unmasked frames
        lengths = mask.sum(-1)
        flat = feats.permute(0, 2, 1)[mask.bool()].permute(1, 0)
        after_cnn, _ = tower._get_feat_extract_output_lengths(lengths)
        out = tower(flat, feature_lens=lengths, aftercnn_lens=after_cnn)
        return {"audio_embeds": out.last_hidden_state}

    def collate_llm(self, items):
        batch = super().collate_llm(items)
        batch.pop("mm_token_type_ids")  # the Omni thinker has none
        batch["feature_attention_mask"] = self.collate_audio(items)[1]
        return batch

    def llm_hidden(self, module, batch, received, context=None):
        inner = module.model
        ids = batch["input_ids"]
        embeds = inner.get_input_embeddings()(ids)
        audio = received.get("audio_embeds")
        if audio is not None:
            _, _, audio_mask = inner.get_placeholder_mask(ids, inputs_embeds=embeds)
            if int(audio_mask[..., 0].sum()) != audio.shape[0]:
                raise ValueError(
                    f"{int(audio_mask[..., 0].sum())} audio tokens but {audio.shape[0]} rows."
                )
            embeds = embeds.masked_scatter(audio_mask, audio.to(embeds.device, embeds.dtype))
        extra = {} if context is None else {"context": context}  # cp_parts: the slice
        out = inner(
            **self.llm_inputs(inner, batch),
            inputs_embeds=embeds,
            mm_encoder_outputs=self.mm_encoder_outputs(received),
            **extra,
        )
        return out.last_hidden_state

    def rope_index(self, inner, rope_inputs):
        """HF's Omni ``get_rope_index`` takes audio lengths and ``second_per_grids``."""
        r, mask = rope_inputs, rope_inputs["feature_attention_mask"]
        pos, _ = inner.get_rope_index(
            r["input_ids"],
            image_grid_thw=r["image_grid_thw"],
            video_grid_thw=r["video_grid_thw"],
            attention_mask=r["attention_mask"],
            audio_seqlens=None if mask is None else mask.sum(-1),
            second_per_grids=r["video_second_per_grid"],
        )
        return pos[:, 0]

    def reference_inputs(self, samples):
        kwargs = super().reference_inputs(samples)
        feats, mask = self.collate_audio(samples)
        if feats is not None:
            kwargs.update(input_features=feats, feature_attention_mask=mask)
        return kwargs


def _has_audio(sample: dict) -> bool:
    return sample.get("feature_attention_mask") is not None
