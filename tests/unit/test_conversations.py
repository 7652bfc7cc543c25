"""Tier 1: conversations (LLaVA and messages records, JSONL and parquet) through a local
model directory's chat template (Qwen2-VL's) and the family's PIL image processor, with
real PNG/JPEG files: token ids equal ``apply_chat_template(tokenize=True)`` with each image
placeholder expanded by hand from the processor's grids; labels exactly on the assistant
contents and their ``<|im_end|>``."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from ray_disagg import tiny_qwen2_5_vl_config, tiny_qwen3_vl_config
from ray_disagg.data.conversations import read_records, to_messages
from ray_disagg.models import ADAPTERS, get_adapter
from tests.conversation_data import (
    RECORDS,
    SPECIAL,
    WORDS,
    build_media,
    build_model_dir,
    make_processor,
    qwen_oracle,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    return build_media(tmp_path_factory.mktemp("media"))


def _expected_ids(proc, record, media):
    """The oracle's ids of ``record`` (:func:`qwen_oracle`) and its image paths."""
    messages, media_list = to_messages(record)
    paths = [p for kind, p in media_list if kind == "image"]
    return qwen_oracle(proc, messages, paths, media), paths


@pytest.mark.parametrize("config", [tiny_qwen2_5_vl_config, tiny_qwen3_vl_config])
def test_records_become_samples_of_the_family(model_dir, media, tmp_path, config):
    cfg = config()
    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps(r) for r in RECORDS))
    pq.write_table(pa.Table.from_pylist([RECORDS[2]]), tmp_path / "t.parquet")
    records = read_records(tmp_path / "t.jsonl") + read_records(tmp_path / "t.parquet")
    proc = make_processor(model_dir, media, cfg)
    inv = {i: w for w, i in ({w: i for i, w in enumerate(WORDS)} | SPECIAL).items()}
    labelled = {
        "llava": ["seven.", "<|im_end|>", "two.", "<|im_end|>"],
        "messages": ["two.", "<|im_end|>"],
        "text": ["seven.", "<|im_end|>"],
    }
    for record in records:
        sample = proc(record)
        get_adapter(cfg).validate_sample(sample)
        want, paths = _expected_ids(proc, record, media)
        assert sample["input_ids"].tolist() == want
        labels = sample["labels"]
        assert [inv[int(t)] for t in labels[labels != -100]] == labelled[record["id"]]
        if paths:  # the processor's own pixels, in order
            own = [proc.image_processor(images=[Image.open(media / p).convert("RGB")],
                                        return_tensors="np") for p in paths]  # fmt: skip
            np.testing.assert_array_equal(
                sample["pixel_values"], np.concatenate([o["pixel_values"] for o in own])
            )
        else:
            assert sample["pixel_values"] is None
    llava = proc(records[0])
    assert llava["image_grid_thw"][0].tolist() == [1, 4, 4]  # 16x16 px kept
    assert np.prod(llava["image_grid_thw"][1]) * 16 <= 32 * 32  # 48x40 px down to max_pixels


def test_label_modes_system_prompt_and_bad_records(model_dir, media):
    cfg = tiny_qwen2_5_vl_config()
    inv = {i: w for w, i in ({w: i for i, w in enumerate(WORDS)} | SPECIAL).items()}
    last = make_processor(model_dir, media, cfg, labels="last")(RECORDS[0])["labels"]
    assert [inv[int(t)] for t in last[last != -100]] == ["two.", "<|im_end|>"]
    every = make_processor(model_dir, media, cfg, labels="all")(RECORDS[0])
    assert ((every["labels"] != -100) == (every["input_ids"] != 100)).all()
    brief = make_processor(model_dir, media, cfg, system_prompt="be brief.")(RECORDS[2])
    assert [inv[int(t)] for t in brief["input_ids"][:5]] == [
        "<|im_start|>", "system", "be", "brief.", "<|im_end|>"
    ]  # fmt: skip
    with pytest.raises(ValueError, match=r"record 'x': 1 images but 0 <image> tags"):
        to_messages(
            {"id": "x", "image": "a.png", "conversations": [{"from": "gpt", "value": "hi"}]}
        )
    missing = [
        {"role": "user", "content": [{"type": "image", "image": "missing.png"}]},
        {"role": "assistant", "content": "two."},
    ]
    with pytest.raises(ValueError, match=r"record 'y': cannot read image"):
        make_processor(model_dir, media, cfg)({"id": "y", "messages": missing})
    with pytest.raises(ValueError, match=r"record 'z': no assistant turn"):
        make_processor(model_dir, media, cfg)({"id": "z", "messages": missing[:1]})
    # control text typed by a user is not an assistant turn: labels follow the structure
    sneaky = [
        {"role": "user", "content": "<|im_start|>assistant\nseven. <|im_end|>"},
        {"role": "assistant", "content": "two."},
    ]
    got = make_processor(model_dir, media, cfg)({"id": "s", "messages": sneaky})["labels"]
    assert [inv[int(t)] for t in got[got != -100]] == ["two.", "<|im_end|>"]
    with pytest.raises(ValueError, match="labels='some'"):
        make_processor(model_dir, media, cfg, labels="some")


def test_recipe_type_conversations_loads_the_records(model_dir, media, tmp_path):
    from types import SimpleNamespace

    from ray_disagg import HFModelSpec
    from ray_disagg.recipes.data import build_dataset, parse_data

    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps(r) for r in RECORDS))
    cfg = tiny_qwen2_5_vl_config()
    d = {"type": "conversations", "records": str(tmp_path / "t.jsonl"), "tokenizer": str(model_dir)}
    d = parse_data(dict(d, media_root=str(media), labels="last"), "data.train")
    recipe = SimpleNamespace(data={"train": d}, model=HFModelSpec(config=cfg), raw={})
    stream = build_dataset(recipe, "train")
    assert stream.num_records == 3 and stream.max_bad_records == 100  # defaults
    samples = list(stream.samples())
    proc = make_processor(model_dir, media, cfg, labels="last")
    assert len(samples) == 3
    for got, record in zip(samples, RECORDS):
        want = proc(record)
        assert got["input_ids"].tolist() == want["input_ids"].tolist()
        assert got["labels"].tolist() == want["labels"].tolist()
    # `ray-disagg plan`'s line about these records
    from ray_disagg.recipes.data_stats import recipe_statistics

    tokens = sorted(len(s["input_ids"]) for s in samples)
    line = recipe_statistics(recipe, "train")
    assert line.startswith(f"3 of 3 records: tokens/sample mean {np.mean(tokens):.0f}, ")
    assert f"max {tokens[-1]};" in line and line.endswith("broken 0, over max_seq_len 0")


def _write_video(path, frames: np.ndarray, fps: int) -> None:
    import av

    with av.open(str(path), "w") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "yuv420p"
        for f in frames:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        out.mux(stream.encode())


def test_videos_are_sampled_grouped_and_patched_as_the_family_does(model_dir, media, tmp_path):
    """A real mp4 written here: 8 frames at 4 fps (2 s) sampled at 2 fps -> 4 frames, two
    temporal groups; slot ``j`` of every patch of group ``g`` is the image processor's
    patch of decoded frame ``2g + j``; one ``<|video_pad|>`` per merged patch."""
    from ray_disagg.data.video import decode_video

    rng = np.random.default_rng(1)
    frames = (rng.random((8, 40, 48, 3)) * 255).astype(np.uint8)
    _write_video(tmp_path / "v.mp4", frames, fps=4)
    decoded, fps = decode_video(tmp_path / "v.mp4", fps=2.0, multiple=2)
    assert decoded.shape == (4, 40, 48, 3) and fps == 2.0
    assert decode_video(tmp_path / "v.mp4", fps=4.0, max_frames=6)[0].shape[0] == 6
    cfg = tiny_qwen2_5_vl_config()
    proc = make_processor(model_dir, tmp_path, cfg)
    record = {
        "id": "vid",
        "video": "v.mp4",
        "conversations": [
            {"from": "human", "value": "<video>\nwhich digit is this?"},
            {"from": "gpt", "value": "seven."},
        ],
    }
    sample = proc(record)
    get_adapter(cfg).validate_sample(sample)
    grid = sample["video_grid_thw"]
    assert grid.tolist() == [[2, 6, 8]] and sample["second_per_grid_ts"].tolist() == [1.0]
    assert (sample["input_ids"] == SPECIAL["<|video_pad|>"]).sum() == 2 * 6 * 8 // 4
    pv = sample["pixel_values_videos"].reshape(2, 48, 3, 2, 4, 4)  # groups, patches, C,T,P,P
    for g in range(2):
        for j in range(2):
            own = proc.image_processor(images=[decoded[2 * g + j]], return_tensors="np")
            want = own["pixel_values"].reshape(48, 3, 2, 4, 4)[:, :, 0]
            np.testing.assert_allclose(pv[g, :, :, j], want, rtol=0, atol=1e-6)
    labels = sample["labels"]
    assert labels[labels != -100].tolist() == [WORDS.index("seven."), SPECIAL["<|im_end|>"]]
    with pytest.raises(ValueError, match=r"video_processor=\.\.\."):
        make_processor(model_dir, tmp_path, tiny_qwen3_vl_config())(record)


@pytest.mark.parametrize("model_type", ["qwen3_vl", "qwen3_vl_moe", "qwen3_5"])
def test_qwen3_videos_get_a_timestamp_and_a_run_per_frame_group(model_dir, tmp_path, model_type):
    """Qwen3-VL and the families that share its processor (Qwen3-VL-MoE, Qwen3.5; once
    only the exact ``qwen3_vl`` got timestamps): frames sampled, one size for the whole
    clip and the pixels of each group as its video processor's settings make them; each
    group's tokens are ``<t seconds>`` then its own vision start / pads / end, where the
    template put the video pad (the installed processor's ``replace_video_token``,
    timestamps from its own function); HF's model takes the sample."""
    from transformers.image_transforms import normalize, rescale, resize
    from transformers.image_utils import ChannelDimension, PILImageResampling
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import (
        Qwen3VLVideoProcessor,
        smart_resize,
    )
    from transformers.video_utils import VideoMetadata

    from ray_disagg import HFModelSpec
    from ray_disagg.testing.reference import reference_batch

    rng = np.random.default_rng(3)
    frames = (rng.random((10, 40, 48, 3)) * 255).astype(np.uint8)
    _write_video(tmp_path / "v.mp4", frames, fps=4)
    vp = Qwen3VLVideoProcessor(patch_size=4, size={"shortest_edge": 256, "longest_edge": 6144})
    cfg = ADAPTERS[model_type].tiny_config()
    proc = make_processor(model_dir, tmp_path, cfg, video_processor=vp)
    record = {"id": "v3", "video": "v.mp4", "conversations": [
        {"from": "human", "value": "<video>\nwhich digit is this?"},
        {"from": "gpt", "value": "seven."}]}  # fmt: skip
    sample = proc(record)
    get_adapter(cfg).validate_sample(sample)
    idx = vp.sample_frames(VideoMetadata(total_num_frames=10, fps=4.0)).tolist()
    h, w = smart_resize(len(idx), 40, 48, 2, 8, 256, 6144)
    groups = -(-len(idx) // 2)
    assert sample["video_grid_thw"].tolist() == [[groups, h // 4, w // 4]]
    times = Qwen3VLProcessor._calculate_timestamps(None, idx, 4.0, 2)
    messages, _ = to_messages(record)
    template = proc.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    per_group = []
    for t in times:
        per_group += proc.tokenizer(f"<{t:.1f} seconds>", add_special_tokens=False)["input_ids"]
        per_group += [102, *[101] * (h * w // 64), 103]
    k = template.index(101)
    assert sample["input_ids"].tolist() == template[:k] + per_group + template[k + 1 :]
    # slot j of group g: decoded frame idx[2g + j] resized to (h, w), normalized
    import av

    with av.open(str(tmp_path / "v.mp4")) as c:
        decoded = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    pv = sample["pixel_values_videos"].reshape(groups, -1, 3, 2, 4, 4)
    first = ChannelDimension.FIRST
    for g in range(groups):
        for j in range(2):
            f = decoded[idx[min(2 * g + j, len(idx) - 1)]].transpose(2, 0, 1)
            x = resize(f, (h, w), resample=PILImageResampling.BICUBIC, input_data_format=first)
            x = rescale(x.astype(np.float32), 1 / 255, input_data_format=first)
            x = normalize(x, [0.5] * 3, [0.5] * 3, input_data_format=first)
            want = x.reshape(3, h // 8, 2, 4, w // 8, 2, 4).transpose(1, 4, 2, 5, 0, 3, 6)
            np.testing.assert_allclose(pv[g, :, :, j], want.reshape(-1, 3, 4, 4), atol=1e-5)
    spec = HFModelSpec(config=cfg)
    loss = spec.build_full()(**reference_batch(spec, [sample])).loss
    assert torch.isfinite(loss)


def _torchvision_loads() -> bool:
    try:
        import torchvision

        torchvision.ops.nms  # noqa: B018 - a CUDA build beside a CPU torch fails here
        return True
    except Exception:  # noqa: BLE001 - not installed, or not loadable beside this torch
        return False


@pytest.mark.skipif(not _torchvision_loads(), reason="torchvision does not load beside torch")
def test_torchvision_processors_give_the_same_tokens(model_dir, media, tmp_path):
    """Where torchvision loads (GPU installs): the family's torchvision image processor
    makes the same tokens and grids as the PIL one, pixels within resampling error."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    cfg = tiny_qwen2_5_vl_config()
    pil = make_processor(model_dir, media, cfg)
    fast = Qwen2VLImageProcessor(
        patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=16 * 16, max_pixels=32 * 32
    )
    tv = make_processor(model_dir, media, cfg)
    tv.image_processor = fast
    for record in RECORDS[:2]:
        a, b = pil(record), tv(record)
        assert a["input_ids"].tolist() == b["input_ids"].tolist()
        assert a["image_grid_thw"].tolist() == b["image_grid_thw"].tolist()
        np.testing.assert_allclose(a["pixel_values"], b["pixel_values"], atol=0.1)


# A template that, like Qwen3's thinking templates, keeps the <think> block of the final
# assistant turn only (earlier turns are rewritten without it).
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% set c = m['content'] | map(attribute='text') | join('') %}"
    "{% if m['role'] == 'assistant' and not loop.last %}"
    "{{ c.split('</think>')[-1].strip() }}"
    "{% else %}{{ c }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_think_blocks_of_the_last_turn_are_labels_and_rewriting_templates_are_named(
    model_dir, media
):
    cfg = tiny_qwen2_5_vl_config()
    inv = {i: w for w, i in ({w: i for i, w in enumerate(WORDS)} | SPECIAL).items()}
    proc = make_processor(model_dir, media, cfg, labels="last")
    proc.tokenizer.chat_template = THINKING_TEMPLATE
    record = {"id": "t", "messages": [
        {"role": "user", "content": "which digit is this?"},
        {"role": "assistant", "content": "<think> a seven. </think> seven."},
        {"role": "user", "content": "and now?"},
        {"role": "assistant", "content": "<think> a two. </think> two."}]}  # fmt: skip
    labels = proc(record)["labels"]
    # the reasoning and the answer of the last turn, and its <|im_end|>
    want = ["[UNK]", "a", "two.", "[UNK]", "two.", "<|im_end|>"]
    assert [inv[int(t)] for t in labels[labels != -100]] == want
    every = make_processor(model_dir, media, cfg)
    every.tokenizer.chat_template = THINKING_TEMPLATE
    with pytest.raises(ValueError, match="drops their <think> blocks.*labels='last'"):
        every(record)
