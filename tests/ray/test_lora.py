"""Tier 3, one Ray run with LoRA: the groups as Ray Train worker groups (vision 1, text 1,
packed rows, validation every step) from a saved PEFT adapter directory equal
single-process Hugging Face + PEFT (losses, trained adapter under PEFT's keys, merged
weights). The other layouts, vision SP2 + text TP2 packed among them, are in the gloo tier
(``tests/gloo/test_lora.py``)."""

from ray_disagg import HFModelSpec, TrainLoopConfig
from ray_disagg.testing.reference import reference_train_peft
from tests.helpers import group, run_layout, vt
from tests.lora_data import assert_matches_peft, save_base_and_adapter

LOOP = {"global_batch_size": 4, "max_steps": 2, "checkpoint_every": 1, "eps": 1e-6, "seed": 3}


def test_lora_packed_on_ray_equals_hf_peft(ray_start_4_cpus, tmp_path):
    base, adapter = tmp_path / "base", tmp_path / "adapter"
    data = save_base_and_adapter(base, adapter)
    spec = HFModelSpec(pretrained_path=base, peft_path=adapter)
    loop = LOOP | {"pack_sequences": True, "max_seq_len": 128, "eval_every": 1}
    groups = vt(group(1), group(1))
    result = run_layout(spec, data, loop, groups, tmp_path, "lora", validation=data[:4])
    ref_losses, ref = reference_train_peft(spec, adapter, data, TrainLoopConfig(**LOOP))
    assert_matches_peft(result, ref_losses, ref, base, adapter)
    assert result.metrics_dataframe["val_loss"].notna().all()
