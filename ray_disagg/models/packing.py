"""Sequence packing for the LLM part: several samples share one row.

``collate_llm_packed(items, max_seq_len)`` fills rows with whole samples in item order
(next-fit, :func:`pack_rows`), so the placeholder tokens of the packed rows, read row by
row, are in the same order as the crossings (each item's rows, in item order). No token
attends across samples and every sample's positions restart at 0:

- ``llm_hidden`` passes HF's ``...Model.forward`` 4-row ``position_ids`` ``(4, B, T)``
  and no ``attention_mask``: row 0 holds the text positions (``0..n-1`` per sample, 0 on
  padding), from which ``transformers.masking_utils.find_packed_sequence_indices``
  builds the block-diagonal causal mask (also for ``sdpa`` and ``eager``); rows 1-3 are
  the mrope t/h/w positions, computed per sample by the model's own ``get_rope_index``
  (text-only samples: ``0..n-1``, which is what it gives them).
- each sample's first label is ``IGNORE_INDEX`` (unpacked, a sample's first token is
  never a target; packed, it would be predicted from the previous sample's last token),
  so ``lm_loss`` with the same label-token count equals the padded batch's loss.

The packed batch has ``input_ids`` and ``labels`` ``(B, T)`` and, under
:data:`PACKED_KEY`, one ``(row, start, length, rope_inputs)`` per item (``rope_inputs``:
the sample's own unpadded ``collate_llm`` batch on the CPU, ``None`` for a sample without
images/videos). It has no ``attention_mask``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ray_disagg.models.base import IGNORE_INDEX, sample_name

__all__ = [
    "host_to_device",
    "PACKED_KEY",
    "PackedQwenMixin",
    "PackedTextMixin",
    "check_fits",
    "is_packed",
    "pack_rows",
]

PACKED_KEY = "packed_segments"
"""Batch key of the per-item ``(row, start, length, rope_inputs)`` of a packed batch."""


def pack_rows(lengths: Sequence[int], max_seq_len: int) -> list[list[int]]:
    """Item indices per row, next-fit in the given order: an item goes into the current
    row if it still fits in ``max_seq_len`` tokens, else it opens a new row. The order is
    preserved (concatenating the rows gives ``0..len(lengths)-1``).

    Example:
        >>> pack_rows([3, 4, 2, 5, 1], 7)
        [[0, 1], [2, 3], [4]]
    """
    if max_seq_len < 1:
        raise ValueError(f"max_seq_len={max_seq_len} must be >= 1.")
    rows: list[list[int]] = []
    used = max_seq_len + 1  # forces a first row
    for i, n in enumerate(lengths):
        n = int(n)
        if n > max_seq_len:
            raise ValueError(f"item {i} has {n} tokens, more than max_seq_len={max_seq_len}.")
        if used + n > max_seq_len:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += n
    return rows


def check_fits(sample: dict, index: int | None, max_seq_len: int) -> None:
    """``ValueError`` naming ``sample`` when it has more than ``max_seq_len`` tokens (on
    the driver before the run, and when a packed batch is collated)."""
    n = len(sample["input_ids"])
    if n > max_seq_len:
        raise ValueError(
            f"{sample_name(sample, index)} has {n} tokens, more than "
            f"train_loop_config['max_seq_len']: max_seq_len={max_seq_len}. Raise max_seq_len "
            "or shorten (or drop) the sample."
        )


def host_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` (built on the host) on ``device``; to a GPU through pinned memory without
    blocking the host (the copy is ordered on the current stream before its consumers)."""
    if torch.device(device).type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def is_packed(batch: dict) -> bool:
    """Whether ``batch`` came from ``collate_llm_packed``."""
    return PACKED_KEY in batch


class PackedTextMixin:
    """``collate_llm_packed`` and the packed ``position_ids`` of 1-D rope families.

    The adapter provides ``collate_llm``, ``llm_kwargs``, ``labels`` and
    ``config.text_config.pad_token_id``; its ``llm_hidden`` calls ``...Model.forward`` with
    :meth:`llm_inputs`.
    """

    def needs_rope(self, item: dict) -> bool:
        """Whether packing needs the model's own rope index for ``item`` (else ``0..n-1``)."""
        return False

    def extra_llm_kwargs(self, input_ids: torch.Tensor) -> dict[str, Any]:
        """Inputs ``...Model.forward`` takes besides ids, mask and positions, computed
        from the (padded or packed) ``input_ids``."""
        return {}

    def llm_inputs(self, inner, batch: dict) -> dict[str, Any]:
        """``...Model.forward`` arguments: ``llm_kwargs`` of a padded batch,
        :meth:`packed_llm_kwargs` of a packed one."""
        return self.packed_llm_kwargs(inner, batch) if is_packed(batch) else self.llm_kwargs(batch)

    def collate_llm_packed(self, items: Sequence[dict], max_seq_len: int) -> dict[str, Any]:
        """Pack ``items`` (the dicts ``collate_llm`` takes) into rows of at most
        ``max_seq_len`` tokens in item order, padded to the longest row (see the module
        docstring). ``ValueError`` naming the sample if one is longer than ``max_seq_len``."""
        for i, it in enumerate(items):
            check_fits(it, i, max_seq_len)
        lengths = [len(it["input_ids"]) for it in items]
        rows = pack_rows(lengths, max_seq_len)
        width = max(sum(lengths[i] for i in row) for row in rows)
        pad = self.config.text_config.pad_token_id or 0
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
        segments = []
        for r, row in enumerate(rows):
            start = 0
            for i in row:
                n, it = lengths[i], items[i]
                lab = np.array(self.labels(it), dtype=np.int64)
                lab[0] = IGNORE_INDEX  # would be predicted from the previous sample
                # np.array copies: arrays from Ray's object store are read-only
                ids[r, start : start + n] = torch.from_numpy(
                    np.array(it["input_ids"], dtype=np.int64)
                )
                labels[r, start : start + n] = torch.as_tensor(lab)
                rope = self.collate_llm([it]) if self.needs_rope(it) else None
                segments.append((r, start, n, rope))
                start += n
        return {"input_ids": ids, "labels": labels, PACKED_KEY: segments}

    def packed_position_ids(self, inner, batch: dict) -> torch.Tensor:
        """``(B, T)`` position ids of a packed batch: ``0..n-1`` per sample (from which the
        mask keeps the samples apart), 0 on padding."""
        ids = batch["input_ids"]
        pos = torch.zeros(ids.shape, dtype=torch.long)
        for row, start, n, _ in batch[PACKED_KEY]:
            pos[row, start : start + n] = torch.arange(n)
        return host_to_device(pos, ids.device)

    def packed_llm_kwargs(self, inner, batch: dict) -> dict[str, Any]:
        """The ``...Model.forward`` arguments of a packed batch (no ``attention_mask``: the
        mask comes from the restarting positions)."""
        ids = batch["input_ids"]
        return {
            "input_ids": ids,
            "position_ids": self.packed_position_ids(inner, batch),
            "use_cache": False,
            **self.extra_llm_kwargs(ids),
        }


class PackedQwenMixin(PackedTextMixin):
    """:class:`PackedTextMixin` with the Qwen families' mrope positions (per sample from the
    model's own ``get_rope_index``)."""

    rope_grid_keys: tuple[str, ...] = ("image_grid_thw", "video_grid_thw")
    """Sample keys whose presence makes a sample's mrope positions differ from ``0..n-1``."""

    def needs_rope(self, item: dict) -> bool:
        """Whether packing needs ``get_rope_index`` for ``item`` (else ``0..n-1``)."""
        return any(item.get(k) is not None for k in self.rope_grid_keys)

    def rope_index(self, inner, rope_inputs: dict) -> torch.Tensor:
        """``(3, n)`` mrope positions of one sample from HF's ``inner.get_rope_index`` on
        its own unpadded ``collate_llm`` batch ``rope_inputs``."""
        return inner.get_rope_index(**self.llm_kwargs(rope_inputs))[0][:, 0]

    def packed_position_ids(self, inner, batch: dict) -> torch.Tensor:
        """``(4, B, T)`` position ids of a packed batch: text positions (mask) + mrope."""
        ids = batch["input_ids"]
        pos = torch.zeros((4, *ids.shape), dtype=torch.long)
        for row, start, n, rope in batch[PACKED_KEY]:
            pos[0, row, start : start + n] = torch.arange(n)
            if rope is None:
                pos[1:, row, start : start + n] = torch.arange(n)
            else:
                rope = {k: v.cpu() if torch.is_tensor(v) else v for k, v in rope.items()}
                pos[1:, row, start : start + n] = self.rope_index(inner, rope)
        return host_to_device(pos, ids.device)
