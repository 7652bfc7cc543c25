"""The messages the groups exchange in a step, typed.

Per step the LLM replica sends each encoder replica it shares samples with one
:class:`Inputs` (the encoder fields of those samples, per microbatch; for map-style data,
which every group holds, a :class:`SampleRef` per sample instead); per microbatch each
encoder replica sends the LLM replica :class:`Crossings` (the crossing tensors ride beside
the header on the pair's transfer tier), and the LLM replica answers with :class:`Grads`.
Every message names its :class:`StepKey`; a receiver checks it with :func:`expect`, so a
message of another step or microbatch is an error naming both, never silently used.

Example:
    >>> key = StepKey(step=3)
    >>> expect(Crossings(key=key, mb=1), Crossings, key, mb=1, receiver="text group")
    Crossings(key=StepKey(step=3, val_batch=None, rollout=False), mb=1)
    >>> str(StepKey(step=3, val_batch=0))
    'validation batch 0 at step 4'
    >>> str(StepKey(step=3, rollout=True))
    'rollout of step 4'
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["StepKey", "SampleRef", "Inputs", "Crossings", "Grads", "expect"]


@dataclass(frozen=True)
class StepKey:
    """Which step a message belongs to: training step ``step`` (0-based), or with
    ``val_batch`` the validation batch ``val_batch`` run at that step (step ``-1``: the
    reference model's pass before training); with ``rollout`` the forward-only pass that
    generates the step's completions (GRPO)."""

    step: int
    val_batch: int | None = None
    rollout: bool = False

    def __str__(self) -> str:
        if self.rollout:
            return f"rollout of step {self.step + 1}"
        if self.step < 0:  # before the first step: the reference's pass (worker.objective)
            return f"reference pass batch {self.val_batch}"
        if self.val_batch is None:
            return f"step {self.step + 1}"
        return f"validation batch {self.val_batch} at step {self.step + 1}"


@dataclass(frozen=True)
class SampleRef:
    """Sample ``index`` of the map-style dataset ``split`` (``"train"`` or
    ``"validation"``), which the encoder group reads itself: its pixels never pass through
    the LLM group (no copy, no transfer)."""

    index: int
    split: str = "train"


@dataclass(frozen=True)
class Inputs:
    """LLM replica -> encoder replica, once per step: per microbatch, the samples (their
    ``id`` and encoder fields, or a :class:`SampleRef`) that the encoder replica encodes
    for this LLM replica."""

    key: StepKey
    microbatches: list[list[dict]] = field(default_factory=list)


@dataclass(frozen=True)
class Crossings:
    """Encoder replica -> LLM replica, per microbatch: the header of the crossing tensors
    (image/video/audio embeddings, DeepStack features) of the samples of ``mb``."""

    key: StepKey
    mb: int


@dataclass(frozen=True)
class Grads:
    """LLM replica -> encoder replica, per microbatch: the header of the gradients of the
    crossing tensors it received for ``mb``."""

    key: StepKey
    mb: int


def expect(message, kind: type, key: StepKey, mb: int | None = None, *, receiver: str):
    """``message`` when it is a ``kind`` for ``key`` (and microbatch ``mb``), else a
    ``RuntimeError`` naming what arrived and what was expected."""
    got_mb = getattr(message, "mb", None)
    if isinstance(message, kind) and message.key == key and got_mb == mb:
        return message
    want = f"{kind.__name__} of {key}" + (f" microbatch {mb}" if mb is not None else "")
    raise RuntimeError(
        f"{receiver} expected {want} but got {message!r}; the groups' schedules diverged."
    )
