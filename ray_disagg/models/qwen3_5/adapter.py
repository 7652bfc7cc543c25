"""Qwen3.5: natively multimodal; a Qwen3-VL-style tower without DeepStack and a decoder
that interleaves Gated DeltaNet linear-attention layers (``layer_types``) with gated full
attention (partial rotary mrope). The LLM takes tensor parallelism by heads (the linear
layers by key heads: ``parallelize.py``); packed, the linear layers run each sample as
its own row so that no recurrent state crosses samples (``packing.py``). Under LLM
context parallelism the softmax layers run Ulysses on the sequence's slices and the
linear layers the whole sequence split by heads (``context.py``); with text TP too
(``ContextParallel(tp > 1)``) it is refused."""

from __future__ import annotations

from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

from ray_disagg.models.flops import Flops, decoder_flops
from ray_disagg.models.packing import PACKED_KEY
from ray_disagg.models.qwen3_5.context import split_linear_attention_heads
from ray_disagg.models.qwen3_5.costs import gated_deltanet_flops
from ray_disagg.models.qwen3_5.flavors import tiny_qwen3_5_config
from ray_disagg.models.qwen3_5.packing import SEGMENTS, segment_linear_attention
from ray_disagg.models.qwen3_5.parallelize import (
    CONV1D_SPLIT,
    IN_PROJ_QKV_SPLIT,
    PER_HEAD_NORMS,
    TOWER_MLP,
    TOWER_PLAN,
    linear_attention_counts,
    llm_tp_plan,
)
from ray_disagg.models.qwen3_vl.adapter import Qwen3VLAdapter
from ray_disagg.models.qwen_common.adapter import QwenVLAdapter
from ray_disagg.models.qwen_common.parallelize import QKV_SPLIT

__all__ = ["Qwen3_5Adapter"]


class Qwen3_5Adapter(Qwen3VLAdapter):
    """Qwen3-VL's samples (each video frame its own placeholder run), no DeepStack."""

    model_type = "qwen3_5"
    config_class = Qwen3_5Config
    hf_class = Qwen3_5ForConditionalGeneration
    tower_plan = TOWER_PLAN
    tower_mlp = TOWER_MLP
    per_head_norms = PER_HEAD_NORMS
    param_splits = (QKV_SPLIT, IN_PROJ_QKV_SPLIT, CONV1D_SPLIT)
    tiny_config = staticmethod(tiny_qwen3_5_config)
    deepstack_levels = 0
    cp_parts = ("text",)  # Gated DeltaNet: the whole sequence, split by heads (context.py)
    cp_tp_refusal = (
        "under text TP the Gated DeltaNet's weights are DTensor shards of split row blocks, "
        "which its context-parallel head split (qwen3_5/context.py) does not slice"
    )
    encoder_output = QwenVLAdapter.encoder_output

    def prepare_packing(self, decoder):
        """The Gated DeltaNet layers run each packed sample as its own row
        (:func:`~ray_disagg.models.qwen3_5.packing.segment_linear_attention`)."""
        segment_linear_attention(decoder)

    def prepare_context(self, decoder):
        """The Gated DeltaNet layers run the whole sequence with this rank's share of the
        heads (:func:`~ray_disagg.models.qwen3_5.context.split_linear_attention_heads`)."""
        super().prepare_context(decoder)  # DeepStack's slicing: a no-op without its inputs
        split_linear_attention_heads(decoder)

    def packed_llm_kwargs(self, inner, batch):
        """Qwen's packed arguments and the samples' spans for the Gated DeltaNet layers."""
        spans = tuple((row, start, n) for row, start, n, _ in batch[PACKED_KEY])
        return {**super().packed_llm_kwargs(inner, batch), SEGMENTS: spans}

    def llm_tp_plan(self):
        return llm_tp_plan(self.config.text_config)

    def head_counts(self, part):
        counts = super().head_counts(part)
        if part == self.llm_part:
            counts.update(linear_attention_counts(self.config.text_config))
        return counts

    def decoder_flops(self, tokens: int, labels: int) -> Flops:
        """The decoder with its Gated DeltaNet layers (:func:`gated_deltanet_flops`) and
        the full-attention layers' gated queries (``q_proj`` twice as wide)."""
        t = self.config.text_config
        return decoder_flops(
            t, tokens, labels, linear_attention=gated_deltanet_flops, gated_query=True
        )
