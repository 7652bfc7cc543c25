"""Tier 1: weighted mixtures (``ray_disagg.mix``): the sampler's shares and order, each
source's epochs, the settings refused, and a recipe's list of weighted sources."""

import math

import numpy as np
import pytest
from ray.train import ScalingConfig

from ray_disagg import (
    DPO,
    DisaggregatedTrainer,
    HFModelSpec,
    ModuleGroup,
    mix,
    tiny_qwen2_5_vl_config,
)
from ray_disagg.data.examples import synthetic_pairs, synthetic_samples
from ray_disagg.data.mixture import BLOCK, SOURCE_KEY
from ray_disagg.recipes.recipe import load_recipe

SOURCES = {n: [{"id": f"{n}{i}"} for i in range(k)] for n, k in (("a", 30), ("b", 7), ("c", 100))}
WEIGHTS = {"a": 0.5, "b": 0.2, "c": 0.3}


def test_each_sources_share_of_4000_draws_is_its_weight():
    m = mix(SOURCES, weights={"a": 5, "b": 2, "c": 3}, seed=1)  # normalized
    src, _ = m.locate(np.arange(4000))
    for k, name in enumerate(m.names):
        assert abs((src == k).mean() - WEIGHTS[name]) <= 0.02, name


def test_draws_are_deterministic_random_access_and_each_source_has_epochs():
    m = mix(SOURCES, weights=WEIGHTS, seed=3)
    src, index = m.locate(np.arange(2 * BLOCK + 50))
    again = mix(SOURCES, weights=WEIGHTS, seed=3)
    for k in (0, 7, BLOCK - 1, BLOCK, 2 * BLOCK + 49):  # any draw alone, in any order
        assert again[k]["id"] == SOURCES[m.names[src[k]]][index[k]]["id"]
        assert again[k][SOURCE_KEY] == m.names[src[k]]
    assert not np.array_equal(mix(SOURCES, weights=WEIGHTS, seed=4).locate(np.arange(50))[0],
                              src[:50])  # fmt: skip
    b = index[src == 1]  # the small source: every sample once per epoch, reshuffled
    assert sorted(b[:7]) == list(range(7)) == sorted(b[7:14]) and list(b[:7]) != list(b[7:14])
    n_b = int((src == 1).sum())
    assert m.epochs(len(src))["b"] == n_b // 7 and m.epochs(0) == {"a": 0, "b": 0, "c": 0}


@pytest.mark.parametrize(
    "sources,weights,match",
    [
        (SOURCES, {"a": 1, "b": 0, "c": 1}, r"weight of 'b' is 0; must be > 0"),
        (SOURCES, {"a": 1, "b": -1, "c": 1}, r"weight of 'b' is -1; must be > 0"),
        (SOURCES, {"a": math.nan, "b": 1, "c": 1}, r"weight of 'a' is nan; must be a number"),
        (SOURCES, {"a": 1, "b": 1}, r"one weight per source.*\['a', 'b', 'c'\]"),
        (SOURCES, {"a": 1, "b": 1, "c": 1, "d": 1}, r"one weight per source"),
        ({**SOURCES, "e": []}, None, r"source 'e' is empty"),
        ({}, None, r"non-empty dict"),
        ({"a": iter([])}, None, r"source 'a' is a list_iterator; a mixture takes map-style"),
        ({1: SOURCES["a"]}, None, r"name the sources with strings"),
        ({"a": [{"source": "web"}]}, None, r"have a 'source' field.*rename the field"),
    ],
)
def test_bad_mixtures_are_refused(sources, weights, match):
    with pytest.raises(ValueError, match=match):
        mix(sources, weights=weights)


def _trainer(datasets, **loop):
    cfg = tiny_qwen2_5_vl_config()
    g = ModuleGroup(scaling_config=ScalingConfig(num_workers=1))
    return DisaggregatedTrainer(
        model=HFModelSpec(config=cfg),
        groups={"vision": g, "text": g},
        train_loop_config={"max_steps": 3, "global_batch_size": 4, **loop},
        datasets=datasets,
    )


def test_the_trainer_plans_draws_and_refuses_a_validation_or_pair_mixture():
    cfg = tiny_qwen2_5_vl_config()
    data = mix({"x": synthetic_samples(cfg, 6), "y": synthetic_samples(cfg, 2, seed=1)})
    plan = _trainer({"train": data}).plan
    assert plan.num_samples == 16 and plan.global_indices(2) == [8, 9, 10, 11]  # in order
    with pytest.raises(ValueError, match=r"datasets\['validation'\] is a mixture"):
        _trainer({"train": data, "validation": data})
    pairs = mix({"x": synthetic_pairs(cfg, 4)})
    with pytest.raises(ValueError, match=r"objective'\]=DPO with a mixture"):
        _trainer({"train": pairs}, objective=DPO())
    image_tokens = {"id": "b0", "input_ids": np.full(4, cfg.image_token_id)}  # no pixels
    broken = mix({"x": synthetic_samples(cfg, 2), "bad": [image_tokens]})
    with pytest.raises(ValueError, match=r"mixture source 'bad': .*'b0'"):
        _trainer({"train": broken})


def test_a_recipes_list_of_weighted_sources_is_a_mixture():
    def recipe(train):
        return {
            "model": {"config": "tiny_qwen2_5_vl"},
            "data": {"train": train},
            "groups": {"vision": {"num_workers": 1}, "text": {"num_workers": 1}},
            "train_loop_config": {"max_steps": 2, "global_batch_size": 4},
        }

    digits = {"type": "digits", "num_samples": 8}
    r = load_recipe(recipe([{"name": "a", "weight": 0.7, **digits},
                            {"name": "b", "weight": 0.3, **digits, "start": 8}]))  # fmt: skip
    assert [s["name"] for s in r.data["train"]["sources"]] == ["a", "b"]
    from ray_disagg.recipes.data import build_dataset

    built = build_dataset(r, "train")
    assert built.names == ("a", "b") and built.probs == {"a": 0.7, "b": 0.3}
    with pytest.raises(ValueError, match=r"data.train\[1\]: a mixture takes map-style"):
        parquet = {"name": "s", "weight": 1, "type": "parquet", "paths": "x"}
        load_recipe(recipe([{"name": "a", "weight": 1, **digits}, parquet]))
    with pytest.raises(ValueError, match=r"data.train\[1\].name='a': another source"):
        load_recipe(recipe([{"name": "a", "weight": 1, **digits}] * 2))
    with pytest.raises(ValueError, match=r"data.train\[0\].weight=-1: must be a number > 0"):
        load_recipe(recipe([{"name": "a", "weight": -1, **digits}]))
    with pytest.raises(ValueError, match=r"mix\(seed=-1\): must be an int >= 0"):
        mix(SOURCES, seed=-1)
