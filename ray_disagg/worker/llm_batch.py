"""The LLM's microbatch: its collated batch on the device (packed or padded rows, a
context-parallel slice's targets, the loss chunks every rank runs) and its loss (the
token loss, with each sequence's share for a mixture's per-source metrics, plus an MoE
router's auxiliary loss)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ray_disagg.models.loss import lm_loss, lm_loss_by_sequence, loss_index
from ray_disagg.models.packing import is_packed
from ray_disagg.parallel import context_parallel as cp
from ray_disagg.worker.metrics import plain
from ray_disagg.worker.objective import router_aux, sequence_index
from ray_disagg.worker.part_worker import PartWorker

__all__ = ["collate", "loss"]


def loss(adapter, lm_head, batch, received, n_labels, tp_group, vocab_start, chunk, ctx, model):
    """``(the microbatch's loss, each sequence's summed cross-entropy or None)``; with a
    context slice ``ctx``, this rank's share of both. The sequences' sums (detached) come
    with ``loss_seq`` in ``batch`` (a mixture's per-source metrics). An MoE LLM adds this
    rank's share of the router's auxiliary loss (``batch["router"]``: the group of ranks
    holding different tokens, see :mod:`ray_disagg.models.moe`)."""
    hidden, router_logits = adapter.llm_outputs(model, batch, received, context=ctx)
    labels = batch["labels"] if ctx is None else batch["loss_targets"]
    kwargs = dict(index=batch["loss_index"], chunk_tokens=chunk, shifted=ctx is not None,
                  min_chunks=batch["loss_chunks"])  # fmt: skip
    per_sequence = None
    if "loss_seq" in batch:
        total, per_sequence = lm_loss_by_sequence(
            hidden, lm_head, labels, n_labels, batch["loss_seq"], batch["num_sequences"],
            tp_group, vocab_start, **kwargs,
        )  # fmt: skip
    else:
        total = lm_loss(hidden, lm_head, labels, n_labels, tp_group, vocab_start, **kwargs)
    if router_logits is not None and "router" in batch:
        total = total + router_aux(adapter, router_logits, batch, ctx)
    return total, per_sequence


def collate(w: PartWorker, items: list[dict], sequences: bool = False) -> dict:
    """The microbatch's LLM batch on the device; ``sequences``: with ``loss_seq``, the
    sequence (item) of each label position, and ``num_sequences`` (a per-sequence
    objective)."""
    if w.cfg.pack_sequences:
        batch = w.adapter.collate_llm_packed(items, w.cfg.max_seq_len)
    else:
        batch = w.adapter.collate_llm(items)
    if w.is_cp:  # this rank's slice: its next-token targets (the shift crosses slices)
        ctx = _context(w, batch["input_ids"].shape[1], items, is_packed(batch))
        lo, hi = ctx.bounds[ctx.rank]
        batch["loss_targets"] = cp.local_targets(batch["labels"], lo, hi)
        batch["loss_index"] = loss_index(batch["loss_targets"], shifted=True)
        batch["context"] = ctx
        if sequences:
            batch["loss_seq"] = sequence_index(batch, batch["loss_index"], (lo, hi))
    else:
        batch["loss_index"] = loss_index(batch["labels"])  # on the host: no device sync
        if sequences:
            batch["loss_seq"] = sequence_index(batch, batch["loss_index"])
    if sequences:
        batch["num_sequences"] = len(items)
    batch["loss_chunks"] = _loss_chunks(w, len(batch["loss_index"]))
    return {n: v.to(w.device) if torch.is_tensor(v) else v for n, v in batch.items()}


def _loss_chunks(w: PartWorker, positions: int) -> int:
    """Loss chunks every rank runs: with FSDP2 the group's most (the ``lm_head`` unit's
    collectives run once per chunk and must match across ranks), else this rank's."""
    chunk = w.cfg.loss_chunk_tokens
    if chunk is None or not w.fsdp:
        return 1
    n = torch.tensor([-(-positions // chunk)], dtype=torch.int64)
    dist.all_reduce(n, op=dist.ReduceOp.MAX, group=w.rt.object_group)  # gloo, on the host
    return int(n)


def _context(w: PartWorker, seq_len: int, items: list[dict], packed: bool):
    """This rank's :class:`~ray_disagg.parallel.context_parallel.ContextSlice` of rows of
    ``seq_len`` tokens, ``packed`` or not (an error naming the samples when they are too
    short to split)."""
    try:
        bounds = tuple(cp.slice_bounds(seq_len, w.cp_mesh.size()))
    except ValueError as e:
        ids = [plain(it.get("id")) for it in items]
        raise ValueError(f"LLM microbatch of samples {ids}: {e}") from None
    rank = w.cp_mesh.get_local_rank()
    return cp.ContextSlice(w.cp_mesh.get_group(), rank, bounds, packed)
