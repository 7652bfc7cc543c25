"""A local model directory for conversation data (tests and benchmarks): a WordLevel
tokenizer trained here with Qwen2-VL's chat template and the family's PIL image processor
(patch 4, temporal patch 2, merge 2), matching the tiny Qwen configs' token ids."""

from __future__ import annotations

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

__all__ = ["QWEN2_VL_TEMPLATE", "SPECIAL", "WORDS", "build_model_dir"]

# Qwen2-VL's chat template (as its tokenizer_config / chat_template.json ship it).
QWEN2_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture "
    "{{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video "
    "{{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = ["[UNK]", "system", "user", "assistant", "You", "are", "a", "helpful", "assistant."]
WORDS += ["which", "digit", "is", "this?", "seven.", "and", "now?", "two.", "be", "brief."]
SPECIAL = {
    "<|image_pad|>": 100,
    "<|video_pad|>": 101,
    "<|vision_start|>": 102,
    "<|vision_end|>": 103,
    "<|im_start|>": 104,
    "<|im_end|>": 105,
}


def build_model_dir(path, max_pixels: int = 32 * 32):
    """A local model directory: a trained-here tokenizer with the family's template."""
    vocab = {w: i for i, w in enumerate(WORDS)} | SPECIAL
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    fast.add_special_tokens({"additional_special_tokens": list(SPECIAL)})
    fast.chat_template = QWEN2_VL_TEMPLATE
    fast.save_pretrained(path)
    Qwen2VLImageProcessorPil(
        patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=16 * 16, max_pixels=max_pixels
    ).save_pretrained(path)
    return path
