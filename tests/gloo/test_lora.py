"""Tier 2 (the groups' workers without Ray, ``testing.local``): LoRA from a saved PEFT
adapter directory (nonzero ``lora_B``, LoRA on both parts including the tower's fused
``qkv``, the merger trained in full through ``modules_to_save``) equals an independent
single-process Hugging Face + PEFT run (``PeftModel.from_pretrained(...,
is_trainable=True)``, AdamW, fp32, 3 steps) in every layout: the losses, the trained
adapter under PEFT's file keys, the merged weights, and base weights that never move."""

import copy
import dataclasses
import os

import pytest
import torch
from peft import LoraConfig

from ray_disagg import (
    ContextParallel,
    DataParallel,
    HFModelSpec,
    SequenceParallel,
    TensorParallel,
    TrainLoopConfig,
    load_metrics,
)
from ray_disagg.lora.layers import is_factor
from ray_disagg.testing.reference import reference_train_peft
from tests.helpers import checkpoint_state, group, run_layout, vt
from tests.lora_data import assert_matches_peft, save_base_and_adapter

LOOP = {"global_batch_size": 4, "max_steps": 3, "eps": 1e-6, "seed": 3}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    base, adapter = tmp_path_factory.mktemp("base"), tmp_path_factory.mktemp("adapter")
    return base, adapter, save_base_and_adapter(base, adapter)


@pytest.fixture(scope="module")
def reference(saved):
    base, adapter, data = saved
    spec = HFModelSpec(pretrained_path=base, peft_path=adapter)
    return reference_train_peft(spec, adapter, data, TrainLoopConfig(**LOOP))


LAYOUTS = {
    "vision1-text-fsdp2": (lambda: vt(group(1), group(2, DataParallel(fsdp=True))), {}),
    "vision-sp2-text-tp2": (
        lambda: vt(group(2, SequenceParallel(size=2)), group(2, TensorParallel(size=2))),
        {},
    ),
    # packed rows and validation every step
    "vision-sp2-text-tp2-packed": (
        lambda: vt(group(2, SequenceParallel(size=2)), group(2, TensorParallel(size=2))),
        {"pack_sequences": True, "max_seq_len": 128, "eval_every": 1},
    ),
    "vision-tp2-split-qkv-text-fsdp2xtp2": (
        lambda: vt(
            group(2, TensorParallel(size=2)),
            group(4, TensorParallel(size=2, fsdp=True), cpus=0.25),
        ),
        {},
    ),
    "vision1-text-cp2": (lambda: vt(group(1), group(2, ContextParallel(size=2))), {}),
    "vision-zero1-dp2-text1-1f1b": (
        lambda: vt(group(2, DataParallel(zero1=True)), group(1)),
        {"micro_batches": 2},
    ),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lora_layouts_equal_hf_peft(saved, reference, tmp_path, layout):
    base, adapter, data = saved
    ref_losses, ref = reference
    groups, loop = LAYOUTS[layout]
    spec = HFModelSpec(pretrained_path=base, peft_path=adapter)
    validation = data[:4] if "eval_every" in loop else None
    result = run_layout(
        spec, data, LOOP | loop, groups(), tmp_path, layout, local=True, validation=validation
    )

    assert_matches_peft(result, ref_losses, ref, base, adapter)
    if validation is not None:
        assert load_metrics(result)["val_loss"].notna().all()


@pytest.mark.parametrize(("mode", "dtype"), [("bf16", torch.float32), ("pure", torch.bfloat16)])
def test_lora_factor_dtypes_under_fsdp2_bf16(saved, reference, tmp_path, mode, dtype):
    """fp32 factors in both bf16 modes (bf16 compute under FSDP2's policy), in one FSDP2
    unit with the frozen base; the merger (``modules_to_save``) in ``dtype``; losses
    close to fp32's."""
    base, adapter, data = saved
    loop = LOOP | {"max_steps": 2, "bf16": mode == "bf16"}
    if mode == "pure":  # no cast policy: FSDP2 all-gathers bf16 base and fp32 factors
        loop["param_dtype"] = "bfloat16"
    groups = vt(group(1), group(2, DataParallel(fsdp=True)))
    spec = HFModelSpec(pretrained_path=base, peft_path=adapter)
    result = run_layout(spec, data, loop, groups, tmp_path, mode, local=True)
    state = checkpoint_state(result.checkpoint)
    assert {v.dtype for k, v in state.items() if is_factor(k)} == {torch.float32}
    assert {v.dtype for k, v in state.items() if ".merger." in k} == {dtype}
    losses = load_metrics(result)["loss"].tolist()
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(reference[0][:2]), rtol=0.02, atol=0.0
    )


def test_a_fresh_adapter_starts_the_same_in_every_layout(saved, tmp_path):
    """``ModuleGroup(peft_config=...)``: factors drawn per name (``init_lora_weights=False``:
    both random, as ``nn.Linear``), so 1 worker and FSDP2(2) train the same run."""
    base, _, data = saved
    config = LoraConfig(r=4, target_modules=["q_proj", "gate_proj"], init_lora_weights=False)
    spec = HFModelSpec(pretrained_path=base)
    states, losses = [], []
    for name, parallelism in (("one", "none"), ("fsdp2", DataParallel(fsdp=True))):
        text = group(1 if name == "one" else 2, parallelism)
        text = dataclasses.replace(text, peft_config=config)
        vision = dataclasses.replace(group(1), trainable=False)
        result = run_layout(spec, data, LOOP, vt(vision, text), tmp_path, name, local=True)
        losses.append(load_metrics(result)["loss"].tolist())
        states.append(checkpoint_state(result.checkpoint))
    torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(losses[1]), rtol=1e-5, atol=0)
    factors = [k for k in states[0] if is_factor(k)]
    assert len(factors) == 8  # q_proj and gate_proj of 2 layers, A and B
    for k in factors:
        torch.testing.assert_close(states[0][k], states[1][k], rtol=0, atol=1e-5, msg=k)


def test_checkpoints_resume_and_exports_that_peft_loads(saved, reference, tmp_path):
    """The checkpoint keeps the adapter only (and ``lora.json``); resuming in the same
    layout is bit-identical on CPU, resuming in another (vision TP2, split ``qkv``) equals
    the reference; the merged export loads with ``from_pretrained`` and equals PEFT's
    ``merge_and_unload``; the adapter export (also ``ray-disagg export RUN OUT
    --adapter``) loads with ``PeftModel.from_pretrained`` and ``AutoPeftModel``."""
    from peft import AutoPeftModel, PeftModel, get_peft_model_state_dict
    from transformers import Qwen2_5_VLForConditionalGeneration as HF

    from ray_disagg import export_hf
    from ray_disagg.recipes.cli import main

    base, adapter, data = saved
    ref_losses, ref = reference
    spec = HFModelSpec(pretrained_path=base, peft_path=adapter)
    fsdp = lambda: vt(group(1), group(2, DataParallel(fsdp=True)))  # noqa: E731
    tp = lambda: vt(group(2, TensorParallel(size=2)), group(1))  # noqa: E731

    def fit(groups, steps, name, resume=None):
        loop = LOOP | {"max_steps": steps}
        return run_layout(spec, data, loop, groups(), tmp_path, name, local=True, resume=resume)

    first = fit(fsdp, 2, "first")
    state = checkpoint_state(first.checkpoint)
    assert state and not any(".base_layer." in k for k in state)  # the base is not saved
    assert os.path.isfile(os.path.join(first.checkpoint.path, "text", "lora.json"))
    same, straight = fit(fsdp, 3, "same", first.checkpoint), fit(fsdp, 3, "straight")
    a, b = checkpoint_state(same.checkpoint), checkpoint_state(straight.checkpoint)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert same.metrics["loss"] == straight.metrics["loss"]

    moved = fit(tp, 3, "moved", first.checkpoint)  # q/k/v split: lora_B by blocks
    assert moved.metrics["loss"] == pytest.approx(ref_losses[2], rel=1e-5)
    merged = export_hf(moved.checkpoint, tmp_path / "merged")
    want = copy.deepcopy(ref).merge_and_unload().state_dict()
    got = HF.from_pretrained(merged).state_dict()
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-5, msg=k)
    out = export_hf(moved.checkpoint, tmp_path / "adapter", merge_lora=False)
    loaded = PeftModel.from_pretrained(HF.from_pretrained(base), out)
    # as the field loads it: the base's path and class from adapter_config.json
    auto = AutoPeftModel.from_pretrained(out)
    # and from the command line, the run's latest checkpoint
    cli = main(["export", str(tmp_path / "moved"), str(tmp_path / "cli"), "--adapter"])
    want = get_peft_model_state_dict(ref)
    for model in (loaded, auto, PeftModel.from_pretrained(HF.from_pretrained(base), cli)):
        got = get_peft_model_state_dict(model)
        assert got.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-5, msg=k)

    full_spec = HFModelSpec(pretrained_path=base)
    with pytest.raises(ValueError, match="trained a LoRA adapter, but this run trains it in"):
        run_layout(full_spec, data, LOOP, fsdp(), tmp_path, "full", local=True,
                   resume=first.checkpoint)  # fmt: skip
    frozen = dataclasses.replace(group(1), trainable=False)
    full = run_layout(full_spec, data, LOOP | {"max_steps": 1}, vt(frozen, group(1)), tmp_path,
                      "full1", local=True)  # fmt: skip
    with pytest.raises(ValueError, match="trained in full, but this run trains a LoRA"):
        fit(fsdp, 2, "lora-on-full", full.checkpoint)
    with pytest.raises(ValueError, match="merge_lora=False: this checkpoint trained no LoRA"):
        export_hf(full.checkpoint, tmp_path / "nothing", merge_lora=False)
