"""What a family says about generating with its LLM part (GRPO's rollouts on the training
groups): the tokens that end a completion, and one prefill and one decode step with a
KV cache, given the crossings the encoders sent (:class:`GenerationHooks`, a base of
every adapter). The loop around them is :mod:`ray_disagg.rollout.decode`."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

__all__ = ["GenerationHooks"]


class GenerationHooks:
    """A family that generates overrides :meth:`prefill` and :meth:`decode_step` and
    sets :attr:`generation_refusal` to ``None``."""

    generation_refusal: ClassVar[str | None] = (
        "its prefill and decode step with a KV cache are not written yet"
    )
    """Why the family does not generate (``None``: it does)."""

    def stop_token_ids(self) -> tuple[int, ...]:
        """The tokens that end a completion: the text config's ``eos_token_id`` (one or
        several: a chat model's end-of-turn token among them)."""
        text = getattr(self.config, "text_config", self.config)
        eos = getattr(text, "eos_token_id", None)
        if eos is None:
            eos = getattr(self.config, "eos_token_id", None)
        if eos is None:
            return ()
        return tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))

    def prefill(self, module: nn.Module, batch: dict, received: dict, cache) -> tuple:
        """``(last hidden state of each row (n, H), state)`` of the LLM part ``module`` on
        a left-padded batch of prompts (:func:`ray_disagg.rollout.decode.left_padded`)
        with the crossings ``received``, filling ``cache``; ``state``: what
        :meth:`decode_step` needs (e.g. rope offsets)."""
        raise NotImplementedError(self.generation_refusal)

    def decode_step(self, module: nn.Module, tokens: torch.Tensor, step: int, state: Any,
                    cache) -> tuple[torch.Tensor, Any]:  # fmt: skip
        """``(hidden state (n, H), state)`` after feeding ``tokens`` ``(n,)``, the
        ``step``-th completion token of each row (from 0), extending ``cache``."""
        raise NotImplementedError(self.generation_refusal)
