"""Tier 1 conformance, run over every registered model adapter: the parts together are
exactly the family's Hugging Face model (loss, every gradient, every key), samples are
validated, and pretrained weights load from a local directory."""

import numpy as np
import pytest
import torch
from safetensors import safe_open

from ray_disagg import ADAPTERS, HFModelSpec, SampleError
from ray_disagg.data.examples import synthetic_samples
from ray_disagg.models.loss import lm_loss
from ray_disagg.models.moe import router_aux_loss

VISION = [
    {"images": [(1, 4, 4), (1, 8, 4)]},  # several images of different aspect ratios
    None,  # text-only
    {"videos": [(2, 4, 8)], "images": [(1, 4, 8)]},
    (1, 8, 8),
]
AUDIO = [
    {"images": [(1, 4, 4)], "audios": [40]},
    {"audios": [24, 17]},
    None,
    {"videos": [(2, 4, 4)], "audios": [30]},
]


def family_grids(adapter) -> list:
    return VISION + (AUDIO if "audio" in adapter.parts else [])


def split_loss_and_grads(spec, samples):
    adapter = spec.adapter
    parts = {p: spec.build_part(p) for p in adapter.parts}
    cpu = torch.device("cpu")
    outs = {p: adapter.encode(parts[p], p, samples, cpu) for p in adapter.encoder_parts}
    leaves = {k: v.detach().requires_grad_() for o in outs.values() for k, v in o.items()}
    batch = adapter.collate_llm(samples)
    llm = parts[adapter.llm_part]
    hidden, router_logits = adapter.llm_outputs(llm, batch, leaves)
    n = float((batch["labels"][:, 1:] != -100).sum())
    loss = lm_loss(hidden, adapter.llm_modules(llm)[1], batch["labels"], n)
    if router_logits is not None:  # MoE: HF's loss adds the router's auxiliary loss
        loss = loss + router_aux_loss(router_logits, adapter.router, batch["attention_mask"])
    loss.backward()
    for o in outs.values():  # what each encoder group does with the received gradients
        torch.autograd.backward([o[k] for k in o], [leaves[k].grad for k in o])
    grads, keys = {}, []
    for module in parts.values():
        keys += list(module.state_dict())
        grads.update({k: p.grad for k, p in module.named_parameters()})
    return loss, grads, keys, outs


@pytest.mark.parametrize("model_type", sorted(ADAPTERS))
def test_parts_reproduce_the_hf_model(model_type):
    cfg = ADAPTERS[model_type].tiny_config()
    spec = HFModelSpec(config=cfg, seed=1)
    adapter = spec.adapter
    samples = synthetic_samples(cfg, 8, grids=family_grids(adapter))
    for i, s in enumerate(samples):
        adapter.validate_sample(s, i)
    loss, grads, keys, outs = split_loss_and_grads(spec, samples)

    full = spec.build_full()
    ref = full(**adapter.reference_inputs(samples)).loss
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=0)
    assert sorted(keys) == sorted(full.state_dict())  # parts hold HF keys, each exactly once
    for name, p in full.named_parameters():
        if p.grad is None:  # a parameter the forward never uses (e.g. Omni's audio bos/eos)
            assert grads[name] is None or not grads[name].any(), name
            continue
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
    names = [c.name for p in adapter.encoder_parts for c in adapter.crossings(p)]
    assert len(names) == len(set(names))  # crossing names are unique across encoder parts
    for part, out in outs.items():  # every crossing is declared, with its width
        widths = {c.name: c.width for c in adapter.crossings(part)}
        for name, t in out.items():
            assert t.shape[1] == widths[name], name
            assert t.shape[0] == sum(adapter.crossing_rows(part, s)[name] for s in samples)


@pytest.mark.parametrize("model_type", sorted(ADAPTERS))
def test_bad_samples_name_the_sample(model_type):
    cfg = ADAPTERS[model_type].tiny_config()
    adapter = HFModelSpec(config=cfg).adapter
    good = synthetic_samples(cfg, 1, grids=[{"images": [(1, 4, 4)]}])[0]
    keep = np.ones(len(good["input_ids"]), bool)
    keep[np.flatnonzero(good["input_ids"] == cfg.image_token_id)[:2]] = False  # drop 2
    missing = dict(good, id="short", input_ids=good["input_ids"][keep])
    missing["labels"] = good["labels"][keep]
    with pytest.raises(SampleError, match="'short'.*image tokens"):
        adapter.validate_sample(missing)
    wrong_dim = dict(good, id="dim", pixel_values=np.zeros((16, 5), np.float32))
    with pytest.raises(SampleError, match="'dim'.*pixel_values"):
        adapter.validate_sample(wrong_dim)
    if not hasattr(cfg, "vision_start_token_id"):  # 1-D rope: runs need no separators
        return
    two = synthetic_samples(cfg, 1, grids=[{"images": [(1, 4, 4), (1, 4, 4)]}])[0]
    ids = two["input_ids"]
    join = (ids != cfg.vision_end_token_id) & (ids != cfg.vision_start_token_id)
    glued = dict(two, id="glued", input_ids=ids[join], labels=two["labels"][join])
    with pytest.raises(SampleError, match="'glued'.*image tokens form 1 run.*need 2"):
        adapter.validate_sample(glued)


def test_unsupported_model_type_lists_the_supported_ones():
    from transformers import LlamaConfig

    with pytest.raises(ValueError, match=r"'llama' is not supported; supported model types: \["):
        HFModelSpec(config=LlamaConfig())


def _hub_layout(path) -> None:
    """Rewrite a Qwen3-VL-MoE save in the Hub's layout: experts ``(E, H, 2I)`` / ``(E, I, H)``."""
    from safetensors.torch import load_file, save_file

    for f in path.glob("*.safetensors"):
        state = load_file(f)
        for k in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            state[k] = state[k].transpose(1, 2).contiguous()
        save_file(state, f, metadata={"format": "pt"})


# gemma3: tied embeddings (the save has no lm_head.weight); llava_onevision: a bare
# parameter (image_newline) in the vision part;
# qwen3_5_moe: save_pretrained writes the Hub's per-expert tensors (merged when loading);
# qwen3_vl_moe: the Hub's transposed experts (transposed back when loading)
@pytest.mark.parametrize(
    "model_type",
    ["qwen2_5_vl", "qwen3_vl", "qwen3_5_moe", "qwen3_vl_moe", "gemma3", "llava_onevision"],
)
def test_parts_load_a_local_save_pretrained_directory(tmp_path, model_type):
    cfg = ADAPTERS[model_type].tiny_config()
    original = HFModelSpec(config=cfg, seed=5).build_full()
    original.save_pretrained(tmp_path)
    if model_type == "qwen3_vl_moe":
        _hub_layout(tmp_path)
    names = [k for f in tmp_path.glob("*.safetensors") for k in safe_open(f, "pt").keys()]  # noqa: SIM118
    if model_type == "qwen3_5_moe":
        assert any(".experts.0.gate_proj.weight" in k for k in names), names[:5]
    if model_type in ("qwen3_5_moe", "qwen3_vl_moe"):  # an expert shard reads its experts only
        from ray_disagg.models.loading import SafetensorsSource

        source = SafetensorsSource(
            str(tmp_path), HFModelSpec(pretrained_path=tmp_path).meta_model()
        )
        key = "model.language_model.layers.0.mlp.experts.gate_up_proj"
        region = (slice(2, 4), slice(8, 40), slice(None))
        torch.testing.assert_close(source.read(key, region), original.state_dict()[key][region])
    spec = HFModelSpec(pretrained_path=tmp_path)
    loaded = {}
    for part in spec.adapter.parts:
        loaded.update(spec.build_part(part).state_dict())
    expected = original.state_dict()
    assert set(loaded) == set(expected)
    for key, value in expected.items():
        torch.testing.assert_close(loaded[key], value, rtol=0, atol=0, msg=key)


def test_llava_onevision_refuses_a_feature_strategy_that_breaks_its_grid():
    from ray_disagg import tiny_llava_onevision_config
    from ray_disagg.models.llava_onevision import LlavaOnevisionAdapter

    config = tiny_llava_onevision_config()
    config.vision_feature_select_strategy = "default"
    with pytest.raises(ValueError, match="vision_feature_select_strategy='default'"):
        LlavaOnevisionAdapter(config)


def test_gemma3_refuses_image_runs_that_would_merge_into_one_block():
    """Two images' token runs without ``eoi``/``boi`` between them would be one
    bidirectional block to HF: refused, naming the sample."""
    import numpy as np

    from ray_disagg import ADAPTERS
    from ray_disagg.data.examples import synthetic_samples
    from ray_disagg.models.base import SampleError

    cfg = ADAPTERS["gemma3"].tiny_config()
    adapter = ADAPTERS["gemma3"](cfg)
    sample = synthetic_samples(cfg, 1, grids=[{"images": [(1, 4, 4), (1, 8, 4)]}])[0]
    adapter.validate_sample(sample)
    ids = np.asarray(sample["input_ids"])
    keep = ~np.isin(ids, [cfg.boi_token_id, cfg.eoi_token_id])  # runs now adjacent
    merged = {**sample, "input_ids": ids[keep], "labels": np.asarray(sample["labels"])[keep]}
    with pytest.raises(SampleError, match=r"sample 0: image-token runs of \[12\] tokens"):
        adapter.validate_sample(merged)
