"""Checks of a parallel layout against the model, run on the driver before any worker
starts. Every error names the setting to change."""

from __future__ import annotations

from ray_disagg.config import (
    ContextParallel,
    DataParallel,
    ModuleGroup,
    SequenceParallel,
    TensorParallel,
)
from ray_disagg.models import loading


def validate_layout(adapter, groups: dict[str, ModuleGroup]) -> None:
    llm = groups[adapter.llm_part].parallelism
    if isinstance(llm, TensorParallel) and llm.size > 1:
        tied = loading.tied_parameters(loading.meta_model(adapter))
        if tied:
            raise ValueError(
                f"This {adapter.model_type} model ties {sorted(tied)} to the input "
                "embedding (tie_word_embeddings), which TensorParallel does not support yet; "
                f"use DataParallel(fsdp=True) for the {adapter.llm_part!r} group."
            )
    for part, group in groups.items():
        p = group.parallelism
        kind = type(p).__name__
        if isinstance(p, DataParallel):
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
        if part not in allowed:
            raise ValueError(
                f"{kind} is not supported for the {part!r} group of {adapter.model_type}; "
                f"groups that support it: {list(allowed)}. Use 'none' (data parallel) or "
                f"another parallelism for {part!r}."
            )
        sizes = dict(adapter.head_counts(part))
        if isinstance(p, SequenceParallel | ContextParallel):
            sizes = {k: v for k, v in sizes.items() if "heads" in k}
        for what, value in sizes.items():
            if value % p.size:
                raise ValueError(
                    f"{kind}(size={p.size}) in the {part} group does not divide "
                    f"{what}={value}; choose a size that divides {value}."
                )
