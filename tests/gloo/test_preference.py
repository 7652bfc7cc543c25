"""Tier 2 (the groups' workers without Ray, ``testing.local``): DPO on pre-tokenized
preference pairs equals an independently written single-process DPO on the HF model
(sequence log-prob sums from full logits, a frozen copy of the initial model as the
reference, TRL's formulas, AdamW, fp32, 3 steps): losses and parameters within 1e-5
relative, TRL's reward metrics within 1e-6 absolute, in layouts that cover the
label-position loss path under TP (vocab-parallel), CP (log-probs summed over the slices),
packing, chunks, FSDP2, balanced assignment, 1F1B microbatches, a trained tower's
reference copy (vision SP2) and a frozen one; and a custom objective through the
interface."""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ray_disagg import (
    DPO,
    BatchPlan,
    ContextParallel,
    DataParallel,
    HFModelSpec,
    ModuleGroup,
    Objective,
    SequenceParallel,
    TensorParallel,
    TrainLoopConfig,
    load_metrics,
    tiny_qwen2_5_vl_config,
)
from ray_disagg.data.examples import synthetic_pairs
from ray_disagg.data.preference import PreferenceProcessor
from ray_disagg.data.stream import ConversationStream
from ray_disagg.objectives import PAIR_KEYS
from ray_disagg.testing.reference import reference_preference
from ray_disagg.worker.shards import REFERENCE_LOGPS
from tests.conversation_data import build_media, build_model_dir, make_processor
from tests.helpers import (
    assert_params_close,
    built_trainer,
    checkpoint_state,
    group,
    losses,
    run_layout,
    vt,
)
from tests.preference_data import trl_pair_loss
from tests.preference_records import pair_record

LOOP = {"global_batch_size": 4, "max_steps": 3, "eps": 1e-6, "seed": 3}
GRIDS = [(1, 4, 4), (1, 8, 4), None, (1, 4, 8)]


def frozen(n: int) -> ModuleGroup:
    return dataclasses.replace(group(n), trainable=False)


CASES = {
    "vision-sp2-text-tp2-sigmoid": (
        lambda: vt(group(2, SequenceParallel(size=2)), group(2, TensorParallel(size=2))),
        {},
        DPO(beta=0.1),
    ),
    "frozen-vision-text-cp2-1f1b-packed-chunked-ipo": (
        lambda: vt(frozen(1), group(2, ContextParallel(size=2))),
        {"micro_batches": 2, "pack_sequences": True, "max_seq_len": 64, "loss_chunk_tokens": 3},
        DPO(beta=0.5, loss_type="ipo"),
    ),
    # the smallest layout, a trained tower with its reference copy, two 1F1B microbatches
    "vision1-text1-1f1b-hinge": (
        lambda: vt(group(1), group(1)),
        {"micro_batches": 2},
        DPO(beta=0.1, loss_type="hinge"),
    ),
}


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_qwen2_5_vl_config()
    return HFModelSpec(config=cfg, seed=4), synthetic_pairs(cfg, 8, grids=GRIDS)


def expected_metrics(logps, beta: float) -> dict[str, list[float]]:
    """TRL's metrics of every step from the reference's ``(policy, reference)`` log-probs."""
    out = {}
    for policy, ref in logps:
        rewards = beta * (policy - ref)
        step = {
            "rewards/chosen": rewards[:, 0].mean(),
            "rewards/rejected": rewards[:, 1].mean(),
            "rewards/accuracies": (rewards[:, 0] > rewards[:, 1]).float().mean(),
            "rewards/margins": (rewards[:, 0] - rewards[:, 1]).mean(),
            "logps/chosen": policy[:, 0].mean(),
            "logps/rejected": policy[:, 1].mean(),
        }
        for k, v in step.items():
            out.setdefault(k, []).append(float(v))
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_dpo_layouts_equal_single_process(setup, tmp_path, case):
    spec, pairs = setup
    groups, loop, dpo = CASES[case]
    groups = groups()
    cfg = TrainLoopConfig(**LOOP | loop)
    pair_loss = trl_pair_loss(dpo.loss_type, dpo.beta, dpo.label_smoothing)
    ref_losses, ref_logps, ref_model = reference_preference(spec, pairs, cfg, pair_loss, groups)
    result = run_layout(
        spec, pairs, LOOP | loop | {"objective": dpo}, groups, tmp_path, case, local=True
    )

    torch.testing.assert_close(losses(result), ref_losses, rtol=1e-5, atol=0.0)
    assert_params_close(checkpoint_state(result.checkpoint), ref_model.state_dict(), 1e-5)
    assert set(dpo.metric_names) <= set(result.metrics)  # the Result carries TRL's names
    frame = load_metrics(result)
    for name, want in expected_metrics(ref_logps, dpo.beta).items():
        tol = (
            {"atol": 1e-6, "rtol": 0.0}
            if name.startswith("rewards")
            else {"rtol": 1e-5, "atol": 0.0}
        )
        torch.testing.assert_close(frame[name].tolist(), want, **tol, msg=name)
    assert frame["rewards/chosen"].iloc[0] == 0.0  # the policy starts as the reference
    plan = BatchPlan(num_samples=len(pairs), global_batch_size=4, seed=3, shuffle=True)
    images = [sum(int(pairs[i].get("image_grid_thw") is not None) for i in plan.global_indices(s))
              for s in range(3)]  # fmt: skip
    assert frame["images"].tolist() == images  # each prompt's image encoded once per pair


@dataclasses.dataclass(kw_only=True)
class WeightedSimPO(Objective):
    """A custom objective through the public interface: SimPO (no reference; the
    answers' mean log-probs) weighted by each pair's ``weight`` field."""

    beta: float = 2.0
    gamma: float = 0.5
    sequence_keys = PAIR_KEYS
    fields = ("weight",)
    metric_names = ("weight",)

    def sequences(self, sample):
        return DPO().sequences(sample)

    def loss(self, logps):
        avg = (logps.totals() / logps.tokens).view(-1, 2)
        w = torch.tensor([s["weight"] for s in logps.samples], dtype=avg.dtype)
        losses = -F.logsigmoid(self.beta * (avg[:, 0] - avg[:, 1]) - self.gamma)
        share = logps.whole / logps.global_samples  # a mean over the global batch's pairs
        return (w * losses).sum() * share, {"weight": w.sum() * share}


def test_custom_objective_through_the_interface(setup, tmp_path):
    """(Under a token budget: each step takes the pairs whose two sequences fit.)"""
    spec, pairs = setup
    pairs = [{**p, "weight": float(w)} for p, w in zip(pairs, np.linspace(0.5, 2.0, len(pairs)))]
    obj = WeightedSimPO()

    def simpo(policy, _ref, tokens, batch):
        avg = policy / tokens
        w = torch.tensor([p["weight"] for p in batch])
        return w * -F.logsigmoid(obj.beta * (avg[:, 0] - avg[:, 1]) - obj.gamma)

    loop = LOOP | {"micro_batches": 2, "global_batch_size": 6, "max_tokens_per_microbatch": 40}
    groups = lambda: vt(group(1), group(2, DataParallel()))  # noqa: E731
    plan = built_trainer(spec, pairs, loop | {"objective": obj}, groups(), tmp_path).plan
    cfg = TrainLoopConfig(**loop)
    ref_losses, _, ref_model = reference_preference(spec, pairs, cfg, simpo, plan=plan)
    result = run_layout(
        spec, pairs, loop | {"objective": obj}, groups(), tmp_path, "custom", local=True
    )

    torch.testing.assert_close(losses(result), ref_losses, rtol=1e-5, atol=0.0)
    assert_params_close(checkpoint_state(result.checkpoint), ref_model.state_dict(), 1e-5)
    counts = [len(plan.global_indices(s)) for s in range(3)]
    assert load_metrics(result)["samples"].tolist() == counts
    assert min(counts) < 6  # the budget, not the count, ended a step
    want = np.mean([pairs[i]["weight"] for i in plan.global_indices(2)])  # over the step's pairs
    assert result.metrics["weight"] == pytest.approx(want, rel=1e-6)


def test_precompute_equals_copy_and_a_resumed_run_keeps_the_precomputed_values(setup, tmp_path):
    """``reference="precompute"`` (a trained tower: the encoder group runs the pass too;
    text FSDP2, a token budget whose covering pass is the reference's, Robust DPO) equals
    the reference copy; the values are
    saved with the checkpoint, and a run resumed from it reads them (recomputed with the
    trained weights they would differ)."""
    spec, pairs = setup
    loop = LOOP | {"micro_batches": 2, "max_tokens_per_microbatch": 40}  # a pair per bin
    cfg = TrainLoopConfig(**loop)
    pair_loss = trl_pair_loss("robust", 0.2, 0.1)
    dpo = DPO(beta=0.2, loss_type="robust", label_smoothing=0.1, reference="precompute")
    pre = loop | {"objective": dpo}
    groups = lambda: vt(group(1), group(2, DataParallel(fsdp=True)))  # noqa: E731
    plan = built_trainer(spec, pairs, pre, groups(), tmp_path).plan
    ref_losses, _, ref_model = reference_preference(spec, pairs, cfg, pair_loss, plan=plan)
    first = run_layout(spec, pairs, pre | {"max_steps": 2}, groups(), tmp_path, "a", local=True)
    saved = json.loads((Path(first.checkpoint.path) / "text" / REFERENCE_LOGPS).read_text())
    assert sorted(e[0] for e in saved) == list(range(len(pairs)))  # every pair, by its id
    resumed = run_layout(spec, pairs, pre, groups(), tmp_path, "b", local=True,
                         resume=first.checkpoint)  # fmt: skip

    torch.testing.assert_close(losses(first) + losses(resumed), ref_losses, rtol=1e-5, atol=0.0)
    assert_params_close(checkpoint_state(resumed.checkpoint), ref_model.state_dict(), 1e-5)


def test_trl_records_streamed_through_the_processors_equal_single_process(tmp_path):
    """TRL preference records in a JSON Lines file, converted by the chat template and
    the image processor while training runs (the conversation stream), equal the
    single-process DPO on the same conversions."""
    cfg = tiny_qwen2_5_vl_config()
    media = build_media(tmp_path)
    proc = PreferenceProcessor(make_processor(build_model_dir(tmp_path / "model"), media, cfg))
    records = [pair_record(i) for i in range(8)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    spec, loop = HFModelSpec(config=cfg, seed=4), LOOP | {"shuffle": False, "max_steps": 2}
    ref_losses, _, ref_model = reference_preference(
        spec, [proc(r) for r in records], TrainLoopConfig(**loop), trl_pair_loss("sigmoid", 0.1)
    )
    stream = ConversationStream(paths=path, processor=proc)
    result = run_layout(spec, stream, loop | {"objective": DPO()}, vt(group(1), group(1)),
                        tmp_path, "stream", local=True)  # fmt: skip

    torch.testing.assert_close(losses(result), ref_losses, rtol=1e-5, atol=0.0)
    assert_params_close(checkpoint_state(result.checkpoint), ref_model.state_dict(), 1e-5)
