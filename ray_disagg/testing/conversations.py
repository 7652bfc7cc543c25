"""Local model directories for conversation data (tests and benchmarks): a WordLevel
tokenizer built here with the family's own chat template and the family's PIL image
processor (Qwen: patch 4, temporal patch 2, merge 2), matching the tiny configs' token
ids."""

from __future__ import annotations

import os

from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from ray_disagg.models.qwen_common.processing import CHAT_TEMPLATE

__all__ = [
    "OMNI_SPECIAL",
    "QWEN2_5_OMNI_TEMPLATE",
    "QWEN2_VL_TEMPLATE",
    "SPACES",
    "SPECIAL",
    "WORDS",
    "build_model_dir",
    "build_omni_model_dir",
    "build_tile_model_dir",
]

QWEN2_VL_TEMPLATE = CHAT_TEMPLATE  # Qwen2-VL's (as its chat_template.json ships it)
# Qwen2.5-Omni's: its own vision and audio markers, and an audio branch.
QWEN2_5_OMNI_TEMPLATE = (
    QWEN2_VL_TEMPLATE.replace("<|vision_start|>", "<|vision_bos|>")
    .replace("<|vision_end|>", "<|vision_eos|>")
    .replace("<|image_pad|>", "<|IMAGE|>")
    .replace("<|video_pad|>", "<|VIDEO|>")
    .replace(
        "{% elif content['type'] == 'video'",
        "{% elif content['type'] == 'audio' or 'audio' in content or 'audio_url' in content %}"
        "<|audio_bos|><|AUDIO|><|audio_eos|>{% elif content['type'] == 'video'",
    )
)
WORDS = ["[UNK]", "system", "user", "assistant", "You", "are", "a", "helpful", "assistant."]
WORDS += ["which", "digit", "is", "this?", "seven.", "and", "now?", "two.", "be", "brief."]
WORDS += ["model"]
SPACES = [" ", "\n"]  # the verbatim tokenizers' whitespace tokens
SPECIAL = {
    "<|image_pad|>": 100,
    "<|video_pad|>": 101,
    "<|vision_start|>": 102,
    "<|vision_end|>": 103,
    "<|im_start|>": 104,
    "<|im_end|>": 105,
}
OMNI_SPECIAL = {  # the tiny Omni thinker config's ids
    "<|IMAGE|>": 100,
    "<|VIDEO|>": 101,
    "<|vision_bos|>": 102,
    "<|vision_eos|>": 103,
    "<|AUDIO|>": 104,
    "<|audio_bos|>": 105,
    "<|audio_eos|>": 106,
    "<|im_start|>": 107,
    "<|im_end|>": 108,
}


def _tokenizer(
    path, special: dict, template: str, named: dict | None = None, verbatim: bool = False
) -> None:
    """``named``: special tokens the family's processor reads as tokenizer attributes
    (e.g. Gemma 3's ``boi_token``). ``verbatim``: every space and newline is a token of
    its own (ids after :data:`WORDS`), as in the families' byte-level tokenizers, so
    changed whitespace changes the ids; otherwise whitespace only separates words."""
    words = WORDS + SPACES if verbatim else WORDS
    vocab = {w: i for i, w in enumerate(words)} | special
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    if verbatim:
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\s"), behavior="isolated")
    else:
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", extra_special_tokens=named or {}
    )
    fast.add_special_tokens({"additional_special_tokens": list(special)})
    fast.chat_template = template
    fast.save_pretrained(path)


def build_omni_model_dir(path, num_mel_bins: int = 8, verbatim: bool = False):
    """:func:`build_model_dir` for the tiny Qwen2.5-Omni thinker: its template and ids,
    the image processor and, in ``audio/``, a ``WhisperFeatureExtractor`` with
    ``num_mel_bins`` bins."""
    from transformers import WhisperFeatureExtractor

    _tokenizer(path, OMNI_SPECIAL, QWEN2_5_OMNI_TEMPLATE, verbatim=verbatim)
    Qwen2VLImageProcessorPil(
        patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=16 * 16, max_pixels=32 * 32
    ).save_pretrained(path)
    # its own directory: it would share preprocessor_config.json with the image processor
    WhisperFeatureExtractor(feature_size=num_mel_bins).save_pretrained(os.path.join(path, "audio"))
    return path


def build_model_dir(path, max_pixels: int = 32 * 32, verbatim: bool = False):
    """A local model directory: a trained-here tokenizer with the family's template
    (``verbatim``: whitespace tokens too, see :func:`_tokenizer`)."""
    _tokenizer(path, SPECIAL, QWEN2_VL_TEMPLATE, verbatim=verbatim)
    Qwen2VLImageProcessorPil(
        patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=16 * 16, max_pixels=max_pixels
    ).save_pretrained(path)
    return path


# The families' own chat templates, as their transformers conversion scripts write them.
INTERNVL_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n'}}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}"
    "{{ '<IMG_CONTEXT>\\n' }}{% elif content['type'] == 'video' %}{{ '<video>\\n' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}"
    "{% endif %}{{'<|im_end|>\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{'<|im_start|>assistant\\n' }}{% endif %}"
)
LLAVA_ONEVISION_TEMPLATE = (  # images, then videos, then the texts
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n'}}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'video') %}"
    "{{ '<video>\\n' }}{% endfor %}{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] }}{% endfor %}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] }}{% endgeneration %}{% endfor %}{% endif %}"
    "{{'<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
GEMMA3_TEMPLATE = (  # the system prompt joins the first user turn; each text part trimmed
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}{%- else -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}"
    "{%- endif -%}{%- set loop_messages = messages[1:] -%}{%- else -%}"
    '{%- set first_user_prefix = "" -%}{%- set loop_messages = messages -%}{%- endif -%}'
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    '{{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}'
    "{%- endif -%}{%- if (message['role'] == 'assistant') -%}{%- set role = \"model\" -%}"
    "{%- else -%}{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- elif message['content'] is iterable -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}{%- endfor -%}"
    '{%- else -%}{{ raise_exception("Invalid content type") }}{%- endif -%}'
    "{{ '<end_of_turn>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{'<start_of_turn>model\\n'}}{%- endif -%}"
)


# per LLaVA-shaped family: its special tokens (the tiny config's ids), chat template,
# the special tokens its processor reads by name, and its PIL image processor's settings
TILE_FAMILIES = {
    "gemma3": (
        {"<image_soft_token>": 100, "<start_of_image>": 101, "<end_of_image>": 102}
        | {"<start_of_turn>": 103, "<end_of_turn>": 104, "<bos>": 105},
        GEMMA3_TEMPLATE,
        {
            "bos_token": "<bos>",
            "image_token": "<image_soft_token>",
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
        },
        ("gemma3", {}),
    ),
    "internvl": (
        {"<IMG_CONTEXT>": 100, "<img>": 101, "</img>": 102, "<video>": 103}
        | {"<|im_start|>": 104, "<|im_end|>": 105},
        INTERNVL_TEMPLATE,
        {"start_image_token": "<img>", "end_image_token": "</img>"}
        | {"context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"},
        ("got_ocr2", {"crop_to_patches": True, "max_patches": 4}),
    ),
    "llava_onevision": (
        {"<image>": 100, "<video>": 101, "<|im_start|>": 104, "<|im_end|>": 105},
        LLAVA_ONEVISION_TEMPLATE,
        {},
        ("llava_onevision", {"image_grid_pinpoints": [[16, 16], [16, 32], [32, 16], [32, 32]]}),
    ),
}


def build_tile_model_dir(path, model_type: str, verbatim: bool = False):
    """A local model directory for the tiny Gemma 3 / InternVL / LLaVA-OneVision: a
    trained-here tokenizer with the family's chat template and the family's PIL image
    processor on 16x16 tiles (``verbatim``: see :func:`_tokenizer`)."""
    import importlib

    special, template, named, (module, settings) = TILE_FAMILIES[model_type]
    _tokenizer(path, special, template, named, verbatim)
    mod = importlib.import_module(f"transformers.models.{module}.image_processing_pil_{module}")
    name = {"gemma3": "Gemma3", "got_ocr2": "GotOcr2", "llava_onevision": "LlavaOnevision"}
    cls = getattr(mod, f"{name[module]}ImageProcessorPil")
    cls(size={"height": 16, "width": 16}, **settings).save_pretrained(path)
    return path
