"""The driver's checks of a run whose objective generates its completions (GRPO's
rollouts on the training groups): what the family, the layout and the data must give
(each refusal a ``ValueError`` naming the fix)."""

from __future__ import annotations

from ray_disagg.config.groups import ContextParallel
from ray_disagg.config.loop import TrainLoopConfig
from ray_disagg.config.refusals import Refusal

__all__ = ["check_generation", "check_prompts"]


def check_generation(adapter, groups, cfg: TrainLoopConfig, model) -> None:
    """A run whose objective generates (``GRPO(rollouts="generate")``) can: the family
    generates, the LLM group does not split sequences over context-parallel ranks, and a
    tokenizer decodes the completions for the reward functions; else ``ValueError``
    naming the fix."""
    obj = cfg.objective
    if obj is None or not obj.generates:
        return
    where = "train_loop_config['objective'] GRPO(rollouts='generate')"
    if adapter.generation_refusal is not None:
        raise ValueError(
            f"{where}: the {adapter.model_type} family does not generate yet "
            f"({adapter.generation_refusal}); train on recorded rollouts (samples with "
            "completion_ids, rewards, truncated) or use a family that generates (see the "
            "support matrix)."
        )
    llm = groups[adapter.llm_part]
    if isinstance(llm.parallelism, ContextParallel):
        raise ValueError(
            f"{where}: the {adapter.llm_part} group's context parallelism splits each "
            "sequence over its ranks, and the decode loop needs each prompt whole with its "
            "KV cache on one rank; generate with TensorParallel or FSDP2 instead, or train "
            "on recorded rollouts."
        )
    if cfg.max_tokens_per_microbatch is not None:
        raise ValueError(
            f"{where}: max_tokens_per_microbatch plans each step from the samples' lengths, "
            "and a generated completion's length is known only once it is drawn; drop the "
            "budget (global_batch_size counts prompts)."
        )
    from ray_disagg.worker.rollout import load_tokenizer

    load_tokenizer(obj, model)


def check_prompts(obj, prompts: bool | None) -> None:
    """Prompts (a PromptProcessor stream, a recipe's ``prompts`` data) go with an
    objective that generates, and it with them (when the data say)."""
    generates = obj is not None and obj.generates
    if prompts is None or prompts == generates:
        return
    if prompts:
        raise Refusal(
            "datasets['train'] holds prompts to complete (a PromptProcessor stream) but "
            "train_loop_config's objective does not generate; set train_loop_config"
            "['objective']=ray_disagg.GRPO(reward_funcs=[...]).",
            recipe="data.train is of type 'prompts' but train_loop_config.objective does "
            "not generate; set train_loop_config.objective: {type: grpo, reward_funcs: "
            "[...]}.",
        )
    name = type(obj).__name__
    raise Refusal(
        f"train_loop_config['objective']={name} generates completions of prompts but "
        "datasets['train'] makes conversations with their answers; stream TRL prompt "
        "records (prompt, images, reward columns) through PromptProcessor(processor).",
        recipe=f"train_loop_config.objective {{type: {name.lower()}}} generates completions of "
        "prompts but data.train makes conversations with their answers; give TRL prompt "
        "records (prompt, images, reward columns) as data.train: {type: prompts, records: "
        "...}.",
    )
