"""The ``ray-disagg`` CLI and its recipes: parsing, overrides, errors and ``plan`` without
Ray; one ``train`` run of the bundled digits recipe on the shared Ray cluster."""

import math
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import ray
import torch

from ray_disagg import DisaggregatedTrainer, HFModelSpec, load_metrics, tiny_qwen2_5_vl_config
from ray_disagg.planner.memory import GiB, estimate, per_gpu
from ray_disagg.recipes.cli import main
from ray_disagg.recipes.recipe import (
    RecipeError,
    apply_overrides,
    bundled_recipes,
    load_recipe,
    trainer_kwargs,
)
from ray_disagg.testing.reference import reference_train
from tests.helpers import assert_params_close, checkpoint_state

ROOT = Path(__file__).resolve().parents[2]
BIG = "qwen2_5_vl_32b_8gpu"


@pytest.fixture
def no_ray(monkeypatch):
    """Parsing and planning must never start Ray."""

    def refuse(*args, **kwargs):
        raise AssertionError("ray.init called")

    monkeypatch.setattr(ray, "init", refuse)


def cli_error(capsys, *argv) -> str:
    """Run the CLI expecting a recipe error: exit status 2, one message, no traceback."""
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("ray-disagg: error: ") and "Traceback" not in err
    return err


def test_bundled_recipes_ship_and_console_script_exists():
    assert {"digits_cpu", BIG, "qwen3_vl_30b_a3b_8gpu"} <= set(bundled_recipes())
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["scripts"]["ray-disagg"] == "ray_disagg.recipes.cli:main"
    assert "recipes/*.yaml" in project["tool"]["setuptools"]["package-data"]["ray_disagg"]
    (entry,) = [e for e in metadata.entry_points(group="console_scripts") if e.name == "ray-disagg"]
    assert entry.value == "ray_disagg.recipes.cli:main" and entry.load() is main


def test_plan_digits(no_ray, capsys):
    text = main(["plan", "digits_cpu"])
    assert text == capsys.readouterr().out.rstrip("\n")
    assert "recipe digits_cpu: qwen2_5_vl, config (random init)" in text
    assert "placement: separate" in text and "transfer: auto" in text
    assert "validation digits (128 from #1600, 16 px)" in text
    rows = {line.split()[0]: line for line in text.splitlines() if '("dp"' in line}
    assert '("dp", "tp") = (1, 1)' in rows["vision"] and "none (data parallel)" in rows["text"]
    assert "per worker (MiB)" in text and "no GPUs" in text
    mem = estimate(load_recipe("digits_cpu"))
    for m in mem.values():  # fp32 AdamW: params = grads = optimizer / 2
        assert m.params == m.grads == m.optimizer / 2 > 0 and m.activations > 0


def test_plan_32b_offline(no_ray, capsys):
    text = main(["plan", BIG])
    assert "inline config: pretrained_path /path/to/Qwen2.5-VL-32B-Instruct" in text
    assert "vision 688.8M, text 32.76B" in text
    assert "colocated: 8 bundles of {'CPU': 8.0, 'GPU': 1.0}" in text
    assert re.search(r'SequenceParallel\(size=8\)\s+\("dp", "sp"\) = \(1, 8\)', text)
    assert re.search(r'TensorParallel\(size=8\)\s+\("dp", "tp"\) = \(1, 8\)', text)
    assert "1008x1008 px (72x72 = 5184 patches, 1296 tokens), seq_len 2048" in text
    gib = float(re.search(r"per GPU \(colocated bundle = vision \+ text\): ([\d.]+) GiB", text)[1])
    assert 20 < gib < 140

    r = load_recipe(BIG)
    cfg, mem = r.model.load_config(), estimate(r)
    assert cfg.text_config.rope_parameters["mrope_section"] == [16, 24, 24]
    assert cfg.vision_config.fullatt_block_indexes == [7, 15, 23, 31]
    text_total = sum(p.numel() for p in r.model.meta_model("text").parameters())
    # TP shards everything but the norms: a bit more than 1/8 per rank
    assert text_total / 8 < mem["text"].num_params < 1.01 * text_total / 8
    assert mem["vision"].num_params == 688_841_984  # SP replicates the tower
    assert mem["text"].optimizer == 2 * mem["text"].params  # fp32 AdamW
    assert per_gpu(r, mem)["bundle"] == pytest.approx(gib * GiB, rel=1e-3)


MOE = "qwen3_vl_30b_a3b_8gpu"


def test_plan_moe_counts_expert_shards(no_ray, capsys):
    """The bundled Qwen3-VL-30B-A3B recipe: experts over ExpertParallel(8), the dense
    weights over FSDP2(8); plan accepts it offline and it fits 80 GB GPUs."""
    text = main(["plan", MOE])
    assert "qwen3_vl_moe" in text and "text 30.53B" in text
    assert re.search(r'ExpertParallel\(size=8, fsdp=True\)\s+\("dp_shard", "tp"\) = \(8, 1\)', text)
    gib = float(re.search(r"per GPU \(colocated bundle = vision \+ text\): ([\d.]+) GiB", text)[1])
    assert 40 < gib < 80
    r = load_recipe(MOE)
    total = sum(p.numel() for p in r.model.meta_model("text").parameters())
    mem = estimate(r)
    assert mem["text"].num_params == pytest.approx(total / 8, rel=1e-6)  # all of it / 8
    ep2 = estimate(load_recipe(MOE, ["groups.text.parallelism.size=2"]))
    experts = sum(
        p.numel() for n, p in r.model.meta_model("text").named_parameters() if ".experts." in n
    )
    assert ep2["text"].num_params == pytest.approx(experts / 2 + (total - experts) / 8)


def test_plan_overrides_change_the_estimate(no_ray):
    base = estimate(load_recipe(BIG))
    frozen = estimate(load_recipe(BIG, ["groups.vision.trainable=false"]))
    assert frozen["vision"].grads == frozen["vision"].optimizer == 0
    assert frozen["vision"].params == base["vision"].params
    zero1 = estimate(load_recipe(BIG, ["groups.vision.parallelism.zero1=true"]))
    assert zero1["vision"].optimizer == pytest.approx(base["vision"].optimizer / 8)
    bf16 = estimate(load_recipe(BIG, ["train_loop_config.param_dtype=bfloat16"]))
    assert bf16["text"].params == pytest.approx(base["text"].params / 2)
    r = load_recipe(BIG, ["groups.vision.freeze=[model.visual.blocks]"])
    rest = sum(  # patch embedding + merger stay trainable
        p.numel()
        for n, p in r.model.meta_model("vision").named_parameters()
        if not n.startswith("model.visual.blocks.")
    )
    assert 0 < estimate(r)["vision"].grads == 4 * rest < 0.1 * base["vision"].grads
    no_ckpt = estimate(load_recipe(BIG, ["groups.text.activation_checkpointing=false"]))
    assert no_ckpt["text"].activations > 2 * base["text"].activations
    fsdp = load_recipe(BIG, ["groups.text.parallelism={type: tensor, size: 4, fsdp: true}"])
    assert '("dp_shard", "tp") = (2, 4)' in main(
        ["plan", BIG, "groups.text.parallelism.size=4", "groups.text.parallelism.fsdp=true"]
    )
    assert estimate(fsdp)["text"].params == pytest.approx(base["text"].params, rel=0.01)
    # context parallelism: the decoder's activations split over cp, the weights whole
    cp = load_recipe(BIG, ["groups.text.parallelism={type: context, size: 4, fsdp: true}"])
    assert type(cp.groups["text"].parallelism).__name__ == "ContextParallel"
    one = load_recipe(BIG, ["groups.text.parallelism={type: context, size: 1, fsdp: true}"])
    assert estimate(cp)["text"].activations < 0.5 * estimate(one)["text"].activations
    # cp x tp: a 3-D mesh, the weights sharded over tp, FSDP2 over dp x cp
    cptp = "groups.text.parallelism={type: context, size: 2, tp: 4, fsdp: true}"
    assert '("dp_shard", "cp", "tp") = (1, 2, 4)' in main(["plan", BIG, cptp])
    assert estimate(load_recipe(BIG, [cptp]))["text"].params == pytest.approx(
        base["text"].params, rel=0.01
    )


def test_overrides_are_dotted_yaml(no_ray):
    r = load_recipe(
        "digits_cpu",
        [
            "train_loop_config.max_steps=4",
            "train_loop_config.lr=1e-4",
            "groups.vision.trainable=false",
            "groups.text.lr_multiplier=0.5",
            "groups.text.parallelism={type: data, zero1: true}",
            "run_config.checkpoint.num_to_keep=1",
            "placement=colocated",
        ],
    )
    assert r.loop.max_steps == 4 and r.loop.lr == 1e-4 and isinstance(r.loop.lr, float)
    assert r.loop.lr_schedule == "cosine" and r.loop.eval_every == 10
    assert r.groups["vision"].trainable is False and r.groups["text"].lr_multiplier == 0.5
    assert r.groups["text"].parallelism.zero1 and r.placement == "colocated"
    assert r.run_config.checkpoint_config.num_to_keep == 1
    assert r.run_config.checkpoint_config.checkpoint_score_attribute == "val_loss"
    assert apply_overrides({"a": {"b": 1}}, ["a.c.d=[1, x]"]) == {
        "a": {"b": 1, "c": {"d": [1, "x"]}}
    }
    with pytest.raises(RecipeError, match=r"a\.b is 1, not a mapping"):
        apply_overrides({"a": {"b": 1}}, ["a.b.c=2"])
    with pytest.raises(RecipeError, match="must be key=value"):
        apply_overrides({}, ["max_steps"])


def test_model_sources(no_ray, tmp_path):
    inline = load_recipe("digits_cpu", ["model.config={preset: tiny_qwen2_5_vl, text_layers: 3}"])
    assert inline.model.load_config().text_config.num_hidden_layers == 3
    cfg = tiny_qwen2_5_vl_config()
    HFModelSpec(config=cfg).build_full().save_pretrained(tmp_path / "tiny")
    r = load_recipe("digits_cpu", [f"model.pretrained_path={tmp_path / 'tiny'}"], for_training=True)
    assert r.model.pretrained_path == str(tmp_path / "tiny")
    assert "pretrained weights from" in main(
        ["plan", "digits_cpu", f"model.pretrained_path={tmp_path / 'tiny'}"]
    )
    with pytest.raises(RecipeError, match=r"model\.pretrained_path=.*no config\.json"):
        load_recipe(BIG, for_training=True)  # train never falls back to the inline config


def test_data_sources_parse_without_loading(no_ray):
    r = load_recipe("digits_cpu", ["data.train={type: parquet, paths: s3://bucket/train}"])
    assert r.data["train"] == {"type": "parquet", "paths": "s3://bucket/train"}
    r = load_recipe(
        "digits_cpu",
        [
            "data.validation=null",
            "train_loop_config.eval_every=null",
            "run_config.checkpoint.score_attribute=null",
        ],
    )
    assert set(r.data) == {"train"}


@pytest.mark.parametrize(
    "argv,expected",
    [
        (["bogus=1"], ["recipe: unknown key(s) ['bogus']", "train_loop_config"]),
        (["groups.vision.num_workerz=2"], ["groups.vision", "'num_workerz'", "'num_workers'"]),
        (["groups.audio.num_workers=1"], ["groups", "'audio'", "['vision', 'text']"]),
        (
            ["groups.text.parallelism=pipeline"],
            ["groups.text.parallelism", "'sequence'", "'tensor'"],
        ),
        (
            ["groups.text.parallelism={type: tensor, sise: 2}"],
            ["groups.text.parallelism", "'sise'", "'size'"],
        ),
        (
            ["groups.text.parallelism={type: tensor, size: 3}"],
            ["groups.text", "size: 3", "num_workers=1"],
        ),
        (
            ["groups.vision.parallelism.size=2"],
            ["groups.vision.parallelism is 'none', not a mapping"],
        ),
        (["groups.vision.placement_strategy=TIGHT"], ["placement_strategy", "'STRICT_PACK'"]),
        (["groups.vision.freeze=[model.nothing]"], ["freeze", "'model.nothing'"]),
        (["placement=stacked"], ["placement='stacked'", "['separate', 'colocated']"]),
        (["placement=colocated", "groups.text.num_workers=2"], ["placement", "same num_workers"]),
        (["transfer=rdma"], ["transfer='rdma'", "'gloo'", "'cuda_ipc'"]),
        (["transfer=nccl"], ["transfer", "use_gpu=true"]),
        (["data.train.type=csv"], ["data.train", "'digits'", "'conversations'", "'parquet'"]),
        (["data.train.paths=x.parquet"], ["data.train", "'paths'", "'num_samples'"]),
        (["data.validation=null"], ["train_loop_config.eval_every", "data.validation"]),
        (["train_loop_config.lr_schedule=step"], ["lr_schedule", "'cosine'"]),
        (["train_loop_config.foo=1"], ["'foo'", "known keys"]),
        (["model.config=tiny_llama"], ["model.config='tiny_llama'", "tiny_qwen2_5_vl"]),
        (["model.config={hidden_size: 8}"], ["model.config", "model_type"]),
        (["run_config.checkpoint.order=up"], ["run_config.checkpoint.order", "['max', 'min']"]),
        (["plan.image_size=[1, 2, 3]"], ["plan.image_size", "[height, width]"]),
        (["train_loop_config.max_steps"], ["must be key=value"]),
    ],
)
def test_recipe_errors_name_the_key_and_the_allowed_values(no_ray, capsys, argv, expected):
    err = cli_error(capsys, "plan", "digits_cpu", *argv)
    for piece in expected:
        assert piece in err, (piece, err)


def test_32b_layout_errors(no_ray, capsys):
    err = cli_error(capsys, "plan", BIG, "groups.vision.parallelism.size=3")
    assert "groups.vision" in err and "size: 3" in err and "num_workers=8" in err
    err = cli_error(capsys, "plan", BIG, "groups.text.resources_per_worker={GPU: 1}")
    assert "placement" in err and "add up to 1.5" in err


def test_unknown_recipe_and_bad_yaml(no_ray, capsys, tmp_path):
    err = cli_error(capsys, "plan", "no_such_recipe")
    assert "no_such_recipe" in err and "digits_cpu" in err
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    assert "is not valid YAML" in cli_error(capsys, "plan", str(bad))
    # a missing file is an error, never a bundled recipe of the same name
    missing = str(tmp_path / "digits_cpu.yaml")
    assert "no such file" in cli_error(capsys, "plan", missing)
    # an override fills an empty (null) section
    assert apply_overrides({"plan": None}, ["plan.seq_len=32"]) == {"plan": {"seq_len": 32}}


def test_python_m_and_console_script_exit_codes():
    env = {**os.environ, "RAY_ADDRESS": ""}
    ok = subprocess.run(
        [sys.executable, "-m", "ray_disagg", "plan", "digits_cpu"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert ok.returncode == 0 and "per worker (MiB)" in ok.stdout
    script = Path(sys.executable).with_name("ray-disagg")
    bad = subprocess.run(
        [str(script), "plan", "digits_cpu", "placement=x"], capture_output=True, text=True, env=env
    )
    assert bad.returncode == 2 and "placement='x'" in bad.stderr
    assert "Traceback" not in bad.stderr and bad.stdout == ""


def test_train_digits_recipe_with_a_frozen_vision_group(ray_start_4_cpus, tmp_path, capsys):
    """``train`` in-process on the shared cluster (it must not call ray.init again), with
    the vision group frozen by an override: it never runs a backward pass, its weights
    stay the initial ones, and the text group equals the single-process run with the same
    freezing (losses, validation losses, parameters). The training data is a mixture of
    two digits sources with weights (a list in the recipe), with per-source metrics."""
    argv = [
        "digits_cpu",
        "train_loop_config.max_steps=3",
        "train_loop_config.global_batch_size=4",
        "train_loop_config.micro_batches=2",
        "train_loop_config.warmup_steps=1",
        "train_loop_config.eval_every=1",
        "train_loop_config.checkpoint_every=1",
        "data.train=[{name: low, weight: 0.7, type: digits, num_samples: 12},"
        " {name: high, weight: 0.3, type: digits, num_samples: 4, start: 100}]",
        "data.validation.num_samples=4",
        "groups.vision.trainable=false",
        "groups.vision.resources_per_worker={CPU: 0.5}",
        "groups.text.resources_per_worker={CPU: 0.5}",
        f"run_config.storage_path={tmp_path}",
        "run_config.name=cli-digits",
        "run_config.checkpoint={num_to_keep: null}",
    ]
    result = main(["train", *argv])
    metrics = result.metrics
    assert metrics["step"] == 3 and math.isfinite(metrics["loss"])
    assert result.checkpoint is not None and os.path.isdir(result.checkpoint.path)
    assert str(tmp_path) in result.checkpoint.path
    out = capsys.readouterr().out
    assert "per worker (MiB)" in out and "final metrics:" in out
    assert f"checkpoint: {result.checkpoint.path}" in out

    history = load_metrics(result)
    # the frozen vision group never ran a backward pass; the text group one per microbatch
    assert history["vision_backward_passes"].tolist() == [0, 0, 0]
    assert history["text_backward_passes"].tolist() == [2, 2, 2]
    assert history["vision_grad_norm"].tolist() == [0.0] * 3
    assert history["vision_lr"].tolist() == [0.0] * 3
    recipe = load_recipe(argv[0], argv[1:])
    kwargs = trainer_kwargs(recipe)
    data, val = kwargs["datasets"]["train"], kwargs["datasets"]["validation"]
    plan = DisaggregatedTrainer(**kwargs).plan  # the mixture's draws, in order
    ref_losses, _, ref_model, ref_val = reference_train(
        recipe.model, data, recipe.loop, groups=recipe.groups, val=val, plan=plan
    )
    drawn = [data[i]["source"] for s in range(3) for i in plan.global_indices(s)]
    assert {"low", "high"} <= set(drawn)
    for name in ("low", "high"):
        assert history[f"label_tokens/{name}"].sum() > 0 or name not in drawn
        assert f"loss/{name}" in history and f"epoch/{name}" in history
    for key, ref in (("loss", ref_losses), ("val_loss", ref_val)):
        got = torch.tensor(history[key].tolist())
        torch.testing.assert_close(got, torch.tensor(ref), rtol=1e-5, atol=0.0)
    state = checkpoint_state(result.checkpoint)
    initial = recipe.model.build_full().state_dict()
    assert all(torch.equal(state[k], initial[k]) for k in state if k.startswith("model.visual"))
    assert_params_close(state, ref_model.state_dict())
