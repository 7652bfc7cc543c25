"""Checks of a parallel layout against the model, run on the driver before any worker
starts. Every error names the setting to change."""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Mapping

from ray_disagg.config.groups import (
    ContextParallel,
    DataParallel,
    ExpertParallel,
    ModuleGroup,
    SequenceParallel,
    TensorParallel,
)
from ray_disagg.config.loop import TrainLoopConfig
from ray_disagg.config.refusals import Refusal
from ray_disagg.launch.generation_checks import check_prompts
from ray_disagg.models import moe
from ray_disagg.parallel.tensor_parallel import vocab_rows
from ray_disagg.transport import TIERS


def validate_layout(adapter, groups: dict[str, ModuleGroup]) -> None:
    for part, group in groups.items():
        p = group.parallelism
        kind = type(p).__name__
        if isinstance(p, DataParallel):
            continue
        if isinstance(p, ExpertParallel):
            _check_experts(adapter, part, p, group)
            if p.tp == 1:
                continue
        if isinstance(p, TensorParallel) and p.fsdp and part != adapter.llm_part:
            raise ValueError(
                f"TensorParallel(fsdp=True) is supported for the LLM group "
                f"({adapter.llm_part!r}) only; for {part!r} use DataParallel(fsdp=True) or "
                "SequenceParallel(size=N, fsdp=True)."
            )
        allowed = adapter.sp_parts if isinstance(p, SequenceParallel) else adapter.tp_parts
        if isinstance(p, ContextParallel):
            allowed = adapter.cp_parts
        if isinstance(p, TensorParallel) and part != adapter.llm_part:
            allowed = allowed if adapter.tower_tp_plan(part) is not None else ()
        refusal = adapter.tp_refusals.get(part) if _is_tp(p) else None
        if refusal:
            raise ValueError(
                f"{kind} is not supported for the {part!r} group of {adapter.model_type}: "
                f"{refusal}. Shard it with FSDP2 instead: "
                f"parallelism=DataParallel(fsdp=True) for {part!r}."
            )
        if isinstance(p, SequenceParallel) and part in adapter.sp_refusals:
            raise ValueError(
                f"SequenceParallel is not supported for the {part!r} group of "
                f"{adapter.model_type}: {adapter.sp_refusals[part]}. Scale it with data "
                f"parallelism instead: parallelism='none' (or DataParallel(fsdp=True)) and "
                f"more workers for {part!r}."
            )
        if part not in allowed:
            raise ValueError(
                f"{kind} is not supported for the {part!r} group of {adapter.model_type}; "
                f"groups that support it: {list(allowed)}. Use 'none' (data parallel) or "
                f"another parallelism for {part!r}."
            )
        if isinstance(p, ContextParallel) and p.tp > 1 and adapter.cp_tp_refusal:
            raise ValueError(
                f"ContextParallel(size={p.size}, tp={p.tp}) is not supported for the {part!r} "
                f"group of {adapter.model_type}: {adapter.cp_tp_refusal}. Use "
                f"ContextParallel(size={p.size}, fsdp=True) (no tp), or "
                f"TensorParallel(size={p.tp}) without context parallelism."
            )
        _check_divides(adapter.head_counts(part), p, part)
        if part == adapter.llm_part:
            _check_vocab(adapter.vocab_size, p, part)


def _check_experts(adapter, part: str, p: ExpertParallel, group: ModuleGroup) -> None:
    text = getattr(adapter.config, "text_config", adapter.config)
    n = getattr(text, "num_experts", None)
    if part != adapter.llm_part or not n:
        raise ValueError(
            f"ExpertParallel is for the LLM group of a mixture-of-experts model; the "
            f"{part!r} group of {adapter.model_type} has no experts. Use 'none' (data "
            "parallel) or DataParallel(fsdp=True)."
        )
    if n % p.size:
        raise ValueError(
            f"ExpertParallel(size={p.size}) in the {part} group does not divide "
            f"num_experts={n}; choose a size that divides {n}."
        )
    if not group.trainable or group.freeze:
        # how deep backward goes would depend on whether a replica's samples have images,
        # so the expert all-to-alls of backward would run on some ranks only
        raise ValueError(
            f"ExpertParallel in the {part} group needs the whole group trainable (no "
            f"trainable=False, no freeze prefixes: got freeze={list(group.freeze)}); freeze "
            "the LLM with DataParallel or TensorParallel instead."
        )


def _is_tp(p) -> bool:
    return isinstance(p, TensorParallel) or getattr(p, "tp", 1) > 1


def validate_loop(adapter, cfg, attn_implementation: str = "sdpa") -> None:
    """The loop settings the model cannot train exactly with (packing, microbatches)."""
    if cfg.pack_sequences and attn_implementation.startswith("flash_attention"):
        raise ValueError(
            f"train_loop_config['pack_sequences']=True with HFModelSpec(attn_implementation="
            f"{attn_implementation!r}): transformers' flash attention finds packed samples "
            "only in a batch of one row, so the samples sharing a row would attend to each "
            "other. Use attn_implementation='sdpa' (packed rows get a block-diagonal mask) "
            "or pack_sequences=False."
        )
    if cfg.pack_sequences and adapter.packing_refusal:
        raise ValueError(
            f"train_loop_config['pack_sequences']=True is not supported for "
            f"{adapter.model_type}: {adapter.packing_refusal}. Train it unpacked "
            "(pack_sequences=False)."
        )
    if cfg.pack_sequences and adapter.router is not None:
        raise ValueError(
            f"train_loop_config['pack_sequences']=True with {adapter.model_type}'s router "
            "auxiliary loss (output_router_logits=True): the loss counts every real token of "
            "the global batch, and packed rows carry no attention mask to tell them from the "
            "padding. Use pack_sequences=False, or set text_config.output_router_logits=False."
        )
    moe.check_micro_batches(adapter.router, cfg.micro_batches, adapter.model_type)


def _degrees(p) -> list[tuple[str, int, str]]:
    """``(setting, degree, sizes)`` of a layout: its degree must divide the sizes named
    ``"all"``, ``"heads"`` (every head count) or ``"query heads"`` (those context
    parallelism splits, :data:`CP_SPLIT_HEADS`: it repeats KV heads that do not split, as
    grouped-query attention does anyway)."""
    if isinstance(p, ExpertParallel):
        return [(f"tp={p.tp}", p.tp, "all")]
    if isinstance(p, ContextParallel):
        cp = [(f"size x tp={p.size * p.tp}" if p.tp > 1 else f"size={p.size}", p.size * p.tp)]
        return [(*cp[0], "query heads")] + ([(f"tp={p.tp}", p.tp, "all")] if p.tp > 1 else [])
    return [(f"size={p.size}", p.size, "heads" if isinstance(p, SequenceParallel) else "all")]


CP_SPLIT_HEADS = ("num_attention_heads", "linear_num_key_heads")
"""The head counts context parallelism splits: the softmax layers' query heads (Ulysses)
and the linear-attention layers' key heads (Qwen3.5's Gated DeltaNet, split by heads)."""


def _applies(sizes: str, what: str) -> bool:
    if sizes == "query heads":
        return what in CP_SPLIT_HEADS
    return sizes == "all" or "heads" in what


def _check_divides(counts: dict[str, int], p, part: str) -> None:
    for setting, degree, sizes in _degrees(p):
        for what, value in counts.items():
            if _applies(sizes, what) and value % degree:
                raise ValueError(
                    f"{type(p).__name__}({setting}) in the {part} group does not divide "
                    f"{what}={value}; choose a degree that divides {value}."
                )


def _check_vocab(vocab: int, p, part: str) -> None:
    """A vocabulary the degree does not divide is split unevenly (``ceil(V / tp)`` rows a
    rank, the last rank's fewer); refused only when a rank would hold no row."""
    for setting, degree, sizes in _degrees(p):
        rows = vocab_rows(vocab, degree)
        if sizes == "all" and (degree - 1) * rows >= vocab:
            raise ValueError(
                f"{type(p).__name__}({setting}) in the {part} group leaves a rank without "
                f"vocabulary rows (vocab_size={vocab}, {rows} rows a rank); choose a degree d "
                f"with (d - 1) x ceil({vocab} / d) < {vocab}."
            )


def validate_groups(groups, adapter) -> dict[str, ModuleGroup]:
    parts = list(adapter.parts)
    if not isinstance(groups, Mapping):
        raise ValueError(f"groups must be a dict {{name: ModuleGroup}} over {parts}.")
    unknown = sorted(set(groups) - set(parts))
    if unknown:
        raise ValueError(
            f"Unknown module group(s) {unknown}; {adapter.model_type} has groups {parts}."
        )
    missing = [m for m in parts if m not in groups]
    if missing:
        raise ValueError(
            f"Missing module group(s) {missing}: give a ModuleGroup for each of {parts}."
        )
    for name, g in groups.items():
        if not isinstance(g, ModuleGroup):
            raise ValueError(f"groups[{name!r}] must be a ModuleGroup, got {type(g).__name__}.")
        if g.scaling_config.use_tpu:
            raise ValueError(
                f"groups[{name!r}]: ScalingConfig(use_tpu=True) is not supported (the groups "
                "train with torch on GPUs or CPUs); use use_gpu=True or the CPU."
            )
    return {m: groups[m] for m in parts}


def validate_transfer(transfer: str, groups) -> str:
    if transfer != "auto" and transfer not in TIERS:
        raise ValueError(f"transfer={transfer!r}: must be 'auto' or one of {TIERS}.")
    if transfer in ("nccl", "cuda_ipc") and not all(
        g.scaling_config.use_gpu for g in groups.values()
    ):
        raise ValueError(
            f"transfer={transfer!r} moves tensors between GPUs, but not every group has "
            "ScalingConfig(use_gpu=True); use transfer='auto', 'shm' or 'gloo'."
        )
    return transfer


def resolve_schedule(cfg: TrainLoopConfig, placement: str, kind: str, validated: bool):
    """Defaults that depend on the run: the schedule (1F1B for separate placement with
    several microbatches), ``max_in_flight`` and the assignment (``auto``: balanced
    when the driver reads every sample anyway to validate it, contiguous for Ray Data,
    unvalidated data and colocated placement, whose pairs share a device). ``kind``: the
    data's (``"map"``, ``"ray"`` or ``"stream"``, as ``layout.DataSpec``)."""
    k = cfg.micro_batches
    schedule = cfg.schedule or ("1f1b" if k > 1 and placement == "separate" else "sequential")
    in_flight = 1 if schedule == "sequential" else (cfg.max_in_flight or min(2, k))
    assignment = cfg.assignment
    if assignment == "auto":
        balanced = validated and placement == "separate" and kind == "map"
        assignment = "balanced" if balanced else "contiguous"
    elif assignment == "balanced" and kind == "ray":
        raise ValueError(
            "train_loop_config['assignment']='balanced' needs a map-style dataset (costs "
            "estimated before the run) or a ConversationStream (costs computed with each "
            "sample); a Ray Data dataset is read in order: use 'contiguous' (or 'auto')."
        )
    return dataclasses.replace(
        cfg, schedule=schedule, max_in_flight=in_flight, assignment=assignment
    )


def check_budget(cfg: TrainLoopConfig, kind: str, elastic) -> None:
    """Where token-budget batching (``max_tokens_per_microbatch``) runs: map-style data
    (whose sizes the driver reads before the run) or a conversation stream (each LLM
    leader fills its own microbatches); no patch cap on an elastic group (its steps
    would change with its size)."""
    if cfg.max_tokens_per_microbatch is None:
        return
    if kind == "ray":
        raise ValueError(
            "train_loop_config['max_tokens_per_microbatch'] fills each step from the "
            "samples' sizes, which a ray.data.Dataset split does not give its readers in "
            "step: pass a map-style dataset (ds.take_all()) or a ConversationStream, or "
            "drop the budget."
        )
    if cfg.max_patches_per_microbatch is not None and elastic:
        raise ValueError(
            "train_loop_config['max_patches_per_microbatch'] caps each encoder replica's "
            f"patches, so the steps would change with the elastic group(s) {list(elastic)}' "
            "size: drop the cap, or give the group a fixed num_workers."
        )


def resolve_rollouts(cfg: TrainLoopConfig, data) -> TrainLoopConfig:
    """``cfg`` with GRPO's ``rollouts="auto"`` decided by the data: replay the recorded
    completions the samples carry, else generate them."""
    obj = cfg.objective
    if getattr(obj, "rollouts", None) != "auto":
        return cfg
    obj = copy.copy(obj)
    object.__setattr__(obj, "rollouts", "recorded" if data.recorded else "generate")
    return dataclasses.replace(cfg, objective=obj)


def resolve_objective(cfg: TrainLoopConfig, data, lora, trained):
    """``cfg`` with its objective's reference model decided (``"auto"``: the LoRA-free
    model when it is the initial one, else a frozen copy), or ``ValueError`` naming the
    fix for what a per-sequence objective does not run with. ``data``: the run's
    ``DataSpec``; ``lora``: the parts under LoRA (``{part: PartLora}``); ``trained``: the
    parts that train."""
    obj = cfg.objective
    _check_pairs(obj, data.pairs)
    if obj is None:
        check_prompts(obj, data.prompts)
        return cfg
    name = type(obj).__name__
    cfg = resolve_rollouts(cfg, data)
    obj = cfg.objective
    check_prompts(obj, data.prompts)
    _check_iterations(cfg, data)
    if obj.needs_reference and obj.reference == "precompute" and data.kind != "map":
        raise ValueError(
            f"train_loop_config['objective']={name}(reference='precompute') reads map-style "
            "datasets (its pass covers every sample before training); use "
            "reference='copy' or 'adapters_disabled' with a stream or Ray Data."
        )
    if not obj.needs_reference or obj.reference not in ("auto", "adapters_disabled"):
        return cfg
    why = _adapters_not_reference(lora, trained)
    if obj.reference == "adapters_disabled" and why:
        raise ValueError(
            f"train_loop_config['objective']={name}(reference='adapters_disabled'): {why}, "
            "so the model without adapters is not the initial model; use "
            "reference='copy' (a frozen copy of the initial weights) or 'auto'."
        )
    obj = copy.copy(obj)
    object.__setattr__(obj, "reference", "copy" if why else "adapters_disabled")
    return dataclasses.replace(cfg, objective=obj)


def _check_iterations(cfg: TrainLoopConfig, data) -> None:
    """``num_iterations > 1`` repeats each global batch: map-style data in fixed batches,
    checkpoints where a batch's iterations end (a resumed run needs no log-probs of an
    unfinished batch)."""
    mu = cfg.objective.num_iterations
    if mu == 1:
        return
    where = f"train_loop_config['objective'] {type(cfg.objective).__name__}(num_iterations={mu})"
    if data.kind != "map" or cfg.max_tokens_per_microbatch is not None:
        raise ValueError(
            f"{where} trains several steps on each global batch, which needs a map-style "
            "dataset in fixed batches; pass a list of samples without "
            "max_tokens_per_microbatch, or set num_iterations=1."
        )
    for name in ("checkpoint_every", "max_steps"):  # the last step saves one too
        every = getattr(cfg, name)
        if every and every % mu:
            raise ValueError(
                f"{where} with {name}={every}: a checkpoint inside a batch's iterations "
                f"could not resume them; set {name} to a multiple of {mu}."
            )


def _adapters_not_reference(lora, trained) -> str:
    """Why disabling the adapters does not give the initial model ("": it does)."""
    full = [p for p in trained if p not in lora]
    if full:
        return f"the {full} part(s) train in full (no LoRA adapter)"
    for part, part_lora in lora.items():
        config = part_lora.config
        if part_lora.path is not None:
            return f"the {part} part starts from a saved adapter (HFModelSpec(peft_path=...))"
        if config.modules_to_save:
            return f"the {part} part trains modules_to_save {list(config.modules_to_save)}"
        if config.init_lora_weights is False:
            return f"the {part} part's lora_B starts non-zero (init_lora_weights=False)"
    return ""


def _check_pairs(obj, pairs: bool | None) -> None:
    """The data and the objective agree on what a sample is (when the data say)."""
    wants = obj is not None and "chosen_input_ids" in obj.sequence_keys
    if pairs is None or pairs == wants:
        return
    if pairs:
        raise Refusal(
            "datasets['train'] holds preference pairs (a PreferenceProcessor stream) but "
            "train_loop_config has no objective for them; set "
            "train_loop_config['objective']=ray_disagg.DPO(beta=0.1).",
            recipe="data.train is of type 'preference' but train_loop_config has no "
            "objective for pairs; set train_loop_config.objective: {type: dpo, beta: 0.1}.",
        )
    name = type(obj).__name__
    raise Refusal(
        f"train_loop_config['objective']={name} trains on preference pairs but "
        "datasets['train'] makes SFT samples; stream TRL preference records (prompt, "
        "chosen, rejected, images) through PreferenceProcessor(processor), or drop the "
        "objective.",
        recipe=f"train_loop_config.objective {{type: {name.lower()}}} trains on preference "
        "pairs but data.train makes SFT samples; give TRL preference records (prompt, chosen, "
        "rejected, images) as data.train: {type: preference, records: ...}, or set "
        "train_loop_config.objective: null.",
    )


def check_reference_resume(root: str, llm_part: str, cfg: TrainLoopConfig) -> None:
    """On the driver, before a resume with ``DPO(reference="precompute")``: the
    checkpoint under ``root`` holds the precomputed reference log-probs."""
    from ray_disagg.worker.shards import REFERENCE_LOGPS

    if getattr(cfg.objective, "reference", None) != "precompute":
        return
    if not os.path.isfile(os.path.join(root, llm_part, REFERENCE_LOGPS)):
        raise ValueError(
            "resume_from_checkpoint holds no precomputed reference log-probs (a run with "
            "DPO(reference='precompute') saves them with every checkpoint); resume with "
            "reference='copy', or start a new run."
        )
