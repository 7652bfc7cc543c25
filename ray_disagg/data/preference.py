"""Preference pairs in TRL's conversational format through the model's chat template and
processors: one record becomes one DPO sample (``ray_disagg.DPO``).

A record (JSON list, JSON Lines or parquet; image paths relative to ``media_root`` or
absolute), as ``trl.DPOTrainer`` takes it::

    {"id": "p1",
     "prompt": [{"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": "Which digit?"}]}],
     "chosen": [{"role": "assistant", "content": "A seven."}],
     "rejected": [{"role": "assistant", "content": "A two."}],
     "images": ["a.png"]}

The prompt's ``{"type": "image"}`` parts take ``images`` in order (a part may also name
its file itself, ``{"type": "image", "image": "a.png"}``). Each answer is rendered after
the prompt by the tokenizer's chat template; its labels are the answer's tokens and its
end-of-turn token, never the prompt's (:class:`ConversationProcessor` with
``labels="last"``). The images are processed once for both answers, and the prompt must
come out as the same tokens in both sequences.

Example:
    >>> pairs = PreferenceProcessor(ConversationProcessor(  # doctest: +SKIP
    ...     tokenizer=tok, image_processor=ip, config=cfg, media_root="images"))
    >>> sample = pairs(read_records("pairs.jsonl")[0])  # doctest: +SKIP
"""

from __future__ import annotations

import copy
from typing import Any

from ray_disagg.data.conversations import ConversationProcessor
from ray_disagg.data.prompts import prompt_messages
from ray_disagg.data.records import MEDIA, to_messages
from ray_disagg.objectives import ANSWERS, same_prompt

__all__ = ["PreferenceProcessor", "sequence_lengths"]

SFT_KEYS = ("messages", "conversations")


def sequence_lengths(sample: dict) -> list[int]:
    """Tokens of each LLM sequence of a sample: a DPO pair's two, else its one."""
    if "chosen_input_ids" in sample:
        return [len(sample[f"{a}_input_ids"]) for a in ANSWERS]
    return [len(sample["input_ids"])]


def _text(content) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.get("text") or "" for p in content if p.get("type") == "text")


class PreferenceProcessor:
    """Turns one TRL preference record into a DPO sample: the prompt's media fields and
    ``chosen_input_ids`` / ``chosen_labels`` / ``rejected_input_ids`` /
    ``rejected_labels`` (``ValueError`` naming the record and the fix for a bad one).

    Args:
        processor: the family's :class:`ConversationProcessor` (tokenizer, image / video
            / audio processors, ``media_root``, ``system_prompt``); its ``labels`` mode is
            not used (the labels are the answers).
    """

    def __init__(self, processor: ConversationProcessor):
        self.processor = copy.copy(processor)
        self.processor.labels = "last"

    @property
    def config(self):
        """The model's config (what :class:`~ray_disagg.data.stream.ConversationStream`
        reads of a processor)."""
        return self.processor.config

    def __call__(self, record: dict) -> dict[str, Any]:
        rid = record.get("id")
        prompt = self._prompt(record, rid)
        answers = [self._answer(record, a, rid) for a in ANSWERS]
        if _text(answers[0][0]["content"]).strip() == _text(answers[1][0]["content"]).strip():
            raise ValueError(f"record {rid!r}: chosen and rejected are the same answer")
        model_type = self.config.model_type
        variants, media = [], None
        for answer in answers:
            messages, media = to_messages({"id": rid, "messages": prompt + answer}, model_type)
            variants.append(messages)
        chosen, rejected = self.processor.encode_variants(rid, variants, media)
        pair = {k: v for k, v in chosen.items() if k not in ("input_ids", "labels")}
        for name, sample in zip(ANSWERS, (chosen, rejected)):
            pair[f"{name}_input_ids"] = sample["input_ids"]
            pair[f"{name}_labels"] = sample["labels"]
        if not same_prompt(pair):
            raise ValueError(
                f"record {rid!r}: the chat template renders the prompt differently before "
                "the two answers (it depends on the answer); the pair cannot share one prompt"
            )
        return pair

    def _prompt(self, record: dict, rid) -> list[dict]:
        """The prompt's messages with each media part naming its file."""
        if any(k in record for k in SFT_KEYS) and "prompt" not in record:
            raise ValueError(
                f"record {rid!r} is a conversation (SFT) record, not a preference pair "
                "(prompt, chosen, rejected); train it without the DPO objective"
            )
        for key in ("prompt", *ANSWERS):
            value = record.get(key)
            if not isinstance(value, list) or not value:
                raise ValueError(
                    f"record {rid!r}: {key!r} must be a non-empty list of messages (TRL's "
                    f"conversational preference format), got {value!r}"
                )
        return prompt_messages(record, rid)

    @staticmethod
    def _answer(record: dict, key: str, rid) -> list[dict]:
        answer = record[key]
        if len(answer) != 1 or answer[0].get("role") != "assistant":
            roles = [m.get("role") for m in answer]
            raise ValueError(
                f"record {rid!r}: {key!r} must hold exactly the assistant's answer (one "
                f"message with role 'assistant'), got roles {roles}"
            )
        content = answer[0].get("content")
        parts = content if isinstance(content, list) else []
        kinds = sorted({p.get("type") for p in parts} & set(MEDIA))
        if kinds:
            raise ValueError(
                f"record {rid!r}: {key!r} holds {kinds} parts; media belong to the prompt "
                "(both answers then see them)"
            )
        if not _text(content or "").strip():
            raise ValueError(f"record {rid!r}: the {key} answer is empty")
        return answer
