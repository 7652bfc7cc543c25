"""Freezing parameters: a whole group (``ModuleGroup(trainable=False)``) or the parameters
under name prefixes (``ModuleGroup(freeze=["model.visual.blocks"])``).

Frozen parameters get ``requires_grad=False`` on the meta-device model, before any
parallel plan or FSDP2 wraps it: they get no gradient, no optimizer state and are left out
of clipping. An encoder group whose parameters are all frozen runs forward only (under
``no_grad``) and the LLM group sends it no gradients.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from ray_disagg.config.groups import ModuleGroup

__all__ = ["is_frozen", "apply_freeze", "frozen_parts"]


def _matches(name: str, prefixes) -> bool:
    """Whether ``name`` is one of ``prefixes`` or under one."""
    return any(name == p or name.startswith(p.rstrip(".") + ".") for p in prefixes)


def is_frozen(name: str, group: ModuleGroup) -> bool:
    """Whether parameter ``name`` (an HF name) is frozen in ``group``."""
    return not group.trainable or _matches(name, group.freeze)


def apply_freeze(model: nn.Module, group: ModuleGroup) -> int:
    """``requires_grad=False`` on ``group``'s frozen parameters; returns how many."""
    n = 0
    for name, p in model.named_parameters():
        if is_frozen(name, group):
            p.requires_grad_(False)
            n += 1
    return n


def frozen_parts(spec, groups: Mapping[str, ModuleGroup]) -> tuple[str, ...]:
    """On the driver: check every ``freeze`` prefix against the part's parameter names (a
    meta-device model, no memory) and return the parts whose parameters are all frozen.

    Raises ``ValueError`` naming the prefix (with example names) when it matches nothing,
    and when nothing at all would be trained."""
    adapter, out = spec.adapter, []
    for part, group in groups.items():
        if group.trainable and not group.freeze:
            continue  # nothing to check: no model built
        names = [n for n, _ in spec.meta_model(part).named_parameters()]
        for prefix in group.freeze:
            if not any(_matches(n, (prefix,)) for n in names):
                shown = sorted({".".join(n.split(".")[:3]) for n in names})[:6]
                raise ValueError(
                    f"groups[{part!r}].freeze: {prefix!r} matches none of the {part} part's "
                    f"parameters (names start with e.g. {shown})."
                )
        if all(is_frozen(n, group) for n in names):
            out.append(part)
    if set(out) == set(adapter.parts):
        raise ValueError(
            "Every parameter of every group is frozen (trainable=False / freeze): there is "
            "nothing to train."
        )
    return tuple(out)
