"""Sequence packing of the LLM part, for every registered adapter (single process, no Ray):
a packed batch gives the padded batch's loss, hidden states, mrope positions and every
gradient (parameters and crossings); samples never attend to each other (Gemma 3: its
bidirectional image blocks stay inside their sample and its sliding window)."""

import numpy as np
import pytest
import torch

from ray_disagg import ADAPTERS, HFModelSpec
from ray_disagg.data.examples import synthetic_samples
from ray_disagg.models.base import IGNORE_INDEX
from ray_disagg.models.loss import lm_loss
from ray_disagg.models.packing import PACKED_KEY, pack_rows

VISION = [
    {"images": [(1, 16, 16)]},  # long: 64 image tokens
    None,  # text-only, short
    {"videos": [(2, 8, 8)], "images": [(1, 4, 8)]},
    {"images": [(1, 4, 4), (1, 8, 4)]},
    (1, 4, 4),
    None,  # text-only, made long below
]
AUDIO = [{"images": [(1, 4, 4)], "audios": [40]}, {"audios": [24, 17]}]


def samples_of(adapter, cfg) -> list[dict]:
    """~6-8 samples of very different lengths: images, videos, text-only (and audio)."""
    grids = VISION + (AUDIO if "audio" in adapter.parts else [])
    samples = synthetic_samples(cfg, len(grids), grids=grids, seed=3)
    long_text = samples[5]
    extra = np.random.default_rng(0).integers(1, 100, 40)
    long_text["input_ids"] = np.concatenate([long_text["input_ids"], extra])
    long_text["labels"] = np.concatenate([long_text["labels"], extra])
    for i, s in enumerate(samples):
        adapter.validate_sample(s, i)
    return samples


def run(adapter, llm, batch, crossings, n_labels):
    """Loss, hidden states, parameter and crossing gradients, and the position ids HF's
    text model got."""
    llm.zero_grad(set_to_none=True)
    leaves = {k: v.clone().requires_grad_() for k, v in crossings.items()}
    seen = {}
    hook = llm.model.language_model.register_forward_pre_hook(
        lambda _m, _a, kw: seen.update(pos=kw["position_ids"]), with_kwargs=True
    )
    try:
        hidden = adapter.llm_hidden(llm, batch, leaves)
    finally:
        hook.remove()
    loss = lm_loss(hidden, adapter.llm_modules(llm)[1], batch["labels"], n_labels)
    loss.backward()
    grads = {k: p.grad.clone() for k, p in llm.named_parameters() if p.grad is not None}
    return loss, hidden.detach(), grads, {k: v.grad for k, v in leaves.items()}, seen["pos"]


def assert_close(actual, expected, name, floor: float = 0.0):
    """Equal within 1e-5 relative to the tensor's largest entry (or to ``floor``, when
    larger: a tensor of tiny gradients is compared at the model's gradient scale)."""
    scale = max(float(expected.abs().max()), floor) or 1.0
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * scale, msg=name)


PACKABLE = sorted(m for m, a in ADAPTERS.items() if a.packing_refusal is None)


@pytest.mark.parametrize("model_type", PACKABLE)
def test_packed_batch_equals_padded_batch(model_type):
    cfg = ADAPTERS[model_type].tiny_config()
    spec = HFModelSpec(config=cfg, seed=1)
    adapter = spec.adapter
    samples = samples_of(adapter, cfg)
    lengths = [len(s["input_ids"]) for s in samples]
    assert max(lengths) > 4 * min(lengths)
    llm = spec.build_part(adapter.llm_part)
    adapter.prepare_packing(adapter.llm_modules(llm)[0])  # as the worker's plans do
    gen = torch.Generator().manual_seed(0)
    crossings = {}
    for part in adapter.encoder_parts:
        for c in adapter.crossings(part):
            rows = sum(adapter.crossing_rows(part, s)[c.name] for s in samples)
            if rows:
                crossings[c.name] = torch.randn(rows, c.width, generator=gen)
    names = {c.name for part in adapter.encoder_parts for c in adapter.crossings(part)}
    assert {"image_embeds", "video_embeds"} & names <= set(crossings)  # InternVL: frames are tiles

    padded = adapter.collate_llm(samples)
    n_labels = float((padded["labels"][:, 1:] != IGNORE_INDEX).sum())
    ref_loss, ref_hidden, ref_grads, ref_cross, ref_pos = run(
        adapter, llm, padded, crossings, n_labels
    )
    mrope = ref_pos is not None  # Qwen: HF's get_rope_index over the padded batch
    assert not mrope or ref_pos.shape[0] == 3

    for max_seq_len in (max(lengths), sum(lengths) + 3):
        packed = adapter.collate_llm_packed(samples, max_seq_len)
        assert "attention_mask" not in packed
        n_rows, width = packed["input_ids"].shape
        assert n_rows < len(samples) and width <= max_seq_len
        assert n_rows == len(pack_rows(lengths, max_seq_len))
        loss, hidden, grads, cross, pos = run(adapter, llm, packed, crossings, n_labels)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
        assert pos.shape == ((4, n_rows, width) if mrope else (n_rows, width))
        pos = pos if mrope else pos[None]  # row 0: the text positions
        segments = packed[PACKED_KEY]
        assert [s[2] for s in segments] == lengths  # item order
        for i, (row, start, n, _) in enumerate(segments):
            span = slice(start, start + n)
            assert torch.equal(packed["input_ids"][row, span], padded["input_ids"][i, :n])
            assert packed["labels"][row, start] == IGNORE_INDEX
            assert torch.equal(
                packed["labels"][row, start + 1 : start + n], padded["labels"][i, 1:n]
            )
            assert torch.equal(pos[0, row, span], torch.arange(n))  # restarts: the mask
            if mrope:
                assert torch.equal(pos[1:, row, span], ref_pos[:, i, :n]), f"mrope of {i}"
            assert_close(hidden[row, span], ref_hidden[i, :n], f"hidden of sample {i}")
        ends = {}
        for row, start, n, _ in segments:
            ends[row] = start + n
        for row, end in ends.items():  # padding: no loss
            assert (packed["labels"][row, end:] == IGNORE_INDEX).all()
        assert set(grads) == set(ref_grads)
        # at least 1% of the largest gradient: Qwen3.5's A_log and dt_bias get ~1e-5
        # gradients whose fp32 rounding (the attention layers' packed rows) is ~4e-9
        # (in float64 they are equal)
        floor = 1e-2 * max(float(g.abs().max()) for g in ref_grads.values())
        for name, g in ref_grads.items():
            assert_close(grads[name], g, name, floor)
        for name, g in ref_cross.items():
            assert g.abs().sum() > 0, name
            assert_close(cross[name], g, name)


@pytest.mark.parametrize("model_type", sorted(ADAPTERS))
def test_too_long_sample_is_named(model_type):
    cfg = ADAPTERS[model_type].tiny_config()
    adapter = HFModelSpec(config=cfg).adapter
    samples = synthetic_samples(cfg, 3, grids=[None, (1, 8, 8), None])
    samples[1]["id"] = "big-image"
    n = len(samples[1]["input_ids"])
    with pytest.raises(ValueError, match=rf"'big-image' has {n} tokens.*max_seq_len={n - 1}"):
        adapter.collate_llm_packed(samples, n - 1)
    assert adapter.collate_llm_packed(samples, n)["input_ids"].shape[1] <= n


def test_pack_rows_is_next_fit_in_order():
    assert pack_rows([3, 4, 2, 5, 1], 7) == [[0, 1], [2, 3], [4]]
    assert pack_rows([2, 9, 2], 9) == [[0], [1], [2]]  # exact fit, no reordering
    assert pack_rows([1, 1, 1], 3) == [[0, 1, 2]]
    assert pack_rows([5, 1, 5], 6) == [[0, 1], [2]]
    assert pack_rows([], 4) == []
    with pytest.raises(ValueError, match=r"item 1 has 8 tokens.*max_seq_len=7"):
        pack_rows([3, 8], 7)


def test_linear_attention_buckets_stay_within_the_packed_batch():
    """Qwen3.5's per-sample runs of a packed batch never hold more positions than it."""
    from ray_disagg.models.qwen3_5.packing import buckets

    lengths = [8000] + [80] * 100 + [3000, 2900]
    groups = buckets(lengths, 2 * 8192)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(len(g) * max(lengths[i] for i in g) <= 2 * 8192 for g in groups)
    assert groups[:2] == [[0, 101], [102, 1, 2, 3, 4]]  # longest first: 2 x 8000, 5 x 2900
    assert len(groups) == 3  # not one batch of 103 x 8000 positions
