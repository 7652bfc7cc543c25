"""Training loop of the LLM group's workers.

LLM data-parallel replica ``t`` (its tp rank 0) is where samples are read: at the start
of a step it reads its share of the global batch (``BatchPlan.assign``) and sends every
encoder replica the encoder fields of the samples it will encode, for every microbatch.
Then, microbatch by microbatch, it receives the crossing tensors (image/video/audio
embeddings, DeepStack features) of its samples from the encoder replicas, puts them in
its samples' order, shares them with its tp peers, computes the loss through the adapter
(HF's own merge and rope; normalised by the global batch's label tokens), runs backward
and posts the crossings' gradients back. Gradients accumulate over the microbatches and
are summed over ``"dp"`` once; the optimizer steps.
"""

from __future__ import annotations

import functools
import time

import ray
import torch
import torch.distributed as dist

from ray_disagg.models.base import lm_loss
from ray_disagg.parallel import tensor_parallel as tp
from ray_disagg.pipeline.assignment import count_label_tokens
from ray_disagg.worker import common as lc
from ray_disagg.worker import ingest
from ray_disagg.worker.stage import Stage


def _loss(adapter, lm_head, batch, received, n_labels, tp_group, vocab_start, model):
    hidden = adapter.llm_hidden(model, batch, received)
    return lm_loss(hidden, lm_head, batch["labels"], n_labels, tp_group, vocab_start)


def _plain(v):
    return v.item() if hasattr(v, "item") else v


def _send_inputs(st: Stage, samples: dict, mbs, plan, key) -> None:
    """One message per encoder replica it shares samples with: per microbatch, the
    encoder fields of those samples (so encoders can run ahead of this replica)."""
    adapter, mine = st.adapter, [set(mb[st.part][st.dp_rank]) for mb in mbs]
    for part in adapter.encoder_parts:
        keys = ("id", *adapter.encoder_fields(part))
        for d in plan.peers(st.part, st.dp_rank, part, None, mbs):
            per_mb = [
                [{k: samples[p][k] for k in keys if k in samples[p]} for p in mb[part][d] if p in m]
                for mb, m in zip(mbs, mine)
            ]
            dst = st.args.leader_side_rank(st.side, part, d)
            st.pending.append(st.side.send_tensors(dst, {}, {"step": key, "mbs": per_mb}, False))


def _receive_crossings(st: Stage, step: int, j: int, mb, samples: dict):
    """``{crossing: rows of this replica's microbatch, in its samples' order}`` (float32)
    and, per encoder replica it heard from, the positions, dtypes and every sample's
    crossing rows (for the gradients)."""
    adapter, mine = st.adapter, mb[st.part][st.dp_rank]
    pieces, routes, own = {}, [], set(mine)
    for part in adapter.encoder_parts:
        part_rows = None  # {position: {crossing: rows}} of this replica's samples
        for d in range(st.args.plan.dp_sizes[part]):
            positions = [p for p in mb[part][d] if p in own]
            if not positions:
                continue
            src = st.args.leader_side_rank(st.side, part, d)
            meta, tensors = st.side.recv_tensors(src, st.device)
            if (meta["step"], meta["mb"]) != (step, j):
                raise RuntimeError(
                    f"LLM group got step {meta['step']} microbatch {meta['mb']} {part} data "
                    f"at step {step} microbatch {j}"
                )
            if part_rows is None:
                part_rows = {p: adapter.crossing_rows(part, samples[p]) for p in mine}
            for name, t in tensors.items():
                for p, piece in zip(positions, t.split([part_rows[p][name] for p in positions])):
                    pieces[(name, p)] = piece
            if part not in st.args.frozen_parts:  # a frozen encoder gets no gradients
                dtypes = {n: t.dtype for n, t in tensors.items()}
                routes.append((src, positions, dtypes, part_rows))
    received = {}
    for part in adapter.encoder_parts:
        for c in adapter.crossings(part):
            parts = [pieces[(c.name, p)] for p in mine if (c.name, p) in pieces]
            if parts:  # the loss runs in float32 (autocast inside), as the single-process model
                received[c.name] = (parts[0] if len(parts) == 1 else torch.cat(parts)).float()
    return received, routes


def _trainable_crossings(st: Stage) -> set[str]:
    """Names of the crossings whose encoder has something to train."""
    return {
        c.name
        for part in st.adapter.encoder_parts
        if part not in st.args.frozen_parts
        for c in st.adapter.crossings(part)
    }


def _send_grads(st: Stage, received: dict, routes, mb, step: int, j: int) -> None:
    """Each encoder replica gets the gradients of the rows it sent (split once per
    crossing, with the rows ``_receive_crossings`` computed)."""
    mine, by_pos = mb[st.part][st.dp_rank], {}
    for dst, positions, dtypes, part_rows in routes:
        grads = {}
        for name in dtypes:
            if name not in by_pos:
                g = received[name].grad
                g = torch.zeros_like(received[name]) if g is None else g
                by_pos[name] = dict(zip(mine, g.split([part_rows[p][name] for p in mine])))
            grads[name] = torch.cat([by_pos[name][p] for p in positions]).to(dtypes[name])
        st.pending.append(st.side.send_tensors(dst, grads, {"step": step, "mb": j}, False))


def _share(st: Stage, received):
    """tp: the leader's crossing tensors on every tp rank."""
    shapes = {k: tuple(v.shape) for k, v in received.items()} if st.leader else None
    shapes = st.broadcast_object(shapes)
    received = {k: v.to(st.device) for k, v in received.items()}
    if st.mp_size > 1:
        if not st.leader:
            received = {k: torch.empty(s, device=st.device) for k, s in shapes.items()}
        for k in sorted(received):
            dist.broadcast(received[k], src=st.mp_src, group=st.mp_mesh.get_group())
    return received


def _collate(st: Stage, items: list[dict]) -> dict:
    if st.cfg.pack_sequences:
        batch = st.adapter.collate_llm_packed(items, st.cfg.max_seq_len)
    else:
        batch = st.adapter.collate_llm(items)
    return {n: v.to(st.device) if torch.is_tensor(v) else v for n, v in batch.items()}


class _LLM:
    """The pieces of one LLM worker that training and validation share."""

    def __init__(self, st: Stage, model, lm_head, tp_group, vocab_start):
        self.st, self.model, self.lm_head = st, model, lm_head
        self.tp_group, self.vocab_start = tp_group, vocab_start
        self.text_keys = ("id", "input_ids", "labels", *st.adapter.llm_fields())
        self.grad_names = _trainable_crossings(st)

    def read(self, source, plan, step: int, key, mbs):
        """The replica's samples of ``step`` (sent on to the encoders) and their LLM items
        on every tp rank; returns ``(samples, items, label tokens)``."""
        st, share = self.st, [p for mb in mbs for p in mb[self.st.part][self.st.dp_rank]]
        samples = {}
        if st.leader:
            samples = dict(zip(share, ingest.read_samples(source, step, share, st.args)))
            _send_inputs(st, samples, mbs, plan, key)
        items = {p: {k: s[k] for k in self.text_keys if k in s} for p, s in samples.items()}
        items = st.broadcast_object(items)
        labels = sum(count_label_tokens(st.adapter.labels(it)) for it in items.values())
        return samples, items, labels

    def loss(self, items, mb, received, n_labels):
        st = self.st
        batch = _collate(st, [items[p] for p in mb[st.part][st.dp_rank]])
        loss_args = (batch, received, n_labels, self.tp_group, self.vocab_start)
        with torch.autocast(st.device.type, torch.bfloat16, enabled=st.cfg.bf16):
            return st.runner(functools.partial(_loss, st.adapter, self.lm_head, *loss_args))

    def evaluate(self, source, plan, step: int) -> list[float]:
        """This rank's ``[summed token loss, label tokens]`` over the validation set
        (non-zero on replica leaders only), forward only."""
        st, loss_sum, n_labels = self.st, 0.0, 0
        for v in range(plan.steps_per_epoch):
            key, mbs = ("val", step, v), plan.assign(v)
            samples, items, labels = self.read(source, plan, v, key, mbs)
            n_labels += labels
            for j, mb in enumerate(mbs):
                received = {}
                if st.leader:
                    received, _ = _receive_crossings(st, key, j, mb, samples)
                with torch.no_grad():
                    received = _share(st, received)
                    loss_sum += float(self.loss(items, mb, received, 1.0))
            st.wait_pending()
        return [loss_sum, n_labels] if st.leader else [0.0, 0.0]


def llm_train_loop(args: lc.LoopArgs) -> None:
    st = Stage(args, args.adapter.llm_part)
    adapter, cfg, plan = st.adapter, st.cfg, args.plan
    model = st.build()
    tp_group, vocab_start = None, 0
    decoder, lm_head = adapter.llm_modules(model)
    if st.is_tp:
        tp_group, vocab_start = tp.parallelize_text(
            model, decoder, lm_head, st.mp_mesh, adapter.llm_tp_plan(), adapter.per_head_norms
        )
    start = st.setup(model)
    data = ray.get(args.dataset_ref[0])
    source = ingest.make_source(data, plan, st.dp_rank, st.leader, st.part)
    llm = _LLM(st, model, lm_head, tp_group, vocab_start)
    evaluate = None
    if args.val_plan is not None:
        val = ingest.MapStyleSource(ray.get(args.val_ref[0]), args.val_plan, st.part)
        evaluate = functools.partial(llm.evaluate, val, args.val_plan)

    for step in range(start, cfg.max_steps):
        lc.maybe_inject_failure(cfg, st.part, st.group_rank, step)
        mbs = plan.assign(step)
        t_wait = time.perf_counter()
        samples, items, local_labels = llm.read(source, plan, step, step, mbs)
        t_wait = time.perf_counter() - t_wait  # reading and sending (the leader's)
        t0 = time.perf_counter()
        n_labels = torch.tensor([local_labels], dtype=torch.float64, device=st.device)
        dist.all_reduce(n_labels, group=st.dp_mesh.get_group())
        n_labels = max(float(n_labels), 1.0)
        t_compute = time.perf_counter() - t0
        loss_sum, tokens = 0.0, 0
        for j, mb in enumerate(mbs):
            lc.maybe_inject_failure(cfg, st.part, st.group_rank, step, j)
            t1 = time.perf_counter()
            received, routes = {}, []
            if st.leader:
                received, routes = _receive_crossings(st, step, j, mb, samples)
                # the encoders have the inputs and microbatch j-1's gradients (they sent j
                # and wait for nothing else before taking j-1's): release those buffers
                st.wait_pending()
            t_wait += time.perf_counter() - t1
            t2 = time.perf_counter()
            received = {
                n: v.requires_grad_(n in llm.grad_names) for n, v in _share(st, received).items()
            }
            loss = llm.loss(items, mb, received, n_labels)
            if loss.requires_grad:  # not: a frozen LLM with nothing trainable upstream
                loss.backward()
                st.backward_passes += 1
            loss_sum += loss.item()
            tokens += sum(len(items[p]["input_ids"]) for p in mb[st.part][st.dp_rank])
            if st.leader:
                _send_grads(st, received, routes, mb, step, j)
            t_compute += time.perf_counter() - t2
        t3 = time.perf_counter()
        st.wait_pending()
        t_wait += time.perf_counter() - t3

        stats = st.layout.new()
        if st.leader:
            ix = st.layout.index
            stats[ix["loss"]] = loss_sum
            stats[ix["label_tokens"]] = local_labels
            stats[ix["llm_tokens"]] = tokens
        ordered = [items[p] for p in sorted(items)]
        extra = None
        if cfg.extra.get("report_sample_ids"):  # which samples this step used (for audits)
            ids = [_plain(it.get("id")) for it in ordered] if st.leader else []
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, ids)
            extra = {"sample_ids": [i for part in gathered for i in part]}
        ids = [_plain(it.get("id")) for it in ordered]
        st.finish(step, stats, t_compute, t_wait, extra, sample_ids=ids, evaluate=evaluate)
