"""Checks of a parallel layout against the model config, run on the driver before any
worker starts. Every error names the setting to change."""

from __future__ import annotations

from ray_disagg.config import DataParallel, ModuleGroup, SequenceParallel, TensorParallel


def _divides(size: int, value: int, what: str, kind: str, group: str) -> None:
    if value % size:
        raise ValueError(
            f"{kind}(size={size}) in the {group} group does not divide {what}={value}; "
            f"choose a size that divides {value}."
        )


def validate_layout(hf_config, groups: dict[str, ModuleGroup]) -> None:
    v, t = hf_config.vision_config, hf_config.text_config
    vp, tp = groups["vision"].parallelism, groups["text"].parallelism
    if isinstance(vp, SequenceParallel):
        _divides(vp.size, v.num_heads, "vision num_heads", "SequenceParallel", "vision")
    elif isinstance(vp, TensorParallel):
        _divides(vp.size, v.num_heads, "vision num_heads", "TensorParallel", "vision")
        _divides(
            vp.size, v.intermediate_size, "vision intermediate_size", "TensorParallel", "vision"
        )
    elif not isinstance(vp, DataParallel):
        raise ValueError(f"Unsupported vision parallelism {vp!r}.")
    if isinstance(tp, SequenceParallel):
        raise ValueError(
            "SequenceParallel is for the vision group; use TensorParallel(size=N) or "
            "'none' for the text group."
        )
    if isinstance(tp, TensorParallel):
        _divides(tp.size, t.num_attention_heads, "num_attention_heads", "TensorParallel", "text")
        _divides(tp.size, t.num_key_value_heads, "num_key_value_heads", "TensorParallel", "text")
        _divides(tp.size, t.intermediate_size, "intermediate_size", "TensorParallel", "text")
        _divides(tp.size, t.vocab_size, "vocab_size", "TensorParallel", "text")
