"""Shared data of the conversation tests: a local model directory (a tokenizer trained
here with Qwen2-VL's chat template, the family's PIL image processor), real PNG/JPEG files
and records in both formats."""

import numpy as np
from PIL import Image
from transformers import AutoTokenizer
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from ray_disagg.data.conversations import ConversationProcessor
from ray_disagg.testing.conversations import SPECIAL, WORDS, build_model_dir  # noqa: F401


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


def qwen_oracle(proc, messages, paths, media, add_generation_prompt=False) -> list[int]:
    """The token ids of ``messages`` as the oracle sees them: the template tokenized by
    ``apply_chat_template`` itself, each single image pad id then repeated by hand for its
    image's merged patch count (independent of the processor's expansion)."""
    ids = proc.tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=False, add_generation_prompt=add_generation_prompt
    )
    counts = []
    for p in paths:
        with Image.open(media / p) as im:
            grid = proc.image_processor(images=[im.convert("RGB")], return_tensors="np")
        counts.append(int(np.prod(grid["image_grid_thw"])) // 4)
    out = []
    for t in ids:
        out += [t] * (counts.pop(0) if t == SPECIAL["<|image_pad|>"] else 1)
    return out


def make_processor(model_dir, media, cfg, **kw):
    return ConversationProcessor(
        tokenizer=AutoTokenizer.from_pretrained(model_dir, local_files_only=True),
        image_processor=Qwen2VLImageProcessorPil.from_pretrained(model_dir, local_files_only=True),
        config=cfg,
        media_root=media,
        **kw,
    )
