"""Tier 2: tensor parallelism of the text part (gloo, real processes) equals the dense part."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.dist_utils import run_distributed


def _vocab_ce(rank, world):
    from ray_disagg.parallel.tensor_parallel import VocabParallelCrossEntropy

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 12, generator=g)
    target = torch.randint(0, 12, (7,), generator=g)
    target[2] = -100
    ref_logits = logits.clone().requires_grad_()
    ref = F.cross_entropy(ref_logits, target, ignore_index=-100, reduction="sum")
    ref.backward()
    v = 12 // world
    shard = logits[:, rank * v : (rank + 1) * v].clone().requires_grad_()
    loss = VocabParallelCrossEntropy.apply(shard, target, rank * v, -100, dist.group.WORLD).sum()
    loss.backward()
    return {
        "loss": loss.detach(),
        "ref": ref.detach(),
        "grad": shard.grad,
        "ref_grad": ref_logits.grad,
    }


@pytest.mark.parametrize("world", [2, 3])
def test_vocab_parallel_cross_entropy_matches_torch(world):
    out = run_distributed(_vocab_ce, world)
    v = 12 // world
    for r, o in enumerate(out):
        torch.testing.assert_close(o["loss"], o["ref"])
        torch.testing.assert_close(o["grad"], o["ref_grad"][:, r * v : (r + 1) * v])


def _tp_text(rank, world, model_type):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from ray_disagg import ADAPTERS, HFModelSpec
    from ray_disagg.data.examples import synthetic_samples
    from ray_disagg.models.loss import lm_loss
    from ray_disagg.parallel.expert_parallel import parallelize_experts
    from ray_disagg.parallel.tensor_parallel import all_reduce_partial_grads, parallelize_text
    from ray_disagg.worker.part_worker import ParameterCounts
    from ray_disagg.worker.shards import merge_row_blocks

    cfg = ADAPTERS[model_type].tiny_config()
    spec = HFModelSpec(config=cfg, seed=2)
    adapter = spec.adapter
    samples = synthetic_samples(cfg, 3, grids=[(1, 4, 4), None, (1, 8, 4)])
    batch = adapter.collate_llm(samples)
    g = torch.Generator().manual_seed(1)
    n_img = int((batch["input_ids"] == cfg.image_token_id).sum())
    received = {
        c.name: torch.randn(n_img if c.name.startswith("image") else 0, c.width, generator=g)
        for c in adapter.crossings("vision")
    }

    def run(part, tp_group=None, vocab_start=0):
        got = {k: v.clone().requires_grad_() for k, v in received.items() if v.shape[0]}
        hidden = adapter.llm_hidden(part, batch, got)
        lm_head = adapter.llm_modules(part)[1]
        loss = lm_loss(hidden, lm_head, batch["labels"], 10.0, tp_group, vocab_start)
        loss.backward()
        if tp_group is not None:
            all_reduce_partial_grads(part.parameters(), tp_group)
        grads = {}
        for n, p in part.named_parameters():
            g = p.grad
            grads[n] = g.full_tensor() if isinstance(g, DTensor) else g
        return loss.detach(), {k: v.grad for k, v in got.items()}, merge_row_blocks(grads)

    dense_part = spec.build_part("text")
    dense = run(dense_part)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    part = spec.build_part("text")
    lm, lm_head = adapter.llm_modules(part)
    plan, norms = adapter.llm_tp_plan(), adapter.per_head_norms
    sharded = run(part, *parallelize_text(part, lm, lm_head, mesh, plan, norms))
    # the workers' start line: the part's parameters counted alike whatever the layout
    counts = {"dense": ParameterCounts.of(dense_part), "tp": ParameterCounts.of(part)}
    if adapter.router is not None:  # and with the experts split over the ranks (EP)
        moe = spec.build_part("text")
        parallelize_experts(adapter.llm_modules(moe)[0], mesh)
        counts["ep"] = ParameterCounts.of(moe)
    return {"dense": dense, "tp": sharded, "counts": counts}


def assert_counted_alike(counts: dict) -> None:
    """``counts["dense"]`` (the whole part on one rank) and every sharded layout's
    :class:`ParameterCounts` state the same part; the sharded ones add what they hold."""
    dense = counts.pop("dense")
    assert dense.local_total == dense.total and "holds" not in str(dense)
    for layout, got in counts.items():
        assert (got.trainable, got.total) == (dense.trainable, dense.total), layout
        assert got.local_total < got.total, layout
        whole = f"{dense.trainable:,} of {dense.total:,} parameter elements trainable"
        held = f"(this rank holds {got.local_trainable:,} of {got.local_total:,})"
        assert str(got) == f"{whole} {held}", layout


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe"])
def test_tp_text_part_matches_dense_including_crossing_gradients(model_type):
    """Qwen3.5: Gated DeltaNet layers sharded by key heads (split ``in_proj_qkv`` and
    ``conv1d``, sharded ``A_log``/``dt_bias``, the gated norm's partial gradients)."""
    out = run_distributed(_tp_text, 2, model_type)
    for o in out:
        assert_counted_alike(o["counts"])
        (dl, de, dg), (tl, te, tg) = o["dense"], o["tp"]
        torch.testing.assert_close(tl, dl, rtol=1e-6, atol=0)
        # the gradients sent back to the vision group (embeddings and DeepStack features):
        # full, not per-rank partial sums
        assert sorted(te) == sorted(de)
        for k in de:
            torch.testing.assert_close(te[k], de[k], rtol=1e-5, atol=1e-7, msg=k)
        assert sorted(tg) == sorted(dg)  # row blocks merged back under HF names
        for name, g in dg.items():
            torch.testing.assert_close(tg[name], g, rtol=1e-5, atol=1e-6, msg=name)


def _tp_vision(rank, world, model_type):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from ray_disagg import ADAPTERS, HFModelSpec
    from ray_disagg.data.examples import synthetic_samples
    from ray_disagg.parallel.tensor_parallel import parallelize_vision
    from ray_disagg.worker.shards import merge_row_blocks

    cfg = ADAPTERS[model_type].tiny_config()
    spec = HFModelSpec(config=cfg, seed=3)
    adapter = spec.adapter
    samples = synthetic_samples(cfg, 2, grids=[(1, 8, 8), (1, 4, 8)])
    cpu = torch.device("cpu")

    def run(part):
        out = adapter.encode(part, "vision", samples, cpu)
        g = torch.Generator().manual_seed(4)
        ups = [torch.randn(v.shape, generator=g) for v in out.values()]
        torch.autograd.backward(list(out.values()), ups)
        grads = {}
        for n, p in part.named_parameters():
            grads[n] = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        return {k: v.detach() for k, v in out.items()}, merge_row_blocks(grads)

    dense = run(spec.build_part("vision"))
    part = spec.build_part("vision")
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    tower = adapter.part_roots(part, "vision")[0]
    parallelize_vision(tower, adapter.tower_tp_plan("vision"), mesh)
    return {"dense": dense, "tp": run(part)}


def test_tp_vision_tower_matches_dense():
    """The uniform vision-TP baseline (split qkv, sharded blocks) reproduces the dense
    tower's outputs and, under HF names, its gradients."""
    out = run_distributed(_tp_vision, 2, "qwen2_5_vl")
    for o in out:
        (do, dg), (to, tg) = o["dense"], o["tp"]
        for k in do:
            torch.testing.assert_close(to[k], do[k], rtol=1e-5, atol=1e-6, msg=k)
        assert sorted(tg) == sorted(dg)
        for name, g in dg.items():
            torch.testing.assert_close(tg[name], g, rtol=1e-5, atol=1e-6, msg=name)


SAMPLING = [
    {"greedy": True},
    {"temperature": 0.8},
    {"temperature": 1.2, "top_k": 5},
    {"temperature": 0.9, "top_p": 0.7},
    {"top_k": 9, "top_p": 0.5},
]


def _sampling(rank, world, vocab):
    from ray_disagg.rollout.decode import _pad_vocab
    from ray_disagg.rollout.sampling import completion_keys, next_tokens

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(24, vocab, generator=g) * 2
    logits[:6, 5:30] = 3.0  # the best tied across the slices' boundaries
    keys = completion_keys(2, 4, list(range(6)), 4)
    positions = torch.arange(24) % 5
    v = -(-vocab // world)  # the last rank's slice is shorter, padded as decoding does
    mine = _pad_vocab(logits[:, rank * v : (rank + 1) * v], v)
    return [
        (
            next_tokens(
                mine,
                keys,
                positions,
                vocab_start=rank * v,
                group=dist.group.WORLD,
                vocab_size=vocab,
                **o,
            ),
            next_tokens(logits, keys, positions, **o),
        )
        for o in SAMPLING
    ]


@pytest.mark.parametrize("world,vocab", [(2, 36), (3, 36), (4, 35)])
def test_seeded_sampling_on_vocabulary_slices_equals_the_whole_vocabulary(world, vocab):
    """Greedy, temperature, top-k and top-p draws with the vocabulary split over ranks
    equal the draws on the whole row (ties included), on every rank; 35 over 4 ranks:
    the last slice padded with -inf logits, never drawn."""
    for rank_out in run_distributed(_sampling, world, vocab):
        for (split, whole), opts in zip(rank_out, SAMPLING):
            assert torch.equal(split, whole), opts


def _tp_uneven_vocab(rank, world, tied):
    """Qwen2.5-VL's text part with a 135-token vocabulary (not a multiple of ``world``)."""
    from torch.distributed.device_mesh import init_device_mesh

    from ray_disagg import HFModelSpec, tiny_qwen2_5_vl_config
    from ray_disagg.data.examples import synthetic_samples
    from ray_disagg.models.loss import lm_loss
    from ray_disagg.parallel.tensor_parallel import parallelize_text
    from ray_disagg.worker.part_worker import ParameterCounts
    from ray_disagg.worker.shards import merge_row_blocks

    cfg = tiny_qwen2_5_vl_config(vocab_size=135, text_kv_heads=4, tie_word_embeddings=tied)
    spec = HFModelSpec(config=cfg, seed=5)
    adapter = spec.adapter
    batch = adapter.collate_llm(synthetic_samples(cfg, 3, grids=[None, None, None]))
    batch["labels"][0, 3] = 134  # the last row, on the last rank's short shard

    def run(part, tp_group=None, vocab_start=0):
        hidden = adapter.llm_hidden(part, batch, {})
        lm_head = adapter.llm_modules(part)[1]
        loss = lm_loss(hidden, lm_head, batch["labels"], 10.0, tp_group, vocab_start)
        loss.backward()
        grads = {
            n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            for n, p in part.named_parameters()
        }
        shapes = {n: tuple(p.shape) for n, p in part.named_parameters()}
        return loss.detach(), merge_row_blocks(grads), shapes, vocab_start

    dense_part = spec.build_part("text")
    dense = run(dense_part)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    part = spec.build_part("text")
    lm, lm_head = adapter.llm_modules(part)
    plan, norms = adapter.llm_tp_plan(), adapter.per_head_norms
    return {
        "dense": dense,
        "tp": run(part, *parallelize_text(part, lm, lm_head, mesh, plan, norms)),
        "counts": {"dense": ParameterCounts.of(dense_part), "tp": ParameterCounts.of(part)},
    }


@pytest.mark.parametrize("world,tied", [(2, True), (4, False)])
def test_a_vocabulary_tp_does_not_divide_matches_dense(world, tied):
    """135 tokens under TP2 (68 + 67 rows, tied embeddings) and TP4 (34 x 3 + 33): the
    loss and every gradient equal the dense model's, in HF's shapes."""
    out = run_distributed(_tp_uneven_vocab, world, tied)
    assert [o["tp"][3] for o in out] == [r * (68 if world == 2 else 34) for r in range(world)]
    for o in out:
        assert_counted_alike(o["counts"])  # tied: the embedding's shard counted once
        (dl, dg, dshape, _), (tl, tg, tshape, _) = o["dense"], o["tp"]
        torch.testing.assert_close(tl, dl, rtol=1e-6, atol=0)
        assert tshape == dshape  # DTensors keep the vocabulary's 135 rows
        for name, g in dg.items():
            torch.testing.assert_close(tg[name], g, rtol=1e-5, atol=1e-6, msg=name)
