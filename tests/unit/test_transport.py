"""Tier 1: which transfer tier a pair of workers gets, and colocation checked on the
driver before any worker starts."""

import pytest
import torch
from ray.train import ScalingConfig

from ray_disagg import DisaggregatedTrainer, HFModelSpec, ModuleGroup, tiny_qwen2_5_vl_config
from ray_disagg.data.examples import synthetic_samples
from ray_disagg.pipeline.neighbours import Neighbourhoods
from ray_disagg.transport import Location, choose_tier, describe
from ray_disagg.transport.base import from_bytes

CPU_A = Location(node="n1", pid=1, device="cpu")
CPU_B = Location(node="n1", pid=2, device="cpu")
CPU_OTHER_NODE = Location(node="n2", pid=3, device="cpu")
GPU0_A = Location(node="n1", pid=4, device="cuda", gpu="GPU-0")
GPU0_B = Location(node="n1", pid=5, device="cuda", gpu="GPU-0")
GPU1 = Location(node="n1", pid=6, device="cuda", gpu="GPU-1")
GPU_OTHER_NODE = Location(node="n2", pid=7, device="cuda", gpu="GPU-0")


@pytest.mark.parametrize(
    "a,b,tier",
    [
        (CPU_A, CPU_B, "shm"),
        (CPU_A, CPU_OTHER_NODE, "gloo"),
        (GPU0_A, GPU0_B, "cuda_ipc"),  # colocated on one GPU: never NCCL
        (GPU0_A, GPU1, "nccl"),
        (GPU0_A, GPU_OTHER_NODE, "nccl"),  # same GPU index, another node
        (GPU0_A, CPU_B, "gloo"),
    ],
)
def test_automatic_tier_follows_where_the_workers_are(a, b, tier):
    assert choose_tier(a, b) == tier == choose_tier(b, a)


@pytest.mark.parametrize(
    "a,b,requested,why",
    [
        (CPU_A, CPU_OTHER_NODE, "shm", "different nodes"),
        (CPU_A, CPU_B, "cuda_ipc", "same GPU"),
        (GPU0_A, GPU1, "cuda_ipc", "same GPU"),
        (GPU0_A, GPU0_B, "nccl", "same GPU"),
        (CPU_A, CPU_B, "nccl", "both workers on GPUs"),
        (CPU_A, CPU_B, "ucx", "must be 'auto' or one of"),
    ],
)
def test_requested_tier_that_cannot_work_is_refused(a, b, requested, why):
    with pytest.raises(ValueError, match=why):
        choose_tier(a, b, requested)
    assert choose_tier(a, b, "gloo") == "gloo"  # always possible


def test_header_describes_any_dtype_and_bytes_round_trip():
    tensors = {
        "x": torch.randn(3, 4).to(torch.bfloat16),
        "n": torch.arange(5),
        "e": torch.zeros(0, 2),
    }
    specs = describe(tensors)
    assert [(s.name, s.shape, s.dtype) for s in specs] == [
        ("x", (3, 4), "bfloat16"),
        ("n", (5,), "int64"),
        ("e", (0, 2), "float32"),
    ]
    for spec, t in zip(specs, tensors.values()):
        raw = t.contiguous().reshape(-1).view(torch.uint8).clone()
        assert raw.numel() == spec.nbytes
        assert torch.equal(from_bytes(raw, spec), t)


CFG = tiny_qwen2_5_vl_config()
DATA = synthetic_samples(CFG, 8)


def g(n=1, **resources):
    use_gpu = "GPU" in resources
    return ModuleGroup(
        scaling_config=ScalingConfig(
            num_workers=n, use_gpu=use_gpu, resources_per_worker=resources or None
        )
    )


def spread():
    return ModuleGroup(scaling_config=ScalingConfig(num_workers=1, placement_strategy="SPREAD"))


def make(vision, text, train_loop_config=None, **kwargs):
    return DisaggregatedTrainer(
        model=HFModelSpec(config=CFG),
        groups={"vision": vision, "text": text},
        train_loop_config={"max_steps": 1, "global_batch_size": 4, **(train_loop_config or {})},
        datasets={"train": DATA},
        **kwargs,
    )


def test_colocated_bundle_sums_one_worker_of_each_group():
    t = make(g(2, CPU=0.5), g(2, CPU=1), placement="colocated")
    assert t.colocation.bundle == {"CPU": 1.5} and t.colocation.num_bundles == 2
    # colocated pairs keep contiguous slices (each talks to its own bundle's peer)
    assert t.loop_config.assignment == "contiguous"
    assert t.transfer_pairs() == ((("vision", 0), ("text", 0)), (("vision", 1), ("text", 1)))
    assert make(g(2), g(2)).loop_config.assignment == "balanced"
    t = make(g(2, GPU=0.5), g(2, GPU=0.5), placement="colocated")
    assert t.colocation.bundle["GPU"] == 1.0
    assert make(g(2), g(1)).colocation is None  # separate (the default)
    # the pairs that exchange tensors: every vision leader with the text leaders it feeds
    pairs = make(g(2), g(1), train_loop_config={"assignment": "contiguous"}).transfer_pairs()
    assert pairs == ((("vision", 0), ("text", 0)), (("vision", 1), ("text", 0)))


@pytest.mark.parametrize(
    "vision,text,kwargs,match",
    [
        (g(2), g(1), {"placement": "colocated"}, r"same num_workers; got \{'vision': 2"),
        (g(1, GPU=1), g(1, GPU=1), {"placement": "colocated"}, r"add up to 2, not 1.*'GPU': 0.5"),
        (g(1, GPU=0.25), g(1, GPU=0.25), {"placement": "colocated"}, "add up to 0.5, not 1"),
        (g(1, GPU=0.5), g(1), {"placement": "colocated"}, "use_gpu"),
        (g(1), spread(), {"placement": "colocated"}, "same ScalingConfig.placement_strategy"),
        (g(1), g(1), {"placement": "packed"}, r"placement='packed': must be one of"),
        (g(1), g(1), {"transfer": "rdma"}, r"transfer='rdma': must be 'auto' or one of"),
        (g(1), g(1), {"transfer": "nccl"}, "not every group has ScalingConfig.use_gpu=True"),
    ],
)
def test_bad_placement_or_transfer_fails_on_the_driver(vision, text, kwargs, match):
    with pytest.raises(ValueError, match=match):
        make(vision, text, **kwargs)


def test_nccl_message_is_one_buffer_of_aligned_tensors():
    """The NCCL tier sends a message's tensors as one buffer (one send, one receive per
    message); every tensor starts 16-byte aligned and comes back bit-identical."""
    from ray_disagg.transport.base import describe
    from ray_disagg.transport.nccl import pack, unpack_views

    tensors = {
        "a": torch.randn(3, 5).to(torch.bfloat16),
        "empty": torch.zeros(0, 4),
        "b": torch.arange(7, dtype=torch.int64),
        "c": torch.randn(2, 3, 3),
    }
    specs = describe(tensors)
    buf = pack(list(tensors.values()), specs, "cpu")
    assert buf.dtype == torch.uint8 and buf.numel() == 32 + 0 + 64 + 80
    for (name, t), out in zip(tensors.items(), unpack_views(buf, specs)):
        assert out.dtype == t.dtype and out.shape == t.shape, name
        assert torch.equal(out, t), name
        assert out.data_ptr() % 16 == 0 or out.numel() == 0, name


def test_transfer_pairs_are_the_neighbours_at_every_size():
    """Balanced: each vision leader pairs with its neighbouring text leaders only, and an
    elastic size (or a standby taking a rank's place) gets the pairs of its own sizes."""
    t = make(g(4), g(2), train_loop_config={"global_batch_size": 8})
    assert t.loop_config.assignment == "balanced"
    args = t.loop_args(put=lambda data: data)  # no Ray
    for n in (4, 1, 2, 8):
        pairs = t.transfer_pairs(args.at_sizes({"vision": n}))
        assert {(v, x) for (_, v), (_, x) in pairs} == Neighbourhoods(n, 2).pairs()
