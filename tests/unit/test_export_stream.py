"""Streaming ``export_hf``: DCP module directories -> sharded safetensors, one tensor at a
time (no Ray, no process group: DCP runs with ``no_dist``)."""

from __future__ import annotations

import json
import os
import warnings
import weakref

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file

from ray_disagg import HFModelSpec, export_hf
from ray_disagg.models import safetensors_stream as sts
from ray_disagg.models import tiny_qwen2_5_vl_config

QKV = "model.visual.blocks.0.attn.qkv."


@pytest.fixture(scope="module")
def model():
    return HFModelSpec(config=tiny_qwen2_5_vl_config(), seed=0).build_full()


def write_checkpoint(root, model, split_qkv=False, dtype=torch.float32):
    """The layout a run writes: ``<root>/config.json`` + one DCP directory per part."""
    parts = {"vision": {}, "text": {}}
    for k, v in model.state_dict().items():
        part = parts["vision" if k.startswith("model.visual.") else "text"]
        v = v.to(dtype)
        if split_qkv and k.startswith(QKV):  # as the vision TP baseline stores it
            field = k[len(QKV) :]
            for which, piece in zip("qkv", v.chunk(3, dim=0)):
                part[f"model.{QKV}{which}.{field}"] = piece.clone()
        else:
            part[f"model.{k}"] = v
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        for name, state in parts.items():
            dcp.save(state, storage_writer=dcp.FileSystemWriter(root / name), no_dist=True)
    model.config.save_pretrained(root)
    return root


def assert_same(exported, model, dtype=torch.float32):
    ref = model.state_dict()
    got = exported.state_dict()
    assert got.keys() == ref.keys()
    for k, v in ref.items():
        assert got[k].dtype == dtype and torch.equal(got[k], v.to(dtype)), k


@pytest.mark.parametrize(
    "split_qkv,dtype", [(False, torch.float32), (True, torch.float32), (True, torch.bfloat16)]
)
def test_sharded_export_loads_back_exactly(model, tmp_path, split_qkv, dtype):
    root = write_checkpoint(tmp_path / "ckpt", model, split_qkv, dtype)
    if split_qkv:
        assert not any(k.startswith(f"model.{QKV}weight") for k in _dcp_keys(root / "vision"))
    out = export_hf(root, tmp_path / "hf", max_shard_size=20000)
    with open(os.path.join(out, sts.INDEX_NAME)) as f:
        index = json.load(f)
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(f for f in os.listdir(out) if f.endswith(".safetensors")) == files
    assert index["weight_map"].keys() == model.state_dict().keys()
    for name in files:  # no file over the limit unless it holds one larger tensor
        with safe_open(os.path.join(out, name), "pt") as f:
            assert f.metadata() == {"format": "pt"}
            names = f.keys()
            size = sum(f.get_tensor(k).nbytes for k in names)
            assert size <= 20000 or len(names) == 1
    exported = type(model).from_pretrained(out)
    assert_same(exported, model, dtype)


def test_single_file_export_replaces_an_earlier_sharded_one(model, tmp_path):
    root = write_checkpoint(tmp_path / "ckpt", model)
    export_hf(root, tmp_path / "hf", max_shard_size="20KB")
    out = export_hf(root, tmp_path / "hf")  # default 5GB: one file
    weights = sorted(f for f in os.listdir(out) if "safetensors" in f)
    assert weights == ["model.safetensors"]
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["architectures"] == [type(model).__name__]
    assert_same(type(model).from_pretrained(out), model)


def test_export_reads_one_tensor_at_a_time(model, tmp_path, monkeypatch):
    root = write_checkpoint(tmp_path / "ckpt", model, split_qkv=True)
    events, alive = [], []
    real_load, real_write = dcp.load, sts.SafetensorsWriter.write

    def load(state_dict, **kw):
        events.append(sorted(state_dict))
        return real_load(state_dict, **kw)

    def write(self, name, tensor):
        # the tensor written before this one is already freed: one tensor alive at a time
        assert all(ref() is None for ref in alive), name
        alive[:] = [weakref.ref(tensor)]
        events.append(name)
        real_write(self, name, tensor)

    monkeypatch.setattr(dcp, "load", load)
    monkeypatch.setattr(sts.SafetensorsWriter, "write", write)
    export_hf(root, tmp_path / "hf", max_shard_size=20000)
    loads, writes = events[0::2], events[1::2]
    assert len(writes) == len(model.state_dict()) and all(isinstance(w, str) for w in writes)
    for keys, name in zip(loads, writes):  # each write preceded by the load of its keys
        if name.startswith(QKV):
            field = name[len(QKV) :]
            assert keys == [f"model.{QKV}{w}.{field}" for w in "kqv"]
        else:
            assert keys == [f"model.{name}"]


def test_writer_round_trips_bits(tmp_path):
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, 3.14])
    tensors = {
        "bf16": torch.randn(7, 5).to(torch.bfloat16),
        "bf16_special": special.to(torch.bfloat16),
        "f16": torch.randn(3).half(),
        "f32": torch.cat([special, torch.randn(9)]),
        "i64": torch.arange(-3, 3),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
    }
    specs = [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()]
    (_, shard), *rest = sts.plan_shards(specs, 10**6)
    assert not rest
    with sts.SafetensorsWriter(tmp_path / "t.safetensors", shard) as w:
        for name, _, _ in shard:
            w.write(name, tensors[name])
    back = load_file(tmp_path / "t.safetensors")
    assert back.keys() == tensors.keys()
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape, k
        bits = back[k].reshape(-1).view(torch.uint8)
        assert torch.equal(bits, v.reshape(-1).view(torch.uint8)), k
    header_len = int.from_bytes((tmp_path / "t.safetensors").read_bytes()[:8], "little")
    assert header_len % 8 == 0


def test_writer_rejects_out_of_order_or_missing_tensors(tmp_path):
    specs = [("a", torch.float32, (2,)), ("b", torch.float32, (2,))]
    w = sts.SafetensorsWriter(tmp_path / "t.safetensors", specs)
    with pytest.raises(ValueError, match="expected a"):
        w.write("b", torch.zeros(2))
    w.write("a", torch.zeros(2))
    with pytest.raises(ValueError, match="1/2"):
        w.close()


def test_plan_shards_names_and_limits():
    f32 = [(f"t{i}", torch.float32, (10,)) for i in range(5)]  # 40 bytes each
    plan = sts.plan_shards([*f32[:2], ("big", torch.float32, (100,)), *f32[2:]], 120)
    assert [f for f, _ in plan] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert [[n for n, _, _ in s] for _, s in plan] == [["t0", "t1"], ["big"], ["t2", "t3", "t4"]]
    assert sts.plan_shards(f32, 10**9)[0][0] == "model.safetensors"


def test_max_shard_size_parsing():
    assert sts.parse_size(123) == 123
    assert sts.parse_size("5GB") == 5 * 10**9
    assert sts.parse_size("500MB") == 500 * 10**6
    assert sts.parse_size("2GiB") == 2 * 2**30
    for bad in ("5 parsecs", "GB", "", -1, 0, 1.5, True, None):
        with pytest.raises(ValueError):
            sts.parse_size(bad)


def test_missing_module_directory_is_reported(model, tmp_path):
    root = write_checkpoint(tmp_path / "ckpt", model)
    for f in os.listdir(root / "vision"):
        os.remove(root / "vision" / f)
    with pytest.raises(ValueError, match="no DCP .metadata"):
        export_hf(root, tmp_path / "hf")


def _dcp_keys(directory):
    return dcp.FileSystemReader(directory).read_metadata().state_dict_metadata.keys()
