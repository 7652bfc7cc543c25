"""Tier 1: bad input fails on the driver with a ValueError naming the fix (no worker starts)."""

import numpy as np
import pytest
from ray.train import ScalingConfig

from ray_disagg import (
    DisaggregatedTrainer,
    HFModelSpec,
    ModuleGroup,
    SampleError,
    SequenceParallel,
    TensorParallel,
    tiny_qwen2_5_omni_thinker_config,
    tiny_qwen2_5_vl_config,
)
from ray_disagg.data.examples import synthetic_samples
from ray_disagg.worker.standby import StandbyLoop

CFG = tiny_qwen2_5_vl_config()
DATA = synthetic_samples(CFG, 8)
LOOP = {"max_steps": 1, "global_batch_size": 4}


def g(n=1, parallelism="none"):
    return ModuleGroup(scaling_config=ScalingConfig(num_workers=n), parallelism=parallelism)


def make(groups=None, data=DATA, loop=LOOP, cfg=CFG):
    return DisaggregatedTrainer(
        model=HFModelSpec(config=cfg),
        groups={"vision": g(), "text": g()} if groups is None else groups,
        train_loop_config=loop,
        datasets={"train": data},
    )


def test_valid_setup_constructs():
    assert make().plan.steps_per_epoch == 2


def test_elastic_ranges_only_on_data_parallel_encoder_groups():
    elastic = ModuleGroup(scaling_config=ScalingConfig(num_workers=(1, 4)))
    loop = dict(LOOP, checkpoint_every=1)
    t = make({"vision": elastic, "text": g()}, loop=loop)
    assert t.elastic_sizes == {"vision": [1, 2, 4]} and t.groups["vision"].num_workers == 1
    args = t.loop_args(put=lambda x: x).at_sizes({"vision": 4})
    assert args.plan.dp_sizes == {"vision": 4, "text": 1}
    assert args.groups["vision"].num_workers == 4
    with pytest.raises(ValueError, match=r"on the LLM group.*Elastic groups can be \['vision'\]"):
        make({"vision": g(), "text": elastic}, loop=loop)
    sp = ModuleGroup(
        scaling_config=ScalingConfig(num_workers=(2, 4)), parallelism=SequenceParallel(size=2)
    )
    with pytest.raises(ValueError, match=r"its SequenceParallel degree cannot change.*be \[\]"):
        make({"vision": sp, "text": g()}, loop=loop)
    with pytest.raises(ValueError, match="colocated groups share their bundles"):
        DisaggregatedTrainer(
            model=HFModelSpec(config=CFG),
            groups={"vision": elastic, "text": g()},
            train_loop_config=loop,
            datasets={"train": DATA},
            placement="colocated",
        )


def test_standby_only_for_a_fixed_size_group_that_restarts_alone(monkeypatch):
    def standby(n=1, **kw):
        return ModuleGroup(scaling_config=ScalingConfig(num_workers=n), standby=True, **kw)

    loop = dict(LOOP, checkpoint_every=1)
    t = make({"vision": standby(), "text": g()}, loop=loop)
    assert t.standby == {"vision"}
    # the launch carries the standby's loop (kept out of Ray: no object is put)
    monkeypatch.setattr("ray_disagg.trainer._train_fn", lambda loop, backend: loop)
    launches = t._launch(t.loop_args(put=lambda x: x)).groups
    assert isinstance(launches["vision"].standby_fn_ref, StandbyLoop)
    assert launches["text"].standby_fn_ref is None
    with pytest.raises(ValueError, match=r"on the 'text' group: it cannot restart alone here "):
        make({"vision": g(), "text": standby()}, loop=loop)
    with pytest.raises(ValueError, match="set checkpoint_every"):
        make({"vision": standby(), "text": g()})
    elastic = ModuleGroup(scaling_config=ScalingConfig(num_workers=(1, 2)), standby=True)
    with pytest.raises(ValueError, match="an elastic group restarts at a size known only"):
        make({"vision": elastic, "text": g()}, loop=loop)
    with pytest.raises(ValueError, match="colocated groups restart into the bundles"):
        DisaggregatedTrainer(
            model=HFModelSpec(config=CFG),
            groups={"vision": standby(), "text": g()},
            train_loop_config=loop,
            datasets={"train": DATA},
            placement="colocated",
        )
    with pytest.raises(ValueError, match=r"standby='yes'\): must be True or False"):
        ModuleGroup(scaling_config=ScalingConfig(num_workers=1), standby="yes")


def test_unknown_group_name():
    with pytest.raises(ValueError, match=r"Unknown module group\(s\) \['audio'\]"):
        make({"vision": g(), "text": g(), "audio": g()})


def test_missing_group():
    with pytest.raises(ValueError, match=r"Missing module group\(s\) \['vision'\]"):
        make({"text": g()})


def test_group_must_be_module_group():
    with pytest.raises(ValueError, match=r"groups\['text'\] must be a ModuleGroup"):
        make({"vision": g(), "text": ScalingConfig(num_workers=1)})


def test_tpu_groups_are_refused():
    tpu = ModuleGroup(scaling_config=ScalingConfig(num_workers=1, use_tpu=True, topology="2x2",
                                                   accelerator_type="TPU-V4"))  # fmt: skip
    with pytest.raises(ValueError, match=r"groups\['vision'\]: ScalingConfig\(use_tpu=True\)"):
        make({"vision": tpu, "text": g()})


def test_global_batch_not_divisible_by_dp():
    with pytest.raises(
        ValueError, match="not divisible by the vision group's data-parallel size 3"
    ):
        make({"vision": g(3), "text": g()})


def test_image_token_mismatch_names_the_sample():
    bad = list(DATA)
    bad[5] = dict(bad[5], input_ids=bad[5]["input_ids"][:-2], labels=None, id="img-0005")
    bad[5]["input_ids"] = np.concatenate([bad[5]["input_ids"], [CFG.image_token_id]])
    with pytest.raises(SampleError, match="sample 'img-0005'"):
        make(data=bad)


def test_empty_dataset_and_missing_train_split():
    with pytest.raises(ValueError, match="is empty"):
        make(data=[])
    with pytest.raises(ValueError, match=r'datasets=\{"train": \.\.\.\} is required'):
        DisaggregatedTrainer(
            model=HFModelSpec(config=CFG),
            groups={"vision": g(), "text": g()},
            train_loop_config=LOOP,
            datasets={},
        )


def test_sp_size_must_divide_vision_heads():
    cfg = tiny_qwen2_5_vl_config(vision_heads=2, vision_hidden=32)
    with pytest.raises(ValueError, match="SequenceParallel\\(size=4\\).*vision num_heads=2"):
        make({"vision": g(4, SequenceParallel(size=4)), "text": g()}, cfg=cfg)


def test_tp_size_must_divide_kv_heads():
    with pytest.raises(ValueError, match="TensorParallel\\(size=4\\).*num_key_value_heads=2"):
        make({"vision": g(), "text": g(4, TensorParallel(size=4))})


def test_sp_not_for_text_group():
    with pytest.raises(
        ValueError,
        match=r"SequenceParallel is not supported for the 'text' group of qwen2_5_vl; "
        r"groups that support it: \['vision'\]",
    ):
        make({"vision": g(), "text": g(2, SequenceParallel(size=2))})


def test_groups_are_the_families_parts():
    cfg = tiny_qwen2_5_omni_thinker_config()
    data = synthetic_samples(cfg, 8, grids=[{"audios": [20]}, (1, 4, 4)])
    with pytest.raises(ValueError, match=r"Missing module group\(s\) \['audio'\]"):
        DisaggregatedTrainer(
            model=HFModelSpec(config=cfg),
            groups={"vision": g(), "text": g()},
            train_loop_config=LOOP,
            datasets={"train": data},
        )
    with pytest.raises(ValueError, match="TensorParallel is not supported for the 'audio' group"):
        DisaggregatedTrainer(
            model=HFModelSpec(config=cfg),
            groups={"vision": g(), "audio": g(2, TensorParallel(size=2)), "text": g()},
            train_loop_config=LOOP,
            datasets={"train": data},
        )
    trainer = DisaggregatedTrainer(
        model=HFModelSpec(config=cfg),
        groups={"vision": g(2), "audio": g(), "text": g(2)},
        train_loop_config=LOOP,
        datasets={"train": data},
    )
    assert trainer.plan.dp_sizes == {"vision": 2, "audio": 1, "text": 2}


def test_spec_needs_config_or_local_path(tmp_path):
    with pytest.raises(ValueError, match="exactly one of config= or pretrained_path="):
        HFModelSpec()
    with pytest.raises(ValueError, match="has no config.json"):
        HFModelSpec(pretrained_path=tmp_path)


def test_resume_from_a_directory_without_shards_is_a_clear_error(tmp_path):
    from ray_disagg.worker.shards import read_full

    with pytest.raises(ValueError, match="no DCP .metadata"):
        read_full(str(tmp_path))


def test_resume_from_checkpoint_must_be_a_checkpoint():
    with pytest.raises(ValueError, match="must be a ray.train.Checkpoint"):
        DisaggregatedTrainer(
            model=HFModelSpec(config=CFG),
            groups={"vision": g(), "text": g()},
            train_loop_config=LOOP,
            datasets={"train": DATA},
            resume_from_checkpoint="/tmp/some/dir",
        )


def test_fractional_gpu_refused_for_separate_placement():
    half = ScalingConfig(num_workers=2, use_gpu=True, resources_per_worker={"GPU": 0.5})
    whole = ScalingConfig(num_workers=1, use_gpu=True)
    groups = {"vision": ModuleGroup(scaling_config=half), "text": ModuleGroup(scaling_config=whole)}
    with pytest.raises(ValueError, match=r"The vision group .*'GPU': 0\.5.*placement='colocated'"):
        make(groups)


def test_2026_families_refuse_what_they_cannot_train_exactly():
    """The MoE auxiliary loss over the global batch needs one microbatch and unpacked
    rows; Qwen3.5 (linear attention run per packed sample) packs."""
    from ray_disagg import DataParallel, tiny_qwen3_5_config, tiny_qwen3_vl_moe_config

    q35, moe = tiny_qwen3_5_config(), tiny_qwen3_vl_moe_config()
    data35, data_moe = synthetic_samples(q35, 8), synthetic_samples(moe, 8)
    packed = dict(LOOP, pack_sequences=True, max_seq_len=256)
    assert make(data=data35, loop=packed, cfg=q35).loop_config.pack_sequences
    with pytest.raises(ValueError, match=r"pack_sequences.*router auxiliary loss"):
        make(data=data_moe, loop=packed, cfg=moe)
    with pytest.raises(ValueError, match=r"micro_batches'\]=2.*micro_batches=1"):
        make(data=data_moe, loop=dict(LOOP, micro_batches=2), cfg=moe)
    fsdp = {"vision": g(), "text": g(2, DataParallel(fsdp=True))}
    assert make(fsdp, data=data35, cfg=q35).plan.micro_batches == 1
    no_aux = tiny_qwen3_vl_moe_config(output_router_logits=False)
    assert make(data=data_moe, loop=dict(LOOP, micro_batches=2), cfg=no_aux)


def test_qwen3_5_text_tp_must_divide_the_linear_attention_key_heads():
    """Qwen3.5's Gated DeltaNet layers are sharded by key heads (the value heads grouped
    with them): a text tp degree that does not divide ``linear_num_key_heads`` fails on
    the driver naming the setting and the fix, in the dense and the MoE family, with
    TensorParallel and ExpertParallel's tp; one that divides it constructs."""
    from ray_disagg import ExpertParallel, tiny_qwen3_5_config, tiny_qwen3_5_moe_config

    tp2 = {"vision": g(), "text": g(2, TensorParallel(size=2))}
    for cfg in (tiny_qwen3_5_config(), tiny_qwen3_5_moe_config()):
        data = synthetic_samples(cfg, 8)
        assert make(tp2, data=data, cfg=cfg).plan.steps_per_epoch == 2
        text = cfg.text_config  # 3 key heads, each with 2 value heads; all else divides
        text.linear_num_key_heads, text.linear_num_value_heads = 3, 6
        with pytest.raises(
            ValueError,
            match=r"TensorParallel\(size=2\) in the text group does not divide "
            r"linear_num_key_heads=3; choose a degree that divides 3\.",
        ):
            make(tp2, data=data, cfg=cfg)
    ep = {"vision": g(), "text": g(4, ExpertParallel(size=2, tp=2))}
    with pytest.raises(ValueError, match=r"ExpertParallel\(tp=2\) .* linear_num_key_heads=3"):
        make(ep, data=data, cfg=cfg)


def test_expert_parallel_degree_must_divide_the_experts():
    from ray_disagg import ExpertParallel, tiny_qwen3_vl_moe_config

    moe = tiny_qwen3_vl_moe_config(num_experts=6)
    data = synthetic_samples(moe, 8)
    ep4 = {"vision": g(), "text": g(4, ExpertParallel(size=4))}
    with pytest.raises(ValueError, match=r"ExpertParallel\(size=4\).*num_experts=6"):
        make(ep4, data=data, cfg=moe, loop=dict(LOOP, global_batch_size=8))
    dense = {"vision": g(), "text": g(2, ExpertParallel(size=2))}
    with pytest.raises(ValueError, match=r"qwen2_5_vl has no experts"):
        make(dense)
    with pytest.raises(ValueError, match=r"ExpertParallel\(size=2\) must divide.*num_workers=3"):
        g(3, ExpertParallel(size=2))
    frozen = ModuleGroup(
        scaling_config=ScalingConfig(num_workers=2),
        parallelism=ExpertParallel(size=2),
        freeze=["model.language_model.layers.0"],
    )
    with pytest.raises(ValueError, match=r"needs the whole group trainable.*layers.0"):
        make({"vision": g(), "text": frozen}, data=synthetic_samples(moe, 8), cfg=moe)


@pytest.mark.parametrize("model_type", ["gemma3", "internvl", "llava_onevision"])
def test_tile_towers_take_sequence_parallel_of_whole_tiles(model_type):
    """Tile SP splits a microbatch's tiles, not heads: any size is accepted (3 does not
    divide the tiny towers' 4 heads), beside text TP."""
    from ray_disagg import ADAPTERS

    cfg = ADAPTERS[model_type].tiny_config()
    data = synthetic_samples(cfg, 8)
    for size in (2, 3):
        sp = {"vision": g(size, SequenceParallel(size=size)), "text": g()}
        assert make(sp, data=data, cfg=cfg).plan is not None
    tp = {"vision": g(2), "text": g(2, TensorParallel(size=2))}  # tied embeddings too
    assert make(tp, data=data, cfg=cfg).plan is not None


def test_flash_attention_with_packing_is_refused():
    """transformers' flash attention keeps packed samples apart only in one-row batches."""
    packed = dict(LOOP, pack_sequences=True, max_seq_len=256)
    with pytest.raises(ValueError, match=r"pack_sequences.*flash_attention_2.*'sdpa'"):
        DisaggregatedTrainer(
            model=HFModelSpec(config=CFG, attn_implementation="flash_attention_2"),
            groups={"vision": g(), "text": g()},
            train_loop_config=packed,
            datasets={"train": DATA},
        )


def test_samples_shorter_than_the_cp_degree_are_refused_on_the_driver():
    """Training and validation samples alike, naming the sample."""
    from ray_disagg import ContextParallel

    groups = {"vision": g(), "text": g(4, ContextParallel(size=4))}
    text = synthetic_samples(CFG, 1, grids=[None])[0]
    short = {"id": "tiny", "input_ids": text["input_ids"][:3], "labels": text["labels"][:3]}
    with pytest.raises(ValueError, match="sample 'tiny' has 3 tokens, fewer than the LLM"):
        make(groups, data=[short, *DATA[1:]])
    with pytest.raises(ValueError, match="sample 'tiny' has 3 tokens, fewer than the LLM"):
        DisaggregatedTrainer(
            model=HFModelSpec(config=CFG),
            groups=groups,
            train_loop_config={**LOOP, "eval_every": 1},
            datasets={"train": DATA, "validation": [short, *DATA[1:4]]},
        )


def test_a_vocabulary_tp_does_not_divide_is_split_unless_a_rank_would_get_no_row():
    from ray_disagg.launch.checks import _check_vocab

    for vocab, tp in [(151674, 4), (151674, 8), (135, 2), (135, 4)]:  # InternVL3's, ours
        _check_vocab(vocab, TensorParallel(size=tp), "text")
    with pytest.raises(ValueError, match=r"TensorParallel\(size=4\).*without vocabulary rows"):
        _check_vocab(5, TensorParallel(size=4), "text")  # 2 + 2 + 1 + 0 rows
