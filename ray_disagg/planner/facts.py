"""What the cost model knows of a recipe's model and data: each part's parameters (a
token's share of them, the trainable ones, LoRA), one sample's tokens and patches, and the
model spec with its meta models built once for the planner (:mod:`ray_disagg.planner.cost`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ray_disagg.lora.parts import part_lora
from ray_disagg.planner.memory import part_model, seq_len

__all__ = ["CachedModel", "ModelFacts", "PartFacts", "Workload", "model_facts", "workload"]


@dataclass(frozen=True)
class Workload:
    """What one sample costs: LLM tokens, tower patches (before merging), images."""

    tokens: float
    patches: float
    images: float
    source: str


@dataclass(frozen=True)
class PartFacts:
    params: float
    """Parameters a token passes (routed experts counted ``top_k / num_experts``),
    without the embeddings."""
    total: float
    trainable: bool
    trained: float = 0.0
    """Parameters with gradients (all of a trainable part in full fine-tuning)."""
    lora: bool = False
    """The part trains a LoRA adapter: its frozen base gets input gradients only."""


@dataclass(frozen=True)
class ModelFacts:
    parts: dict
    text: object
    vision: object
    llm_part: str


class CachedModel:
    """The recipe's model spec with its meta models built once (the planner calls the
    memory estimate for thousands of layouts)."""

    def __init__(self, spec):
        spec = getattr(spec, "spec", spec)  # never wrapped twice
        self._spec = self.spec = spec
        self.memory_cache: dict = {}

    @functools.cache  # noqa: B019 (one instance per planning)
    def meta_model(self, part=None):
        return self._spec.meta_model(part)

    @functools.cached_property
    def adapter(self):
        return self._spec.adapter

    def load_config(self):
        return self._config

    def __getattr__(self, name: str):  # the rest of the spec (seed, peft_path, ...)
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._spec, name)

    @functools.cached_property
    def _config(self):
        return self._spec.load_config()


def model_facts(r) -> ModelFacts:
    cfg = r.model.load_config()
    t = cfg.text_config
    parts = {}
    for part, group in r.groups.items():
        n = body = trained = 0.0
        experts = getattr(t, "num_experts", None)
        k = getattr(t, "num_experts_per_tok", None)
        lora = part_lora(r.model, part, group) is not None
        for name, p in part_model(r, part).named_parameters():
            n += p.numel()
            trained += p.numel() if (p.requires_grad or not lora) else 0
            if "embed_tokens" in name:
                continue
            share = k / experts if experts and k and ".mlp.experts." in name else 1.0
            body += p.numel() * share
        trained *= group.trainable
        parts[part] = PartFacts(body, n, group.trainable, trained, lora)
    return ModelFacts(parts, t, getattr(cfg, "vision_config", None), r.model.adapter.llm_part)


def workload(r, stats: dict | None = None) -> Workload:
    """From the data's statistics (``data_stats.record_statistics``) when given, else
    the recipe's ``plan`` (image size, images per sample, seq_len)."""
    cfg = r.model.load_config()
    v = getattr(cfg, "vision_config", None)
    images = r.plan["images_per_sample"] if v is not None else 0
    per_image = r.model.adapter.image_patches(r.plan["image_size"])[0] if v is not None else 0
    if stats and stats.get("tokens"):
        merge = getattr(v, "spatial_merge_size", 1) ** 2 if v is not None else 1
        tokens = sum(stats["tokens"]) / len(stats["tokens"])
        patches = sum(stats["media"]) / len(stats["tokens"]) * merge
        return Workload(tokens, patches, images, f"{len(stats['tokens'])} sampled records")
    return Workload(seq_len(r), images * per_image, images, "recipe plan")
