"""Tier 1: the support matrix is what the adapters declare and what the driver does.
The README's table equals the generated one; every "yes" cell is a layout the driver's
checks accept (a generating GRPO for the generation column) and every refusal is the
``ValueError`` they raise, naming its reason;
``ray-disagg plan`` prints the recipe family's row."""

import functools
from pathlib import Path

import pytest
from ray.train import ScalingConfig

from ray_disagg import (
    ADAPTERS,
    ContextParallel,
    ModuleGroup,
    SequenceParallel,
    TensorParallel,
)
from ray_disagg.config.loop import TrainLoopConfig
from ray_disagg.launch.checks import validate_layout, validate_loop
from ray_disagg.launch.generation_checks import check_generation
from ray_disagg.models import get_adapter
from ray_disagg.models.support import BEGIN, END, family_checks, support_markdown

README = Path(__file__).resolve().parents[2] / "README.md"
KINDS = {
    "encoder SP": SequenceParallel,
    "encoder TP": TensorParallel,
    "LLM TP": TensorParallel,
    "LLM CP": ContextParallel,
}


def test_the_readme_matrix_is_the_generated_one():
    text = README.read_text()
    table = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert table == support_markdown(), (
        "README.md's support matrix is stale: python -m ray_disagg.models.support --write README.md"
    )


@pytest.mark.parametrize("model_type", sorted(ADAPTERS))
def test_every_cell_is_what_the_driver_does(model_type):
    adapter = get_adapter(ADAPTERS[model_type].tiny_config())
    one = ScalingConfig(num_workers=1)
    packed = TrainLoopConfig(max_steps=1, global_batch_size=2, pack_sequences=True, max_seq_len=64)
    for check in family_checks(ADAPTERS[model_type]):
        groups = {p: ModuleGroup(scaling_config=one) for p in adapter.parts}
        if check.column == "packing":
            if check.condition:  # the MoE families' router auxiliary loss off
                adapter.config.text_config.output_router_logits = False
            run = functools.partial(validate_loop, adapter, packed)
        elif check.column == "generation":
            run = functools.partial(check_generation, adapter, groups, generating(), None)
        else:
            groups[check.part] = ModuleGroup(
                scaling_config=ScalingConfig(num_workers=2),
                parallelism=KINDS[check.column](size=2),
            )
            run = functools.partial(validate_layout, adapter, groups)
        if check.refusal is None:
            run()
            if check.column == "LLM CP" and check.condition:  # with tp > 1: refused
                groups[check.part].parallelism = ContextParallel(size=2, tp=2)
                with pytest.raises(ValueError, match=r"ContextParallel\(size=2, tp=2\) is not"):
                    run()
        else:
            refused = "does not generate yet" if check.column == "generation" else "not supported"
            with pytest.raises(ValueError, match=refused) as e:
                run()
            assert check.refusal in str(e.value), (check, str(e.value))


def reward(prompts, completions, **kwargs):
    return [0.0 for _ in completions]


@functools.cache
def generating() -> TrainLoopConfig:
    """A loop whose GRPO generates (a tokenizer saved here)."""
    import tempfile

    from ray_disagg import GRPO
    from ray_disagg.data.examples import save_word_tokenizer

    obj = GRPO(reward_funcs=[reward], num_generations=2, rollouts="generate",
               tokenizer=save_word_tokenizer(tempfile.mkdtemp()))  # fmt: skip
    return TrainLoopConfig(max_steps=1, global_batch_size=2, objective=obj)


def test_plan_prints_the_family_row():
    from ray_disagg.recipes.cli import plan

    text = plan("digits_cpu", ["train_loop_config.max_steps=4"])
    assert "support (qwen2_5_vl): groups `vision`, `text`; media images, videos;" in text
