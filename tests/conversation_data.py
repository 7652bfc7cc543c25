"""Shared data of the conversation tests: a local model directory (a tokenizer trained
here with Qwen2-VL's chat template, the family's PIL image processor), real PNG/JPEG files
and records in both formats."""

import numpy as np
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from ray_disagg.data.conversations import ConversationProcessor

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


def build_model_dir(path):
    """A local model directory: a trained-here tokenizer with the family's template."""
    vocab = {w: i for i, w in enumerate(WORDS)} | SPECIAL
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    fast.add_special_tokens({"additional_special_tokens": list(SPECIAL)})
    fast.chat_template = QWEN2_VL_TEMPLATE
    fast.save_pretrained(path)
    Qwen2VLImageProcessorPil(
        patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=16 * 16, max_pixels=32 * 32
    ).save_pretrained(path)
    return path


def build_media(root):
    """Real image files: a.png (16x16) and b.jpg (48x40)."""
    rng = np.random.default_rng(0)
    for name, (w, h) in {"a.png": (16, 16), "b.jpg": (48, 40)}.items():
        Image.fromarray((rng.random((h, w, 3)) * 255).astype(np.uint8)).save(root / name)
    return root


RECORDS = [
    {
        "id": "llava",
        "images": ["a.png", "b.jpg"],
        "conversations": [
            {"from": "human", "value": "<image>\nwhich digit is this?"},
            {"from": "gpt", "value": "seven."},
            {"from": "human", "value": "and now? <image>"},
            {"from": "gpt", "value": "two."},
        ],
    },
    {
        "id": "messages",
        "messages": [
            {"role": "system", "content": "be brief."},
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": "b.jpg"},
                    {"type": "text", "text": "and now?"},
                ],
            },
            {"role": "assistant", "content": [{"type": "text", "text": "two."}]},
        ],
    },
    {
        "id": "text",
        "messages": [
            {"role": "user", "content": "which digit is this?"},
            {"role": "assistant", "content": "seven."},
        ],
    },
]


def make_processor(model_dir, media, cfg, **kw):
    return ConversationProcessor(
        tokenizer=AutoTokenizer.from_pretrained(model_dir, local_files_only=True),
        image_processor=Qwen2VLImageProcessorPil.from_pretrained(model_dir, local_files_only=True),
        config=cfg,
        media_root=media,
        **kw,
    )
