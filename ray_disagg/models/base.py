"""What every model-family adapter declares: a multimodal model as data.

An adapter says which Hugging Face submodules each part (= module group) holds, which
named tensors each encoder part sends to the LLM part ("crossings") and how many rows of
each a sample produces, how the LLM part consumes them, how samples are validated and
batched, and the parallel plans of its parts. The runtime (trainer, loops, routing,
checkpoints, export, the single-process reference) is driven only by this interface.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
from torch import nn

from ray_disagg.models.costs import CostHooks
from ray_disagg.models.generation import GenerationHooks
from ray_disagg.models.moe import RouterSpec, router_spec
from ray_disagg.models.processing import ProcessingHooks

if TYPE_CHECKING:
    from ray_disagg.parallel.tensor_parallel import BlockTPPlan, LayerTPPlan, LinearSplit

__all__ = [
    "IGNORE_INDEX",
    "Crossing",
    "ModelAdapter",
    "SampleError",
    "count_label_tokens",
    "sample_name",
]

IGNORE_INDEX = -100


def count_label_tokens(labels: np.ndarray) -> int:
    """Tokens that enter the loss after the causal shift."""
    return int((np.asarray(labels)[1:] != IGNORE_INDEX).sum())


class SampleError(ValueError):
    """A training sample is inconsistent (e.g. image tokens vs image patches)."""


def sample_name(sample: dict, index: int | None) -> str:
    sid = sample.get("id")
    return f"sample {sid!r}" if sid is not None else f"sample at index {index}"


@dataclass(frozen=True)
class Crossing:
    """One tensor an encoder part sends to the LLM part: ``(rows, width)`` float rows in
    sample order; its gradient (same shape) comes back."""

    name: str
    width: int


def tensor_or_none(rows: list, dtype=np.int64) -> torch.Tensor | None:
    """Concatenate per-sample arrays (skipping ``None``) into one new tensor (one copy;
    the rows may be read-only views of a dataset in the object store)."""
    parts = [np.asarray(r, dtype=dtype) for r in rows if r is not None]
    if not parts:
        return None
    return torch.from_numpy(np.concatenate(parts) if parts[0].ndim else np.stack(parts))


class ModelAdapter(CostHooks, GenerationHooks, ProcessingHooks):
    """Base class of the per-family adapters (one package each under ``ray_disagg.models``:
    ``adapter.py`` the data handling, ``parallelize.py`` the parallel plans, ``flavors.py``
    the tiny configs).

    Subclasses set the class attributes and implement the hooks below; instances hold the
    family's HF config.
    """

    model_type: ClassVar[str]
    """``config.model_type`` this adapter handles."""
    config_class: ClassVar[type]
    hf_class: ClassVar[type]
    """The HF ``...ForConditionalGeneration`` class (the single-process reference)."""
    encoder_parts: ClassVar[tuple[str, ...]] = ("vision",)
    media: ClassVar[tuple[str, ...]] = ("images", "videos")
    """Kinds of media the family's samples carry (keys of a ``synthetic_inputs`` spec)."""
    llm_part: ClassVar[str] = "text"
    part_modules: ClassVar[dict[str, tuple[str, ...]]]
    """Part name -> dotted paths (in ``hf_class``) of the submodules the part holds."""
    sp_parts: ClassVar[tuple[str, ...]] = ()
    """Parts that support ``SequenceParallel`` (Ulysses; tile towers: whole tiles per rank,
    see :meth:`sp_plan`)."""
    sp_refusals: ClassVar[dict[str, str]] = {}
    """Part -> why it has no Ulysses plan (named in the driver's error)."""
    tp_parts: ClassVar[tuple[str, ...]] = ("text",)
    """Parts that support ``TensorParallel``."""
    tp_refusals: ClassVar[dict[str, str]] = {}
    """Part -> why it has no ``TensorParallel`` plan (named in the driver's error)."""
    cp_parts: ClassVar[tuple[str, ...]] = ()
    """Parts that support ``ContextParallel`` (the LLM, where its decoder stack takes the
    merged embeddings and positions as keywords; :mod:`ray_disagg.parallel.context_parallel`)."""
    cp_tp_refusal: ClassVar[str | None] = None
    """Why the LLM's ``ContextParallel`` cannot combine with text TP (``tp > 1``), named
    in the driver's error (``None``: it can)."""

    def __init__(self, config):
        self.config = config

    # ---- parts ------------------------------------------------------------------------

    @property
    def parts(self) -> tuple[str, ...]:
        return (*self.encoder_parts, self.llm_part)

    def build_full(self, seed: int, attn_implementation: str = "sdpa") -> nn.Module:
        config = self.config_class.from_dict(self.config.to_dict())
        config._attn_implementation = attn_implementation
        torch.manual_seed(seed)
        return self.hf_class(config).float().train()

    def prune(self, model: nn.Module, part: str) -> nn.Module:
        """Keep only ``part``'s submodules in ``model`` (state-dict keys stay HF keys)."""
        keep = set(self.part_modules[part])
        for other, paths in self.part_modules.items():
            if other == part:
                continue
            for path in paths:
                if path in keep:
                    continue
                owner, _, attr = path.rpartition(".")
                setattr(model.get_submodule(owner) if owner else model, attr, None)
        return model

    def _members(self, module: nn.Module, part: str) -> list[tuple[str, Any]]:
        """``(path, submodule or parameter)`` of each of ``part_modules[part]``."""
        out = []
        for path in self.part_modules[part]:
            owner, _, attr = path.rpartition(".")
            out.append((path, getattr(module.get_submodule(owner) if owner else module, attr)))
        return out

    def part_roots(self, module: nn.Module, part: str) -> list[nn.Module]:
        """The part's HF submodules (activation checkpointing is enabled on them)."""
        return [m for _, m in self._members(module, part) if isinstance(m, nn.Module)]

    def part_parameters(self, module: nn.Module, part: str):
        """``(HF name, parameter)`` of the part's submodules and parameters (a part may
        hold a bare parameter, e.g. LLaVA-OneVision's ``image_newline``)."""
        for path, member in self._members(module, part):
            if isinstance(member, nn.Module):
                yield from member.named_parameters(prefix=path)
            else:
                yield path, member

    # ---- samples ----------------------------------------------------------------------

    def validate_sample(self, sample: dict, index: int | None = None) -> None:
        """Raise :class:`SampleError` naming the sample if its fields disagree."""
        name = sample_name(sample, index)
        if "input_ids" not in sample:
            raise SampleError(f"{name} has no 'input_ids'.")
        ids = np.asarray(sample["input_ids"])
        if ids.ndim != 1 or ids.size < 2:
            raise SampleError(f"{name}: 'input_ids' must be a 1-D sequence of >= 2 tokens.")
        labels = sample.get("labels")
        if labels is not None and np.asarray(labels).shape != ids.shape:
            raise SampleError(f"{name}: 'labels' and 'input_ids' have different lengths.")
        vocab = self.vocab_size
        bad = ids[(ids < 0) | (ids >= vocab)]
        if bad.size:
            raise SampleError(
                f"{name}: input_ids {sorted(set(bad.tolist()))[:5]} are outside the "
                f"vocabulary [0, {vocab}); tokenize with the model's tokenizer."
            )
        if labels is not None:
            lab = np.asarray(labels)
            bad = lab[((lab < 0) | (lab >= vocab)) & (lab != IGNORE_INDEX)]
            if bad.size:
                raise SampleError(
                    f"{name}: labels {sorted(set(bad.tolist()))[:5]} are neither in "
                    f"[0, {vocab}) nor {IGNORE_INDEX} (no loss)."
                )
        self.validate_modalities(sample, ids, name)

    @property
    def vocab_size(self) -> int:
        return self.config.text_config.vocab_size

    def validate_modalities(self, sample: dict, ids: np.ndarray, name: str) -> None:
        raise NotImplementedError

    def placeholder_ids(self) -> tuple[int, ...]:
        """Token ids that are replaced by encoder outputs (never a loss target by default)."""
        raise NotImplementedError

    def labels(self, sample: dict) -> np.ndarray:
        if sample.get("labels") is not None:
            return np.asarray(sample["labels"], dtype=np.int64)
        ids = np.asarray(sample["input_ids"], dtype=np.int64)
        labels = ids.copy()
        labels[np.isin(ids, self.placeholder_ids())] = IGNORE_INDEX
        return labels

    def label_positions(self, sample: dict) -> int:
        """Positions of ``sample`` whose next token enters the loss (:func:`count_label_tokens`)."""
        return count_label_tokens(self.labels(sample))

    def crossings(self, part: str) -> tuple[Crossing, ...]:
        raise NotImplementedError

    def crossing_rows(self, part: str, sample: dict) -> dict[str, int]:
        """Rows of each of ``part``'s crossings that ``sample`` produces."""
        raise NotImplementedError

    def encoder_fields(self, part: str) -> tuple[str, ...]:
        """Sample keys the encoder ``part`` reads."""
        raise NotImplementedError

    def llm_fields(self) -> tuple[str, ...]:
        """Sample keys (besides ``input_ids``/``labels``) the LLM part reads."""
        raise NotImplementedError

    def encoder_cost(self, part: str, sample: dict) -> float:
        """Estimated encoder compute of ``sample`` (for balancing encoder replicas): its
        output rows ``n`` over all crossings plus ``n**2 / 1024`` for attention. Only the
        ranking matters; families refine it (e.g. attention per image or frame)."""
        n = float(sum(self.crossing_rows(part, sample).values()))
        return n + n * n / 1024.0

    def encoder_patches(self, part: str, sample: dict) -> int:
        """The input rows (patches) encoder ``part``'s tower processes for ``sample``, the
        unit of ``max_patches_per_microbatch``; by default its output rows. Families with a
        patch merger or fixed tiles say theirs."""
        return int(sum(self.crossing_rows(part, sample).values()))

    def item_counts(self, part: str, samples: Sequence[dict]) -> dict[str, int]:
        """Counters reported in the metrics (e.g. ``{"images": 3, "videos": 1}``)."""
        return {}

    def counter_names(self, part: str) -> tuple[str, ...]:
        return ()

    def stand_in_spec(self, part: str) -> dict:
        """A minimal ``synthetic_inputs`` spec with work for encoder ``part``."""
        raise NotImplementedError

    def synthetic_inputs(self, spec: dict, rng) -> tuple[dict, list[int]]:
        """Random encoder fields for ``spec`` and the placeholder tokens they need."""
        raise NotImplementedError

    def stand_in_samples(self, part: str) -> list[dict]:
        """Encoder inputs that an FSDP2 rank without samples runs (outputs discarded, zero
        gradients), so all ranks of a group issue the same collectives."""
        fields, _ = self.synthetic_inputs(self.stand_in_spec(part), np.random.default_rng(0))
        return [fields]

    # ---- compute ----------------------------------------------------------------------

    def encode(self, module: nn.Module, part: str, samples: Sequence[dict], device, sp=None):
        """Run encoder ``part`` on ``samples``: a dict crossing name -> rows in sample order.
        ``sp``: the Ulysses SP process group (the tower prepared by
        :func:`~ray_disagg.parallel.ulysses.enable_ulysses`) or ``None``; under SP, ranks
        other than 0 get tensors with 0 rows that are still in the graph."""
        raise NotImplementedError

    def llm_hidden(
        self, module: nn.Module, batch: dict, received: dict, context=None
    ) -> torch.Tensor:
        """Final hidden states ``(B, T, H)`` of the LLM part given the crossings; with a
        ``context`` (a :class:`~ray_disagg.parallel.context_parallel.ContextSlice`, for
        ``cp_parts``) those of this rank's slice of ``T``."""
        raise NotImplementedError

    def llm_outputs(self, module: nn.Module, batch: dict, received: dict, context=None):
        """``(hidden states, router logits)``: :meth:`llm_hidden` and, for a
        mixture-of-experts LLM whose auxiliary loss is on (:attr:`router`), HF's
        per-layer router logits (``None`` otherwise)."""
        return self.llm_hidden(module, batch, received, context), None

    @property
    def router(self) -> RouterSpec | None:
        """The LLM router's auxiliary-loss settings (:mod:`ray_disagg.models.moe`), or
        ``None``: a dense LLM, or ``output_router_logits`` off as by HF's default."""
        return router_spec(getattr(self.config, "text_config", self.config))

    packing_refusal: ClassVar[str | None] = None
    """Why ``pack_sequences`` cannot be exact for this family (``None``: it can; every
    family packs today, the hook names the reason of a future one that cannot)."""

    def prepare_packing(self, decoder: nn.Module) -> None:
        """Prepare the LLM's ``decoder`` (on ``meta``, after its parallel plans) for packed
        batches, where layers that see whole rows need each sample's span (Qwen3.5's
        linear attention); nothing by default."""

    def prepare_context(self, decoder: nn.Module) -> None:
        """Prepare the LLM's ``decoder`` (on ``meta``, after its parallel plans, packing's
        preparation and :func:`~ray_disagg.parallel.context_parallel.enable_context_parallel`)
        for context-parallel calls: layers that cannot run on a slice of the sequence
        take another split (Qwen3.5's linear attention: by heads), and inputs of the
        family's own along the sequence follow the slice (Qwen3-VL's DeepStack: a
        forward pre-hook after the slicing one); nothing by default."""

    def collate_llm(self, items: Sequence[dict]) -> dict[str, Any]:
        """The LLM's batch of ``items``: ``input_ids`` padded to the longest (the text
        config's ``pad_token_id``), ``labels`` (``IGNORE_INDEX`` past each sample) and the
        ``attention_mask``; a family adds its own fields."""
        pad = self.config.text_config.pad_token_id or 0
        length = max(len(it["input_ids"]) for it in items)
        ids = torch.full((len(items), length), pad, dtype=torch.long)
        labels = torch.full((len(items), length), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(items), length), dtype=torch.long)
        for row, it in enumerate(items):
            n = len(it["input_ids"])
            # np.array copies: arrays from Ray's object store are read-only
            ids[row, :n] = torch.from_numpy(np.array(it["input_ids"], dtype=np.int64))
            labels[row, :n] = torch.from_numpy(np.array(self.labels(it)))
            mask[row, :n] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    def collate_llm_packed(self, items: Sequence[dict], max_seq_len: int) -> dict[str, Any]:
        """Like ``collate_llm`` but several samples share a row (``ray_disagg.models.packing``):
        rows of at most ``max_seq_len`` tokens filled in item order, ``labels`` with each
        sample's first token ``IGNORE_INDEX``, no ``attention_mask``; ``llm_hidden`` keeps
        the samples apart. ``ValueError`` naming a sample longer than ``max_seq_len``."""
        raise NotImplementedError

    def reference_inputs(self, samples: Sequence[dict]) -> dict[str, Any]:
        """Keyword arguments of ``hf_class.forward`` (with ``labels``) for ``samples``."""
        raise NotImplementedError

    # ---- parallel plans ---------------------------------------------------------------

    def llm_modules(self, module: nn.Module) -> tuple[nn.Module, nn.Module]:
        """``(decoder with .layers and .embed_tokens, lm_head)`` of the LLM part."""
        raise NotImplementedError

    def sp_plan(self, part: str):
        """The :class:`~ray_disagg.parallel.ulysses.TowerPlan` of an SP-capable part, or
        ``None`` where SP splits whole tiles and the tower runs unmodified
        (:mod:`~ray_disagg.parallel.tile_parallel`)."""
        raise NotImplementedError

    param_splits: ClassVar[tuple[LinearSplit, ...]] = ()
    """Fused Linears (and depthwise convolutions) that a parallel plan may store as row
    blocks (their checkpoint names then differ from HF's; see :meth:`hf_param_name`)."""

    @classmethod
    def hf_param_name(cls, name: str) -> tuple[str, int | None, int]:
        """``(HF name, row block, blocks)`` of a part's parameter or checkpoint tensor
        ``name``: for a row block of a split fused Linear (``param_splits``), the fused HF
        tensor, the block's index and the number of blocks; else ``(name, None, 1)``."""
        for split in cls.param_splits:
            fused, index = split.fused_name(name)
            if index is not None:
                return fused, index, len(split.pieces)
        return name, None, 1

    def head_counts(self, part: str) -> dict[str, int]:
        """Sizes a model-parallel degree must divide, by name (``num_heads``, ...): the
        LLM's heads, KV heads and MLP width here (not the vocabulary: its shards may be
        uneven, ``ray_disagg.parallel.tensor_parallel.vocab_rows``); a family adds its
        towers'."""
        if part != self.llm_part:
            return {}
        t = self.config.text_config
        return {
            "num_attention_heads": t.num_attention_heads,
            "num_key_value_heads": t.num_key_value_heads,
            "intermediate_size": t.intermediate_size,
        }

    per_head_norms: ClassVar[tuple[str, ...]] = ()
    """Decoder-layer modules applied per attention head (their TP gradients are partial)."""

    def llm_tp_plan(self) -> dict[str, str] | LayerTPPlan:
        """Decoder-layer-relative module name -> ``"colwise"``/``"rowwise"``, or a
        :class:`~ray_disagg.parallel.tensor_parallel.LayerTPPlan` for layers that need
        more (split fused modules, dim-0 shards read locally, divided sizes)."""
        raise NotImplementedError

    def tower_tp_plan(self, part: str) -> BlockTPPlan | None:
        """TP plan of an encoder part's tower blocks (the uniform-TP baseline), or ``None``."""
        return None
