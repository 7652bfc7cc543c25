"""Training objectives on the LLM's per-token log-probabilities: the interface the loops
call (:class:`Objective`, :class:`TokenLogps`), Direct Preference Optimization
(:class:`DPO`) and Group Relative Policy Optimization (:class:`GRPO`)."""

from __future__ import annotations

from typing import Any

from ray_disagg.objectives.base import Objective, TokenLogps
from ray_disagg.objectives.base import objective_from_any as _from_any
from ray_disagg.objectives.dpo import ANSWERS, DPO, PAIR_KEYS, same_prompt
from ray_disagg.objectives.grpo import GRPO

__all__ = [
    "ANSWERS",
    "DPO",
    "GRPO",
    "OBJECTIVES",
    "PAIR_KEYS",
    "Objective",
    "TokenLogps",
    "objective_from_any",
    "same_prompt",
]

OBJECTIVES = {"dpo": DPO, "grpo": GRPO}
"""The objectives a recipe names by ``type``."""


def objective_from_any(value: Any) -> Objective | None:
    """An :class:`Objective`, or one from a dict such as ``{"type": "dpo", "beta": 0.1}``
    (the recipe form); ``None`` (SFT) stays ``None``."""
    return _from_any(value, OBJECTIVES)
