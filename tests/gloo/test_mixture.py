"""Tier 2 (the groups' workers without Ray, ``testing.local``): a weighted mixture of two
sources trains like the single-process HF model on the same draws, with packed rows over
two LLM replicas and 1F1B microbatches; its per-source metrics are each source's mean
token loss (checked against HF at the first step, and summing to the step's loss), its
label tokens and each source's epoch (the small source runs out and starts again); a
resume with changed weights is refused naming them."""

import pytest
import torch

from ray_disagg import (
    ContextParallel,
    HFModelSpec,
    load_metrics,
    mix,
    tiny_qwen2_5_vl_config,
)
from ray_disagg.data.examples import synthetic_samples
from ray_disagg.data.mixture import SOURCE_KEY
from ray_disagg.launch.mixtures import check_mixture_resume
from ray_disagg.pipeline.assignment import count_label_tokens
from ray_disagg.testing.reference import reference_batch
from tests.helpers import assert_matches_reference, built_trainer, group, run_layout, vt

LOOP = {"max_steps": 3, "global_batch_size": 8, "micro_batches": 2, "checkpoint_every": 1,
        "lr": 1e-3, "eps": 1e-6, "pack_sequences": True, "max_seq_len": 64}  # fmt: skip
WEIGHTS = {"captions": 0.7, "text": 0.3}


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_qwen2_5_vl_config()
    captions = synthetic_samples(cfg, 12, grids=[(1, 4, 4), (1, 8, 4), (1, 4, 8)])
    text = synthetic_samples(cfg, 3, seed=1, grids=[None])
    return HFModelSpec(config=cfg, seed=5), {"captions": captions, "text": text}


CASES = {
    "dp2-packed-1f1b": (lambda: vt(group(1), group(2)), LOOP),
    "cp2": (
        lambda: vt(group(1), group(2, ContextParallel(size=2))),
        {k: v for k, v in LOOP.items() if k not in ("pack_sequences", "max_seq_len")},
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_mixture_trains_like_hf_with_each_sources_loss(setup, tmp_path, case):
    spec, sources = setup
    groups, loop = CASES[case]
    data = mix(sources, weights=WEIGHTS, seed=2)
    plan = built_trainer(spec, data, loop, groups(), tmp_path).plan
    result = run_layout(spec, data, loop, groups(), tmp_path, case, local=True)

    assert_matches_reference(result, spec, data, loop, plan=plan)
    history = load_metrics(result)
    steps = [[data[i] for i in plan.global_indices(s)] for s in range(3)]
    adapter, model = spec.adapter, spec.build_full()
    for s, samples in enumerate(steps):
        row = history.iloc[s]
        for name in WEIGHTS:
            mine = [x for x in samples if x[SOURCE_KEY] == name]
            n = sum(count_label_tokens(adapter.labels(x)) for x in mine)
            assert row[f"label_tokens/{name}"] == n
            if s == 0 and mine:  # the initial weights: HF's mean token loss of the source
                with torch.no_grad():
                    want = float(model(**reference_batch(spec, mine)).loss)
                assert row[f"loss/{name}"] == pytest.approx(want, rel=1e-5)
        total = sum(row[f"loss/{n}"] * row[f"label_tokens/{n}"] for n in WEIGHTS
                    if row[f"label_tokens/{n}"])  # fmt: skip
        assert total / row["label_tokens"] == pytest.approx(row["loss"], rel=1e-5)
    drawn = max(plan.global_indices(2)) + 1
    assert history["epoch/text"].iloc[-1] == data.epochs(drawn)["text"] >= 1  # 3 samples
    assert {x[SOURCE_KEY] for step in steps for x in step} == set(WEIGHTS)

    path, same = result.checkpoint.path, mix(sources, weights=WEIGHTS, seed=2)
    check_mixture_resume(path, same, "text")
    changed = mix(sources, weights={"captions": 0.5, "text": 0.5}, seed=2)
    with pytest.raises(ValueError, match=r"changed training mixture \(weights: checkpoint"):
        check_mixture_resume(path, changed, "text")
    reordered = mix({"text": sources["text"], "captions": sources["captions"]}, weights=WEIGHTS,
                    seed=2)  # fmt: skip
    with pytest.raises(ValueError, match=r"\(sources: checkpoint \[\['captions', 12\]"):
        check_mixture_resume(path, reordered, "text")
