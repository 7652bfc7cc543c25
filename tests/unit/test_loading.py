"""Tier 1: a part is built on ``meta`` and materialized alone (per-name random init, or
only its keys from a multi-file safetensors directory); bad weights and settings fail on
the driver with the key, the file and the fix."""

import json

import pytest
import torch
from ray.train import ScalingConfig
from safetensors.torch import load_file, save_file

from ray_disagg import (
    ADAPTERS,
    DataParallel,
    DisaggregatedTrainer,
    HFModelSpec,
    ModuleGroup,
    TensorParallel,
    TrainLoopConfig,
    tiny_qwen2_5_vl_config,
)
from ray_disagg.data.examples import synthetic_samples
from ray_disagg.models import loading

CONFIGS = {
    name: getattr(__import__("ray_disagg.models", fromlist=["x"]), f"tiny_{name}_config")()
    for name in ADAPTERS
}


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_random_init_is_a_function_of_seed_and_name(family):
    spec = HFModelSpec(config=CONFIGS[family], seed=3)
    full = spec.build_full().state_dict()
    for part in spec.adapter.parts:
        alone = spec.build_part(part).state_dict()
        assert alone and all(torch.equal(v, full[k]) for k, v in alone.items()), part
    other = HFModelSpec(config=CONFIGS[family], seed=4).build_part(spec.adapter.llm_part)
    key = next(k for k in other.state_dict() if k.endswith("q_proj.weight"))
    assert not torch.equal(other.state_dict()[key], full[key])
    # every value is HF's own init (finite, right scale), and the rope buffers are exact
    hf = spec.adapter.build_full(0)
    hf_buffers = dict(hf.named_buffers())
    for name, b in spec.build_full().named_buffers():
        assert torch.equal(b, hf_buffers[name]), name


def test_building_a_part_allocates_nothing_of_another_part(monkeypatch):
    spec = HFModelSpec(config=tiny_qwen2_5_vl_config(), seed=0)
    meta = spec.meta_model("vision")
    assert all(t.is_meta for t in meta.state_dict().values())
    assert meta.model.language_model is None and meta.lm_head is None
    owners = []
    real_init = loading.InitSource._init_module
    monkeypatch.setattr(
        loading.InitSource,
        "_init_module",
        lambda self, owner: owners.append(owner) or real_init(self, owner),
    )
    spec.materialize(meta, "cpu", "vision")
    assert owners and all(o.startswith("model.visual") for o in owners)
    tensors = [*meta.parameters(), *meta.buffers()]
    assert not any(t.is_meta for t in tensors)
    own_bytes = sum(t.numel() * t.element_size() for t in tensors)
    full = spec.meta_model()
    tower_bytes = sum(
        t.numel() * t.element_size()
        for n, t in [*full.named_parameters(), *full.named_buffers()]
        if n.startswith("model.visual.")
    )
    assert own_bytes == tower_bytes  # exactly the tower's tensors, nothing of the LLM


def test_multi_file_pretrained_loads_only_the_part_keys_cast_per_tensor(tmp_path):
    spec = HFModelSpec(config=tiny_qwen2_5_vl_config(), seed=2)
    model = spec.build_full()
    model.to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    pre = HFModelSpec(pretrained_path=tmp_path)
    hf = spec.adapter.hf_class.from_pretrained(tmp_path, dtype=torch.float32).state_dict()
    for part in pre.adapter.parts:
        meta = pre.meta_model(part)
        source = pre.weight_source(pre.meta_model(part))
        loading.materialize(meta, "cpu", source, loading.InitSource(meta, 0))
        state = meta.state_dict()
        assert all(v.dtype == torch.float32 for v in state.values())
        assert all(torch.equal(v, hf[k]) for k, v in state.items()), part
        # only the files that hold this part's keys were opened
        wanted = {source.where[k][0] for k in state}
        assert set(source._files) == wanted


def test_bad_pretrained_weights_name_the_key_and_the_file(tmp_path):
    spec = HFModelSpec(config=tiny_qwen2_5_vl_config(), seed=2)
    spec.build_full().save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    dropped = next(k for k in weights if "merger" in k)
    del weights[dropped]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    pre = HFModelSpec(pretrained_path=tmp_path)
    with pytest.raises(ValueError, match=r"model\.safetensors have no tensor for .*merger"):
        pre.check_weights()
    with pytest.raises(ValueError, match="merger"):  # the trainer checks on the driver
        DisaggregatedTrainer(
            model=pre,
            groups={"vision": _group(), "text": _group()},
            train_loop_config={"max_steps": 1, "global_batch_size": 2},
            datasets={"train": synthetic_samples(spec.adapter.config, 4)},
        )
    weights = load_file(tmp_path / "model.safetensors")
    weights[dropped] = torch.zeros(3, dtype=torch.int8)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    weights.clear()
    with pytest.raises(ValueError, match="has dtype I8"):
        HFModelSpec(pretrained_path=tmp_path).build_part("vision")
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        HFModelSpec(pretrained_path=tmp_path).check_weights()


def _group(n=1, parallelism="none"):
    return ModuleGroup(scaling_config=ScalingConfig(num_workers=n), parallelism=parallelism)


def test_sharding_settings_are_checked():
    with pytest.raises(ValueError, match="choose one of them"):
        DataParallel(zero1=True, fsdp=True)
    with pytest.raises(ValueError, match="param_dtype"):
        TrainLoopConfig(max_steps=1, global_batch_size=1, param_dtype="float16")
    with pytest.raises(ValueError, match="LLM group"):
        cfg = tiny_qwen2_5_vl_config()
        DisaggregatedTrainer(
            model=HFModelSpec(config=cfg),
            groups={"vision": _group(2, TensorParallel(size=2, fsdp=True)), "text": _group()},
            train_loop_config={"max_steps": 1, "global_batch_size": 2},
            datasets={"train": synthetic_samples(cfg, 4)},
        )
    assert _group(4, TensorParallel(size=2, fsdp=True)).fsdp


def test_tied_embeddings_stay_tied_in_pure_bf16():
    cfg = tiny_qwen2_5_vl_config()
    cfg.tie_word_embeddings = cfg.text_config.tie_word_embeddings = True
    spec = HFModelSpec(config=cfg)
    meta = spec.meta_model("text")
    assert loading.tied_parameters(meta) == {
        "lm_head.weight": "model.language_model.embed_tokens.weight"
    }
    loading.cast_parameters(meta, torch.bfloat16)
    assert meta.lm_head.weight is meta.model.language_model.embed_tokens.weight
    assert meta.lm_head.weight.dtype == torch.bfloat16
    assert all(b.dtype == torch.float32 for b in meta.buffers())  # rope stays fp32


def test_weights_of_another_shape_fail_on_the_driver(tmp_path):
    spec = HFModelSpec(config=tiny_qwen2_5_vl_config(), seed=2)
    spec.build_full().save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    key = next(k for k in weights if k.endswith("mlp.down_proj.weight"))
    weights[key] = weights[key][:, :-1].contiguous()
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="has shape .* config.json does not match"):
        HFModelSpec(pretrained_path=tmp_path).check_weights()


def test_split_qkv_part_loads_fused_full_tensors_and_adam_state():
    from ray_disagg.models.qwen_common.parallelize import SplitQKV
    from ray_disagg.worker.shards import load_model, load_optimizer

    spec = HFModelSpec(config=tiny_qwen2_5_vl_config(), seed=5)
    full = spec.build_part("vision").state_dict()
    part = spec.build_part("vision", device="cpu")
    with torch.no_grad():
        for p in part.parameters():
            p.zero_()
    for blk in part.model.visual.blocks:
        blk.attn.qkv = SplitQKV(blk.attn.qkv)
    opt = torch.optim.AdamW(part.parameters())
    fields = {f: {k: v + 1 for k, v in full.items()} for f in ("exp_avg", "exp_avg_sq")}
    fields["step"] = {k: torch.tensor([3.0]) for k in full}
    load_model(part, full)
    load_optimizer(opt, part, fields)
    fused = full["model.visual.blocks.0.attn.qkv.weight"]
    q = part.model.visual.blocks[0].attn.qkv.q.weight
    third = fused.shape[0] // 3
    assert torch.equal(q, fused[:third])
    assert torch.equal(part.model.visual.blocks[0].attn.qkv.v.weight, fused[2 * third :])
    assert torch.equal(opt.state[q]["exp_avg"], fused[:third] + 1)
    assert float(opt.state[q]["step"]) == 3.0
    merger = part.model.visual.merger.mlp[0].weight
    assert torch.equal(merger, full["model.visual.merger.mlp.0.weight"])


def test_pretrained_source_reads_only_the_asked_block(tmp_path):
    """Sharded loading slices on the host: ``SafetensorsSource.read`` returns the block a
    rank's shard holds (``get_slice``), equal to slicing the full tensor."""
    from ray_disagg.models.loading import SafetensorsSource

    spec = HFModelSpec(config=tiny_qwen2_5_vl_config(), seed=5)
    spec.build_full().save_pretrained(tmp_path, max_shard_size="60KB")
    meta = spec.meta_model()
    source = SafetensorsSource(str(tmp_path), meta)
    name = next(n for n, p in meta.named_parameters() if p.dim() == 2 and p.shape[0] >= 4)
    full = source.get(name)
    assert source.shape(name) == tuple(full.shape)
    block = (slice(1, 3), slice(2, full.shape[1]))
    assert torch.equal(source.read(name, block), full[block])


def _split_linear_attention(spec, part) -> None:
    """Qwen3.5's text-TP row blocks, unsharded: every Gated DeltaNet's ``in_proj_qkv`` and
    ``conv1d`` as ``q``/``k``/``v`` blocks of ``key_dim, key_dim, value_dim`` rows."""
    from ray_disagg.parallel.row_blocks import SplitConv1d, SplitLinear

    splits = spec.adapter.llm_tp_plan().splits
    for layer in spec.adapter.llm_modules(part)[0].layers:
        la = getattr(layer, "linear_attn", None)
        if la is not None:
            s = splits["linear_attn.in_proj_qkv"]
            la.in_proj_qkv = SplitLinear(la.in_proj_qkv, s.pieces, s.sizes)
            s = splits["linear_attn.conv1d"]
            la.conv1d = SplitConv1d(la.conv1d, s.pieces, s.sizes)


def test_unequal_row_blocks_load_from_the_fused_tensors(tmp_path):
    """Qwen3.5's ``in_proj_qkv``/``conv1d`` blocks (16, 16 and 32 rows in the tiny
    config) load from HF's fused tensors: from a pretrained directory (whole, and the
    rows a shard reads), and from full tensors with their AdamW state (a resume from a
    fused checkpoint)."""
    from ray_disagg import tiny_qwen3_5_config
    from ray_disagg.models.loading import _read
    from ray_disagg.parallel.row_blocks import block_rows
    from ray_disagg.worker.shards import load_model, load_optimizer

    spec = HFModelSpec(config=tiny_qwen3_5_config(), seed=5)
    spec.build_full().save_pretrained(tmp_path)
    full = spec.build_part("text").state_dict()
    pre = HFModelSpec(pretrained_path=tmp_path)
    part = pre.meta_model("text")
    _split_linear_attention(pre, part)
    pre.materialize(part, "cpu", "text")  # checks the fused shapes, reads the blocks
    prefix = "model.language_model.layers.0.linear_attn"
    blocks = block_rows(part, spec.adapter.hf_param_name)
    assert [blocks[f"{prefix}.conv1d.{w}.weight"] for w in "qkv"] == [
        (0, 16, 64), (16, 16, 64), (32, 32, 64)
    ]  # fmt: skip
    for fused, leaf in (("in_proj_qkv", "weight"), ("conv1d", "weight")):
        rows = full[f"{prefix}.{fused}.{leaf}"]
        q, k, v = (getattr(part.get_submodule(f"{prefix}.{fused}"), w).weight for w in "qkv")
        assert torch.equal(torch.cat([q, k, v]), rows) and v.shape[0] == 2 * q.shape[0]
    source, name = pre.weight_source(pre.meta_model("text")), f"{prefix}.in_proj_qkv.v.weight"
    region = (slice(3, 9), slice(0, 64))  # a shard's rows of the v block
    got = _read(source, name, region, spec.adapter.hf_param_name, blocks)
    assert torch.equal(got, full[f"{prefix}.in_proj_qkv.weight"][32 + 3 : 32 + 9])

    with torch.no_grad():
        for p in part.parameters():
            p.zero_()
    opt = torch.optim.AdamW(part.parameters())
    fields = {f: {k: v + 1 for k, v in full.items()} for f in ("exp_avg", "exp_avg_sq")}
    fields["step"] = {k: torch.tensor([3.0]) for k in full}
    load_model(part, full)
    load_optimizer(opt, part, fields)
    v = part.get_submodule(f"{prefix}.conv1d").v.weight
    assert torch.equal(v, full[f"{prefix}.conv1d.weight"][32:])
    assert torch.equal(opt.state[v]["exp_avg"], full[f"{prefix}.conv1d.weight"][32:] + 1)
