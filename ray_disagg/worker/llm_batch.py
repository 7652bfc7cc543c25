"""The LLM's microbatch: its collated batch on the device (packed or padded rows, a
context-parallel slice's targets, the loss chunks every rank runs) and its loss (the
token loss, with each sequence's share for a mixture's per-source metrics, plus an MoE
router's auxiliary loss), taken as one :class:`LossInputs`; :class:`LLMModel`, what a
training step and validation share of the LLM worker (the loss of a microbatch, its
tokens, label tokens and FLOPs, the experts' load)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ray_disagg.data.mixture import SOURCE_KEY
from ray_disagg.models import loss as models_loss
from ray_disagg.models import moe
from ray_disagg.models.loss import lm_loss, lm_loss_by_sequence, loss_index
from ray_disagg.models.packing import PACKED_KEY, is_packed
from ray_disagg.parallel import context_parallel as cp
from ray_disagg.pipeline.assignment import count_label_tokens
from ray_disagg.worker import mfu
from ray_disagg.worker.context import WorkerContext
from ray_disagg.worker.metrics import plain, source_index
from ray_disagg.worker.parallelize import ParallelPart
from ray_disagg.worker.part_worker import PartModel, PartWorker

__all__ = [
    "LLMModel",
    "LossInputs",
    "collate",
    "loss",
    "router_aux",
    "sequence_index",
    "token_logps",
]


@dataclass(frozen=True, kw_only=True)
class LossInputs:
    """What the LLM's loss of one microbatch takes besides the model (:func:`loss`,
    :func:`token_logps`)."""

    adapter: Any
    """The family's adapter: the LLM's outputs (HF's merge of the crossings and rope)."""
    lm_head: nn.Module
    """The LLM's output projection (this rank's vocabulary shard under TP)."""
    batch: dict
    """The collated microbatch (:func:`collate`)."""
    received: dict
    """The crossing tensors (encoder outputs) of its samples, by crossing name."""
    normalizer: float = 1.0
    """The token loss's divisor: the global batch's label tokens."""
    tp_group: Any = None
    """The tensor-parallel group of a vocabulary-parallel ``lm_head`` (else ``None``)."""
    vocab_start: int = 0
    """The first vocabulary row of this rank's ``lm_head`` shard."""
    chunk_tokens: int | None = None
    """Label positions per loss chunk (``TrainLoopConfig.loss_chunk_tokens``)."""
    context: cp.ContextSlice | None = None
    """This rank's context-parallel slice (else ``None``)."""
    temperature: float = 1.0
    """An objective's log-probabilities divide the logits by this."""

    @classmethod
    def of_part(cls, ctx: WorkerContext, parallel: ParallelPart, batch: dict, received: dict,
                context=None, normalizer: float = 1.0, temperature: float = 1.0,
                ) -> LossInputs:  # fmt: skip
        """The inputs of a microbatch of the part ``parallel`` describes (its ``lm_head``
        and vocabulary shard), with the run's adapter and loss chunks."""
        return cls(
            adapter=ctx.adapter,
            lm_head=parallel.lm_head,
            batch=batch,
            received=received,
            normalizer=normalizer,
            tp_group=parallel.tp_group,
            vocab_start=parallel.vocab_start,
            chunk_tokens=ctx.cfg.loss_chunk_tokens,
            context=context,
            temperature=temperature,
        )

    def hidden(self, model):
        """``(the LLM's last hidden states, the routers' logits or None)`` and the keyword
        arguments of the loss functions of :mod:`ray_disagg.models.loss`."""
        piece, batch = self.context, self.batch
        hidden, router_logits = self.adapter.llm_outputs(model, batch, self.received, context=piece)
        kwargs = dict(index=batch["loss_index"], chunk_tokens=self.chunk_tokens,
                      shifted=piece is not None, min_chunks=batch["loss_chunks"])  # fmt: skip
        return hidden, router_logits, kwargs

    @property
    def labels(self) -> torch.Tensor:
        return self.batch["labels"] if self.context is None else self.batch["loss_targets"]

    def router_aux(self, router_logits) -> torch.Tensor | None:
        """This rank's share of an MoE router's auxiliary loss (``None``: no router, or
        no ``batch["router"]``, as in validation)."""
        if router_logits is None or "router" not in self.batch:
            return None
        return router_aux(self.adapter, router_logits, self.batch, self.context)


def loss(inputs: LossInputs, model):
    """``(the microbatch's loss, each sequence's summed cross-entropy or None)``; with a
    context slice, this rank's share of both. The sequences' sums (detached) come with
    ``loss_seq`` in the batch (a mixture's per-source metrics). An MoE LLM adds this
    rank's share of the router's auxiliary loss (``batch["router"]``: the group of ranks
    holding different tokens, see :mod:`ray_disagg.models.moe`)."""
    hidden, router_logits, kwargs = inputs.hidden(model)
    batch, per_sequence = inputs.batch, None
    head = (hidden, inputs.lm_head, inputs.labels, inputs.normalizer)
    if "loss_seq" in batch:
        total, per_sequence = lm_loss_by_sequence(
            *head, batch["loss_seq"], batch["num_sequences"], inputs.tp_group,
            inputs.vocab_start, **kwargs,
        )  # fmt: skip
    else:
        total = lm_loss(*head, inputs.tp_group, inputs.vocab_start, **kwargs)
    aux = inputs.router_aux(router_logits)
    return (total if aux is None else total + aux), per_sequence


def token_logps(inputs: LossInputs, model):
    """``(the log-probability of each label token this rank holds, the router's
    auxiliary loss share or None)`` (an objective's)."""
    hidden, router_logits, kwargs = inputs.hidden(model)
    logps = models_loss.token_logps(
        hidden, inputs.lm_head, inputs.labels, inputs.tp_group, inputs.vocab_start,
        temperature=inputs.temperature, **kwargs,
    )  # fmt: skip
    return logps, inputs.router_aux(router_logits)


def sequence_index(batch: dict, loss_index: torch.Tensor, bounds=None) -> torch.Tensor:
    """The sequence (item of the collated batch) of each label position in
    ``loss_index`` (host tensors): one row per item, or a packed row's segments in item
    order; ``bounds``: this context-parallel rank's ``[lo, hi)``, whose positions' targets
    were shifted already."""
    ids = batch["input_ids"]
    rows, width = ids.shape
    if is_packed(batch):
        seq = torch.full((rows, width), -1, dtype=torch.long)
        for i, (row, start, n, _) in enumerate(batch[PACKED_KEY]):
            seq[row, start : start + n] = i
    else:
        seq = torch.arange(rows).unsqueeze(1).expand(rows, width)
    nxt = seq[:, 1:]  # a position's target is the next token's label: that token's sequence
    if bounds is not None:
        lo, hi = bounds
        nxt = torch.cat([nxt, seq.new_full((rows, 1), -1)], 1)[:, lo:hi]
    return nxt.flatten().index_select(0, loss_index)


def router_aux(adapter, router_logits, batch: dict, piece: cp.ContextSlice | None):
    """This rank's share of the MoE router's auxiliary loss over the tokens it routed
    (with a context slice ``piece``, the slice's: its part of the attention mask)."""
    mask = batch.get("attention_mask")
    if piece is not None and mask is not None:
        mask = mask[:, slice(*piece.bounds[piece.rank])]
    return moe.router_aux_loss(router_logits, adapter.router, mask, batch["router"])


def collate(ctx: WorkerContext, items: list[dict], sequences: bool = False) -> dict:
    """The microbatch's LLM batch on the device; ``sequences``: with ``loss_seq``, the
    sequence (item) of each label position, and ``num_sequences`` (a per-sequence
    objective)."""
    if ctx.cfg.pack_sequences:
        batch = ctx.adapter.collate_llm_packed(items, ctx.cfg.max_seq_len)
    else:
        batch = ctx.adapter.collate_llm(items)
    if ctx.is_cp:  # this rank's slice: its next-token targets (the shift crosses slices)
        piece = _context(ctx, batch["input_ids"].shape[1], items, is_packed(batch))
        lo, hi = piece.bounds[piece.rank]
        batch["loss_targets"] = cp.local_targets(batch["labels"], lo, hi)
        batch["loss_index"] = loss_index(batch["loss_targets"], shifted=True)
        batch["context"] = piece
        if sequences:
            batch["loss_seq"] = sequence_index(batch, batch["loss_index"], (lo, hi))
    else:
        batch["loss_index"] = loss_index(batch["labels"])  # on the host: no device sync
        if sequences:
            batch["loss_seq"] = sequence_index(batch, batch["loss_index"])
    if sequences:
        batch["num_sequences"] = len(items)
    batch["loss_chunks"] = _loss_chunks(ctx, len(batch["loss_index"]))
    return {n: v.to(ctx.device) if torch.is_tensor(v) else v for n, v in batch.items()}


def _loss_chunks(ctx: WorkerContext, positions: int) -> int:
    """Loss chunks every rank runs: with FSDP2 the group's most (the ``lm_head`` unit's
    collectives run once per chunk and must match across ranks), else this rank's."""
    chunk = ctx.cfg.loss_chunk_tokens
    if chunk is None or not ctx.fsdp:
        return 1
    n = torch.tensor([-(-positions // chunk)], dtype=torch.int64)
    dist.all_reduce(n, op=dist.ReduceOp.MAX, group=ctx.rt.object_group)  # gloo, on the host
    return int(n)


def _context(ctx: WorkerContext, seq_len: int, items: list[dict], packed: bool):
    """This rank's :class:`~ray_disagg.parallel.context_parallel.ContextSlice` of rows of
    ``seq_len`` tokens, ``packed`` or not (an error naming the samples when they are too
    short to split)."""
    try:
        bounds = tuple(cp.slice_bounds(seq_len, ctx.cp_mesh.size()))
    except ValueError as e:
        ids = [plain(it.get("id")) for it in items]
        raise ValueError(f"LLM microbatch of samples {ids}: {e}") from None
    rank = ctx.cp_mesh.get_local_rank()
    return cp.ContextSlice(ctx.cp_mesh.get_group(), rank, bounds, packed)


class LLMModel:
    """The pieces of one LLM worker that training and validation share."""

    def __init__(self, w: PartWorker, model, objective=None):
        self.w, self.model = w, model
        ctx, adapter = w.ctx, w.ctx.adapter
        load = moe.ExpertLoad(adapter.llm_modules(model)[0])  # hooks on MoE routers only
        self.load = load if load.routers else None
        self.objective = objective  # an ObjectiveRunner, or None: the token loss (SFT)
        self.policy = PartModel(model=model, runner=w.runner, parallel=w.parallel)
        if objective is not None:
            objective.load = self.load
        obj = ctx.cfg.objective
        keys = ("input_ids", "labels")
        if obj is not None:
            keys = tuple(dict.fromkeys((*obj.sequence_keys, *obj.fields, *obj.step_keys)))
            keys += ("input_ids",) if obj.generates else ()  # the prompt a rollout completes
        keys += (SOURCE_KEY,) if ctx.args.sources else ()  # a mixture's per-source metrics
        self.text_keys = ("id", *keys, *adapter.llm_fields())
        self.grad_names = {  # crossings whose encoder has something to train
            c.name
            for part in adapter.encoder_parts
            if part not in ctx.args.frozen_parts
            for c in adapter.crossings(part)
        }

    def label_tokens(self, items) -> int:
        if self.objective is not None:
            return self.objective.label_tokens(list(items))
        return sum(count_label_tokens(self.w.ctx.adapter.labels(it)) for it in items)

    def counts(self, items) -> tuple[int, int]:
        """``(sequences, label tokens)`` of ``items`` (an objective's samples may hold
        several sequences)."""
        if self.objective is not None:
            return self.objective.counts(list(items))
        return len(items), self.label_tokens(items)

    def tokens(self, items) -> int:
        seqs = items if self.objective is None else self.objective.sequences(items)[0]
        return sum(len(q["input_ids"]) for q in seqs)

    def flops(self, items, backward: bool) -> float:
        """Model FLOPs of ``items``' sequences (an objective's reference pass not counted;
        a frozen LLM's backward: input gradients only)."""
        seqs = items if self.objective is None else self.objective.sequences(items)[0]
        ctx = self.w.ctx
        return mfu.samples_flops(ctx.adapter, ctx.part, seqs, backward, trains=not ctx.frozen)

    def loss(self, items, mb, received, rows, n_labels, grad: bool, by_source=None):
        """The microbatch's loss: the token loss over ``n_labels`` (the global batch's
        label tokens), or the objective's (its totals set at the step's start);
        ``by_source``: a mixture's per-source sums of the token loss, added to."""
        ctx = self.w.ctx
        if self.load is not None:  # count this forward's routing (not recomputations)
            self.load.active = grad
        try:
            if self.objective is not None:
                positions = mb[ctx.part][ctx.dp_rank]
                samples = [items[p] for p in positions]
                args = (self.policy, positions, samples, received, rows, grad)
                return self.objective.loss(*args)
            return self._token_loss(items, mb, received, n_labels, grad, by_source)
        finally:
            if self.load is not None:
                self.load.active = False

    def _token_loss(self, items, mb, received, n_labels, grad: bool, by_source=None):
        ctx = self.w.ctx
        mine = [items[p] for p in mb[ctx.part][ctx.dp_rank]]
        batch = collate(ctx, mine, sequences=by_source is not None)
        if grad and ctx.adapter.router is not None:  # validation reports the token loss
            batch["router"] = ctx.token_group
        piece = batch.pop("context", None)  # this rank's context-parallel slice
        inputs = LossInputs.of_part(ctx, self.w.parallel, batch, received, piece, n_labels)
        with torch.autocast(ctx.device.type, torch.bfloat16, enabled=ctx.cfg.bf16):
            total, per_sequence = self.w.runner(functools.partial(loss, inputs))
        if by_source is not None:
            index = source_index(mine, ctx.args.sources, ctx.device)
            by_source.index_add_(0, index, per_sequence)
        return total

    def expert_load(self) -> dict[str, float]:
        """The step's ``<part>_expert_load_max`` / ``_mean`` over the global batch (MoE;
        collective over the ranks holding different tokens)."""
        if self.load is None:
            return {}
        ctx = self.w.ctx
        load = self.load.take(ctx.token_group, ctx.device)
        return {f"{ctx.part}_{k}": v for k, v in load.items()}
