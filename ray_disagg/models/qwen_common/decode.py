"""Generation with the Qwen VL families' LLM part: 3-D rope positions from HF's
``get_rope_index`` at the prefill (image and video tokens take their grid positions),
then each completion token at its row's next position, passed explicitly (HF's own
decode path keeps the offsets on the module between calls)."""

from __future__ import annotations

import torch

__all__ = ["QwenDecodeMixin"]


class QwenDecodeMixin:
    """Prefill and decode steps of a Qwen VL LLM part with a KV cache."""

    generation_refusal = None

    def prefill(self, module, batch, received, cache):
        model = module.model
        kwargs = self.llm_inputs(model, batch)
        rope = {k: kwargs.get(k) for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")
                if k in kwargs}  # fmt: skip
        positions, offsets = model.get_rope_index(
            kwargs["input_ids"], attention_mask=kwargs["attention_mask"],
            mm_token_type_ids=kwargs.get("mm_token_type_ids"), **rope,
        )  # fmt: skip
        out = model(**kwargs, position_ids=positions, cache=cache, use_cache=True,
                    mm_encoder_outputs=self.mm_encoder_outputs(received))  # fmt: skip
        mask = kwargs["attention_mask"]
        state = (mask, mask.sum(1) + offsets.view(-1).to(mask.device))
        return out.last_hidden_state[:, -1], state

    def decode_step(self, module, tokens, step, state, cache):
        mask, first = state
        mask = torch.cat([mask, mask.new_ones(len(tokens), 1)], 1)
        positions = (first + step).view(1, -1, 1).expand(3, -1, 1)
        out = module.model(input_ids=tokens.unsqueeze(1), attention_mask=mask,
                           position_ids=positions, cache=cache, use_cache=True)  # fmt: skip
        return out.last_hidden_state[:, -1], (mask, first)
