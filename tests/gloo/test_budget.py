"""Tier 2 (the groups' workers without Ray, ``testing.local``): token-budget batching
equals the single-process HF model trained on the same steps (each step the samples that
fit, the loss the mean over the step's label tokens), with 1F1B microbatches, a patch cap
over two encoder replicas and an epoch boundary; and packed into FSDP2 replicas."""

import pytest

from ray_disagg import DataParallel, HFModelSpec, load_metrics, tiny_qwen2_5_vl_config
from ray_disagg.data.examples import synthetic_samples
from tests.helpers import assert_matches_reference, built_trainer, group, run_layout, vt

# mostly short text, some images, one video (39 LLM tokens, 128 patches) in eight
GRIDS = [None, (1, 4, 4), None, None, {"videos": [(2, 8, 8)]}, (1, 4, 8), None, (1, 8, 8)]
LOOP = {"max_steps": 3, "global_batch_size": 16, "lr": 1e-3, "eps": 1e-6, "seed": 3}
CASES = {
    "dp2-dp2-1f1b-capped": (
        lambda: vt(group(2), group(2)),
        {"micro_batches": 2, "max_tokens_per_microbatch": 80, "max_patches_per_microbatch": 160},
    ),
    "fsdp2-packed": (
        lambda: vt(group(1), group(2, DataParallel(fsdp=True))),
        {"pack_sequences": True, "max_seq_len": 40, "max_tokens_per_microbatch": 40},
    ),
}


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_qwen2_5_vl_config()
    return HFModelSpec(config=cfg, seed=7), synthetic_samples(cfg, 24, grids=GRIDS)


@pytest.mark.parametrize("case", list(CASES))
def test_budget_steps_equal_single_process(setup, tmp_path, case):
    spec, data = setup
    groups, loop = CASES[case]
    loop = LOOP | loop
    plan = built_trainer(spec, data, loop, groups(), tmp_path).plan
    result = run_layout(spec, data, loop, groups(), tmp_path, case, local=True)

    assert_matches_reference(result, spec, data, loop, plan=plan)
    history = load_metrics(result)
    counts = [len(plan.global_indices(s)) for s in range(3)]
    assert history["samples"].tolist() == counts and len(set(counts)) > 1
    assert history["epoch"].tolist() == [plan.epoch_of(s) for s in range(3)]
    if "capped" in case:  # the 16-sample cap ends step 1, the budget step 2, then epoch 1
        assert counts[:2] == [16, 8] and history["epoch"].tolist() == [0, 0, 1]
