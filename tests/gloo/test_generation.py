"""Tier 2 (real gloo processes): completions from the LLM part as it is placed for
training (``ray_disagg.rollout.decode``: left-padded prompts prefilled once with the
crossings of each prompt's media encoded once, a KV cache, the vocabulary split under
text TP) equal the single-process HF model's: greedy ones token for token
``generate(do_sample=False)``; seeded samples the draws of a sampler written separately
on the whole model (``tests.grpo_reference.sample_completions``: a full forward per
token, the media placeholders suppressed, HF's warpers, the same per-completion noise)."""

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.grpo_reference import sample_completions

G, NEW = 2, 7
SAMPLED = {"temperature": 0.9, "top_k": 40, "top_p": 0.9}
STOP_SAMPLED = tuple(range(24))

VOCAB = 135  # text TP2 splits it 68 + 67: the short slice is padded with -inf logits
SEED = 1  # with this model, FSDP2 rank 1's sampled rows end before rank 0's


def prompts_of(cfg):
    from ray_disagg.data.examples import synthetic_samples

    out = []
    for s in synthetic_samples(cfg, 3, seed=1, grids=[(1, 4, 4), None, (1, 8, 4)]):
        labels, ids = np.asarray(s.pop("labels")), np.asarray(s.pop("input_ids"))
        n = int(np.argmax(labels != -100))
        out.append({**s, "input_ids": ids[:n], "labels": np.full(n, -100)})
    return out


def _completions(rank, world, fsdp: bool = False):
    """``{"greedy": Completions, "sampled": Completions}`` of the prompts on this rank's
    layout (text TP over ``world`` ranks, or with ``fsdp`` FSDP2 and its own prompts)."""
    from torch.distributed.device_mesh import init_device_mesh

    from ray_disagg import HFModelSpec, tiny_qwen2_5_vl_config
    from ray_disagg.parallel.fsdp import PartRunner, end_forward_only
    from ray_disagg.parallel.tensor_parallel import parallelize_text
    from ray_disagg.rollout.decode import DecodeSettings, generate, left_padded
    from ray_disagg.rollout.sampling import completion_keys
    from ray_disagg.worker.objective import repeat_rows
    from ray_disagg.worker.part_worker import ParameterCounts

    cfg = tiny_qwen2_5_vl_config(vocab_size=VOCAB)
    spec = HFModelSpec(config=cfg, seed=4)
    adapter, prompts = spec.adapter, prompts_of(cfg)
    if fsdp:  # data parallel: each rank its own prompts, which end at different steps
        prompts = prompts[rank::world]
    with torch.no_grad():  # each prompt's image encoded once, its rows repeated per completion
        received = adapter.encode(spec.build_part("vision").eval(), "vision", prompts, "cpu")
    rows = {n: [adapter.crossing_rows("vision", p)[n] for p in prompts] for n in received}
    received = repeat_rows(received, rows, [G] * len(prompts))
    rows_prompts = [p for p in prompts for _ in range(G)]
    batch = adapter.collate_llm(rows_prompts)
    batch = left_padded(batch, [len(p["input_ids"]) for p in rows_prompts])
    part = spec.build_part("text").eval()
    whole = ParameterCounts.of(part)
    tp, start, runner = None, 0, PartRunner(part)
    if fsdp:  # as the group places it: the layers and a root unit around the part
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        for layer in adapter.llm_modules(part)[0].layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(runner, mesh=mesh)
    elif world > 1:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        lm, head = adapter.llm_modules(part)
        tp, start = parallelize_text(part, lm, head, mesh, adapter.llm_tp_plan(),
                                     adapter.per_head_norms)  # fmt: skip
    keys = completion_keys(1, SEED, [p["id"] for p in prompts], G)  # rank 1's rows end first
    out = {"counts": (whole, ParameterCounts.of(part))}  # before and after the sharding
    for name, settings in (
        ("greedy", DecodeSettings(max_new_tokens=NEW, stop_ids=(0, 2), greedy=True)),  # pad, eos
        (
            "sampled",
            DecodeSettings(
                max_new_tokens=NEW,
                stop_ids=STOP_SAMPLED,
                **SAMPLED,
                suppress_ids=adapter.placeholder_ids(),
            ),
        ),  # fmt: skip
    ):

        def run(model, settings=settings):  # the loop in one root forward (FSDP2's hooks once)
            head = adapter.llm_modules(model)[1]
            return generate(adapter, model, head, batch, received, keys, settings, tp_group=tp,
                            vocab_start=start, sync_group=dist.group.WORLD)  # fmt: skip

        out[name] = runner(run)
        end_forward_only(runner)
    return out


def hf_greedy(spec, prompts):
    """``generate(do_sample=False)`` of the whole HF model, one prompt at a time."""
    full, out = spec.build_full().eval(), []
    for p in prompts:
        kwargs = spec.adapter.reference_inputs([p])
        kwargs.pop("labels")
        ids = full.generate(**kwargs, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                            pad_token_id=0)  # fmt: skip
        out.append(ids[0, len(p["input_ids"]) :].tolist())
    return out


@pytest.fixture(scope="module")
def spec():
    from ray_disagg import HFModelSpec, tiny_qwen2_5_vl_config

    return HFModelSpec(config=tiny_qwen2_5_vl_config(vocab_size=VOCAB), seed=4)


@pytest.fixture(scope="module")
def tp2():
    return run_distributed(_completions, 2)


@pytest.fixture(scope="module")
def whole_model_samples(spec):
    from ray_disagg.rollout.sampling import completion_keys

    prompts = prompts_of(spec.config)
    keys = completion_keys(1, SEED, [p["id"] for p in prompts], G)
    opts = SAMPLED | {"num_generations": G, "max_completion_length": NEW}
    model = spec.build_full().eval()
    return sample_completions(spec, model, prompts, keys, opts, STOP_SAMPLED)[0]


def up_to_stop(ref: list[int]) -> list[int]:
    """HF's completion (run to NEW tokens without stopping) up to its first stop token."""
    ends = [i for i, t in enumerate(ref) if t in (0, 2)]
    return ref[: ends[0] + 1] if ends else ref


@pytest.fixture(scope="module")
def hf_greedy_completions(spec):
    return [up_to_stop(c) for c in hf_greedy(spec, prompts_of(spec.config))]


def test_greedy_completions_under_text_tp_equal_hf_generate(tp2, hf_greedy_completions):
    want = [c for c in hf_greedy_completions for _ in range(G)]
    for out in (o["greedy"] for o in tp2):
        assert out.tokens == want
        assert out.truncated == [len(t) == NEW and t[-1] not in (0, 2) for t in out.tokens]
        assert sum(len(t) for t in out.tokens) > 2 * len(out.tokens)  # not stopped at once


def test_seeded_samples_under_text_tp_equal_a_sampler_on_the_whole_model(tp2, whole_model_samples):
    first, second = (o["sampled"] for o in tp2)
    assert first.tokens == second.tokens  # every tp rank draws the same
    assert first.tokens == whole_model_samples
    assert len({tuple(t) for t in first.tokens}) > len(first.tokens) // 2  # they differ
    assert first.truncated == [len(t) == NEW and t[-1] not in STOP_SAMPLED for t in first.tokens]


def test_fsdp2_ranks_decode_in_lockstep_and_draw_what_one_process_draws(
    whole_model_samples, hf_greedy_completions
):
    """Text FSDP2 (2): each rank its own prompts, whose completions end at different
    steps; the ranks' forwards (their all-gathers) go on together until every row of
    both has ended, and each completion is the whole model's draw (its seed); greedy
    ones equal HF's ``generate``."""
    runs = run_distributed(_completions, 2, True)
    for rank, out in enumerate(o["greedy"] for o in runs):  # prompts rank, rank + 2, ...
        mine = hf_greedy_completions[rank::2]
        assert out.tokens == [c for c in mine for _ in range(G)]
    per_rank = [o["sampled"] for o in runs]
    by_prompt = {}
    for rank, out in enumerate(per_rank):
        for i, tokens in enumerate(out.tokens):
            by_prompt[(rank + 2 * (i // G), i % G)] = tokens
    assert [by_prompt[(p, g)] for p in range(3) for g in range(G)] == whole_model_samples
    longest = [max(len(t) for t in out.tokens) for out in per_rank]
    assert longest[1] < longest[0] == NEW  # rank 1 went on with rank 0 after its rows ended
    # the workers' start line: the whole part's parameters (all trainable here) on every
    # rank, sharded or not, and what each rank holds of them: its half
    whole, sharded = zip(*(o["counts"] for o in runs))
    assert {(c.trainable, c.total) for c in whole + sharded} == {(whole[0].total,) * 2}
    assert sum(c.local_total for c in sharded) == whole[0].total
    for c in sharded:
        assert str(c).endswith(f"(this rank holds {c.local_trainable:,} of {c.local_total:,})")
