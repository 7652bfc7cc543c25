"""Tier 1: the vision and text parts together are exactly the Hugging Face model."""

import torch

from ray_disagg import Qwen2_5_VLSpec, tiny_qwen2_5_vl_config
from ray_disagg._internal.reference import reference_batch
from ray_disagg.data import collate_vision, count_label_tokens, text_item
from ray_disagg.examples_data import synthetic_samples
from ray_disagg.model import hf_key, hf_state_dict


def _split_loss(spec, samples):
    vision, text = spec.build_vision(), spec.build_text()
    pixels, grid = collate_vision(samples)
    emb = vision(pixels, grid)
    emb_leaf = emb.detach().requires_grad_()
    batch = reference_batch(samples, spec.load_config())
    n = sum(count_label_tokens(text_item(s, 100)["labels"]) for s in samples)
    loss = text(batch["input_ids"], batch["attention_mask"], batch["labels"], emb_leaf, grid, n)
    loss.backward()
    emb.backward(emb_leaf.grad)  # what the vision group does with the received gradient
    grads = {}
    for part in (vision, text):
        for name, p in part.named_parameters():
            grads[hf_key(part, name)] = p.grad
    return loss, grads


def test_parts_reproduce_hf_loss_and_gradients():
    cfg = tiny_qwen2_5_vl_config()
    spec = Qwen2_5_VLSpec(config=cfg, seed=1)
    samples = synthetic_samples(cfg, 4, grids=[(1, 4, 4), None, (1, 8, 8), (1, 4, 8)])
    loss, grads = _split_loss(spec, samples)

    full = spec.build_full()
    ref = full(**reference_batch(samples, cfg)).loss
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=0)
    for name, p in full.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_parts_load_a_local_save_pretrained_directory(tmp_path):
    cfg = tiny_qwen2_5_vl_config()
    original = Qwen2_5_VLSpec(config=cfg, seed=5).build_full()
    original.save_pretrained(tmp_path)
    spec = Qwen2_5_VLSpec(pretrained_path=tmp_path)
    loaded = {**hf_state_dict(spec.build_vision()), **hf_state_dict(spec.build_text())}
    expected = original.state_dict()
    assert set(loaded) == set(expected)
    for key, value in expected.items():
        torch.testing.assert_close(loaded[key], value, rtol=0, atol=0, msg=key)
