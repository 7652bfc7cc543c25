"""Tier 1: ``ray-disagg plan --auto``: the cluster description, the enumeration of
layouts, the cost model's terms, the ranking, the written recipe and bad input."""

import dataclasses

import numpy as np
import pytest

from ray_disagg.config.groups import (
    ContextParallel,
    DataParallel,
    ExpertParallel,
    SequenceParallel,
    TensorParallel,
)
from ray_disagg.models import ADAPTERS
from ray_disagg.planner import cost
from ray_disagg.planner.calibrate import (
    bisect_figure,
    fit_encoder_speed,
    fit_per_unit,
    step_terms,
)
from ray_disagg.planner.cluster import (
    NOMINAL,
    Cluster,
    load_figures,
    parse_cluster,
    save_figures,
)
from ray_disagg.planner.memory import estimate
from ray_disagg.planner.render import recipe_dict, render, render_auto
from ray_disagg.planner.search import Candidate, enumerate_layouts, group_for, plan_auto
from ray_disagg.recipes.cli import main
from ray_disagg.recipes.recipe import load_recipe

CPU2 = Cluster(cpus_per_node=2, host_memory_gib=24, interconnect="loopback")
GPU4 = parse_cluster("nodes=1,gpus_per_node=4,gpu_memory_gib=80")


def recipe(preset="tiny_qwen2_5_vl", **loop):
    return load_recipe({
        "model": {"config": preset},
        "data": {"train": {"type": "digits", "num_samples": 64, "image_size": 16}},
        "groups": {"vision": {"num_workers": 1}, "text": {"num_workers": 1}},
        "train_loop_config": {"max_steps": 2, "global_batch_size": 8, **loop},
        "plan": {"image_size": [32, 32], "images_per_sample": 1},
    })  # fmt: skip


def test_cluster_descriptions_and_figure_files(tmp_path):
    assert (GPU4.devices, GPU4.device_memory_gib, GPU4.gpu) == (4, 80.0, True)
    assert CPU2.devices == 2 and CPU2.device_memory_gib == 12.0
    with pytest.raises(ValueError, match="is not KEY=VALUE"):
        parse_cluster("gpus=8")
    with pytest.raises(ValueError, match="interconnect"):
        parse_cluster("interconnect=carrier-pigeon")
    assert load_figures(GPU4, str(tmp_path / "none.json")) is NOMINAL["gpu"]
    measured = dataclasses.replace(NOMINAL["cpu"], calibrated=True, overhead_s=0.5)
    path = save_figures(measured, str(tmp_path / "figures.json"))
    assert load_figures(CPU2, path) == measured
    old = tmp_path / "old.json"  # written by a version with other figures
    old.write_text('{"name": "x", "parallel_efficiency": 0.6}')
    with pytest.raises(ValueError, match=r"parallel_efficiency.*calibrate again"):
        load_figures(CPU2, str(old))


def test_enumeration_covers_every_parallelism():
    layouts = list(enumerate_layouts(recipe(), GPU4))
    kinds = {(p, type(g.parallelism)) for r in layouts for p, g in r.groups.items()}
    assert {
        ("vision", SequenceParallel),
        ("text", TensorParallel),
        ("text", ContextParallel),
    } <= kinds
    assert {r.placement for r in layouts} == {"separate", "colocated"}
    assert {r.loop.micro_batches for r in layouts} >= {1, 2, 4} and {
        r.loop.bf16 for r in layouts
    } == {False, True}
    assert any(g.fsdp for r in layouts for g in r.groups.values())
    assert any(r.loop.max_in_flight == r.loop.micro_batches == 4 for r in layouts)
    assert all(
        sum(g.num_workers for g in r.groups.values()) <= 4
        for r in layouts
        if r.placement == "separate"
    )
    moe = list(enumerate_layouts(recipe("tiny_qwen3_vl_moe"), GPU4))
    assert any(isinstance(r.groups["text"].parallelism, ExpertParallel) for r in moe)


def _at(r, vision, text, placement="separate", k=1, ac=False):
    groups = {"vision": group_for(r.groups["vision"], *vision, ac, True, 1),
              "text": group_for(r.groups["text"], *text, ac, True, 1)}  # fmt: skip
    return cost.with_layout(r, groups=groups, placement=placement, micro_batches=k)


def test_cost_model_terms():
    r = recipe()
    r = dataclasses.replace(r, model=cost.CachedModel(r.model))
    facts, work, f = cost.model_facts(r), cost.workload(r), NOMINAL["gpu"]
    one = cost.predict(_at(r, (1, DataParallel()), (1, DataParallel())), facts, work, GPU4, f)
    tp2 = cost.predict(
        _at(r, (1, DataParallel()), (2, TensorParallel(size=2))), facts, work, GPU4, f
    )
    assert tp2.compute_s["text"] == pytest.approx(one.compute_s["text"] / 2)
    assert tp2.comm_s["text"] > 0 == one.comm_s["text"]
    ac = cost.predict(
        _at(r, (1, DataParallel()), (1, DataParallel()), ac=True), facts, work, GPU4, f
    )
    assert ac.compute_s["text"] == pytest.approx(one.compute_s["text"] * 4 / 3)
    seq = _at(r, (1, DataParallel()), (1, DataParallel()), k=4)
    piped = cost.predict(seq, facts, work, GPU4, f)  # separate, 4 microbatches: 1F1B
    sequential = cost.with_layout(seq, micro_batches=4)
    sequential = dataclasses.replace(
        sequential, loop=dataclasses.replace(sequential.loop, schedule="sequential")
    )
    assert piped.step_s < cost.predict(sequential, facts, work, GPU4, f).step_s
    ahead = cost.predict(cost.with_layout(seq, max_in_flight=4), facts, work, GPU4, f)
    assert ahead.step_s < piped.step_s and ahead.memory["vision"] > piped.memory["vision"]
    dp2 = cost.predict(_at(r, (1, DataParallel()), (2, DataParallel())), facts, work, GPU4, f)
    fsdp = cost.predict(
        _at(r, (1, DataParallel()), (2, DataParallel(fsdp=True))), facts, work, GPU4, f
    )
    assert fsdp.memory["text"] < dp2.memory["text"] and fsdp.sync_s > dp2.sync_s
    # the calibration's fits recover the figures the measurements were made with
    true = dataclasses.replace(f, overhead_s=0.0, reference_samples=8, microbatch_exponent=1.3)
    one, two = (_at(r, (1, DataParallel()), (1, DataParallel()), k=k) for k in (1, 2))
    a, _, c0 = step_terms(one, facts, work, GPU4, true)
    inv = (cost.predict(one, facts, work, GPU4, true).step_s - c0) / a
    assert 1 / inv == pytest.approx(f.flops["float32"], rel=1e-6)
    run = (two, {"step_s": cost.predict(two, facts, work, GPU4, true).step_s})
    start = dataclasses.replace(true, microbatch_exponent=1.0)
    got = bisect_figure(run, facts, work, GPU4, start, "microbatch_exponent", 0.5, 2.0)
    assert got == pytest.approx(1.3, rel=1e-6)
    slow = cost.predict(one, facts, work, GPU4, dataclasses.replace(true, encoder_speed=0.4))
    seconds = {f"{p}_compute_s": t for p, t in slow.compute_s.items()}
    assert fit_encoder_speed(one, seconds, facts, work, GPU4, true) == pytest.approx(0.4, rel=1e-6)


def test_cpu_cores_and_the_sync_figures():
    r = recipe()
    r = dataclasses.replace(r, model=cost.CachedModel(r.model))
    facts, work = cost.model_facts(r), cost.workload(r)
    f = dataclasses.replace(NOMINAL["cpu"], overhead_s=0.0, collective_latency_s=0.01)
    # 1F1B with three busy workers on two cores: at least the core-seconds over the cores
    three = _at(r, (1, DataParallel()), (2, DataParallel()), k=2)
    p = cost.predict(three, facts, work, CPU2, f)
    core_s = p.compute_s["vision"] + 2 * p.compute_s["text"]
    assert p.step_s >= core_s / 2 + p.sync_s - 1e-9
    # the calibration's fits recover the gradient sync bandwidth and the per-call latency
    true = dataclasses.replace(f, grad_sync_bw=2e8)
    dp = _at(r, (1, DataParallel()), (2, DataParallel()))
    run = (dp, {"step_s": cost.predict(dp, facts, work, CPU2, true).step_s})
    got = bisect_figure(run, facts, work, CPU2, f, "grad_sync_bw", 1e6, f.collective_bw, log=True)
    assert got == pytest.approx(2e8, rel=1e-6)
    tp = _at(r, (1, DataParallel()), (2, TensorParallel(size=2)))
    run = (tp, {"step_s": cost.predict(tp, facts, work, CPU2, true).step_s})
    start = dataclasses.replace(true, collective_latency_s=0.5)  # any start: the same fit
    got = fit_per_unit(run, facts, work, CPU2, start, "collective_latency_s")
    assert got == pytest.approx(0.01, rel=1e-6)


def test_colocated_and_frozen_towers_and_the_written_schedule():
    r = recipe(schedule="sequential")
    r = dataclasses.replace(r, model=cost.CachedModel(r.model))
    facts, work, f = cost.model_facts(r), cost.workload(r), NOMINAL["gpu"]
    for placement in ("colocated", "separate"):
        x = _at(r, (1, DataParallel()), (1, DataParallel()), placement=placement, k=4)
        frozen = dict(x.groups, vision=dataclasses.replace(x.groups["vision"], trainable=False))
        x = dataclasses.replace(x, groups=frozen)
        p = cost.predict(x, cost.model_facts(x), work, GPU4, f)
        turns = sum(p.compute_s.values()) + sum(p.comm_s.values()) + p.crossing_s
        turns += 4 * 2 * f.overhead_s  # per microbatch and group
        if placement == "colocated":  # the pair shares a GPU: no overlap, frozen or not
            assert p.step_s - p.sync_s == pytest.approx(turns)
        else:  # a frozen tower forwards ahead of the LLM
            assert p.step_s - p.sync_s < turns
    # the layout's schedule replaces the original recipe's
    one = _at(r, (1, DataParallel()), (1, DataParallel()), k=4)
    ahead = cost.with_layout(one, micro_batches=4, max_in_flight=4)
    loop = recipe_dict(Candidate(ahead))["train_loop_config"]
    assert "schedule" not in loop and loop["max_in_flight"] == 4
    assert "max_in_flight" not in recipe_dict(Candidate(one))["train_loop_config"]
    assert facts.parts["vision"].trainable


def test_plan_ranks_valid_layouts_and_writes_the_best(tmp_path):
    result = plan_auto(recipe(), CPU2, NOMINAL["cpu"])
    steps = [c.prediction.step_s for c in result.ranked]
    assert steps == sorted(steps) and len(steps) > 5
    text = render_auto(result)
    assert "UNCALIBRATED" in text and "1. " in text and "5. " in text and "s/step" in text
    figures, best = str(tmp_path / "none.json"), str(tmp_path / "best.yaml")
    args = ["--cluster", "cpus_per_node=2", "--figures", figures, "--out", best]
    out = main(["plan", "--auto", "digits_cpu", *args])
    assert "best layout written to" in out
    best = load_recipe(best)
    first = out.split("1. ")[1].split("\n")[0]
    assert best.placement in first and f"mb={best.loop.micro_batches}" in first


def test_no_layout_fits_names_the_smallest_shortfall():
    tiny = Cluster(cpus_per_node=1, host_memory_gib=0.001, interconnect="loopback")
    with pytest.raises(ValueError, match=r"smallest shortfall is [\d.]+ GiB on node with"):
        plan_auto(recipe(), tiny, NOMINAL["cpu"])
    assert np.isfinite(cost.GiB)


def test_every_family_plans():
    import ray_disagg.models as models

    gpu2 = parse_cluster("gpus_per_node=2,gpu_memory_gib=80")
    for preset in sorted(n.removesuffix("_config") for n in dir(models) if n.startswith("tiny_")):
        parts = models.get_adapter(getattr(models, f"{preset}_config")()).parts
        r = load_recipe({
            "model": {"config": preset},
            "data": {"train": {"type": "digits", "num_samples": 64, "image_size": 16}},
            "groups": {p: {"num_workers": 1} for p in parts},
            "train_loop_config": {"max_steps": 2, "global_batch_size": 8},
            "plan": {"image_size": [32, 32], "images_per_sample": 1},
        })  # fmt: skip
        result = plan_auto(r, gpu2, NOMINAL["gpu"])
        assert result.ranked and set(result.ranked[0].recipe.groups) == set(parts), preset


@pytest.mark.parametrize("model_type", sorted(ADAPTERS))
def test_every_family_answers_the_planners_questions(model_type):
    """The FLOP and memory formulas come from each adapter's hooks
    (``ray_disagg.models.costs``): the plan of every family renders, and its LLM's and
    tower's figures are positive (a new family needs no planner edit)."""
    cls = ADAPTERS[model_type]
    adapter, preset = cls(cls.tiny_config()), cls.tiny_config.__name__
    recipe = load_recipe(
        {
            "model": {"config": preset},
            "data": {"train": {"type": "digits", "num_samples": 8}},
            "groups": {p: {"num_workers": 1} for p in adapter.parts},
            "train_loop_config": {"max_steps": 2, "global_batch_size": 2},
        }
    )
    text = render(recipe)
    assert f"{model_type}, config" in text and "per worker" in text
    a = recipe.model.adapter
    memory = estimate(recipe)
    assert memory[a.llm_part].activations > 0
    for part in a.parts:
        assert a.forward_flops(part, 1e6, 64, 256, 2) > 2e6 * 0.1 * 64 * 0.99
    if a.tower_config("vision") is not None:
        patches, (h, w) = a.image_patches([32, 48])
        assert patches == h * w > 0 and a.image_tokens([32, 48]) > 0
    qwen = model_type.startswith("qwen")
    assert (memory.get("vision") is not None and memory["vision"].activations is not None) == (
        qwen and "vision" in a.parts
    )


def test_a_token_budget_sizes_the_estimated_step():
    """Under ``max_tokens_per_microbatch`` a step takes what fills the LLM's microbatches
    (its tokens and patches bound the activations); layouts rank per sample."""
    from ray_disagg.planner.memory import seq_len, step_samples

    fixed = recipe(max_seq_len=256)
    r = dataclasses.replace(fixed, model=cost.CachedModel(fixed.model))
    budget = recipe(max_seq_len=256, max_tokens_per_microbatch=512,
                    max_patches_per_microbatch=64)  # fmt: skip
    b = dataclasses.replace(budget, model=r.model)
    facts, work, f = cost.model_facts(r), cost.workload(r), NOMINAL["gpu"]
    assert seq_len(b) == 256 and step_samples(b) == 2 and step_samples(r) == 8
    one, two = (_at(b, (1, DataParallel()), (n, DataParallel())) for n in (1, 2))
    assert step_samples(two) == 4  # a second LLM replica fills two more samples' room
    full = _at(r, (1, DataParallel()), (1, DataParallel()))
    p1, p2, pf = (cost.predict(x, facts, work, GPU4, f) for x in (one, two, full))
    assert (p1.samples, p2.samples, pf.samples) == (2, 4, 8)
    assert p1.sample_s == pytest.approx(p1.step_s / 2)
    assert p1.memory["text"] < pf.memory["text"] and p1.memory["vision"] < pf.memory["vision"]


def test_a_generating_objective_adds_its_rollout_and_kv_cache(tmp_path):
    """GRPO's rollout: its seconds before the update (a trained tower encodes once more,
    the decode steps read the weights), the update on every completion, and the KV cache
    in the LLM's peak when it is larger than the update's activations."""
    from ray_disagg.data.examples import save_word_tokenizer
    from ray_disagg.planner.memory import seq_len
    from ray_disagg.planner.rollout import kv_cache_bytes

    grpo = {"type": "grpo", "reward_funcs": ["tests.unit.test_planner:reward"],
            "num_generations": 8, "max_completion_length": 256,
            "tokenizer": save_word_tokenizer(tmp_path)}  # fmt: skip
    base = recipe(max_seq_len=256)
    m = cost.CachedModel(base.model)
    gen = dataclasses.replace(recipe(max_seq_len=256, objective=grpo), model=m)
    replay = dataclasses.replace(
        recipe(max_seq_len=256, objective=grpo | {"rollouts": "recorded"}),
        model=cost.CachedModel(base.model),
    )
    facts, work, f = cost.model_facts(gen), cost.workload(gen), NOMINAL["gpu"]
    at = (1, DataParallel()), (1, DataParallel())
    p_gen, p_rep = (cost.predict(_at(x, *at), facts, work, GPU4, f) for x in (gen, replay))
    assert p_gen.rollout_s > 0 and p_rep.rollout_s == 0
    assert p_gen.step_s == pytest.approx(p_rep.step_s + p_gen.rollout_s)
    sft = cost.predict(_at(dataclasses.replace(base, model=m), *at), facts, work, GPU4, f)
    assert p_rep.compute_s["text"] > 8 * sft.compute_s["text"]  # 8 completions per prompt
    kv = kv_cache_bytes(gen, 8, seq_len(gen), 1, 4)
    assert kv > 0 and estimate(_at(gen, *at))["text"].activations >= kv
    tp2 = cost.predict(_at(gen, at[0], (2, TensorParallel(size=2))), facts, work, GPU4, f)
    assert tp2.rollout_s < p_gen.rollout_s  # half the weights read per token


def reward(prompts, completions, **kwargs):
    return [0.0 for _ in completions]
