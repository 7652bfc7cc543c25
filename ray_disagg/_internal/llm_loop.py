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

from ray_disagg._internal import ingest
from ray_disagg._internal import loop_common as lc
from ray_disagg._internal.stage import Stage
from ray_disagg.data import count_label_tokens
from ray_disagg.models.base import lm_loss
from ray_disagg.parallel import tensor_parallel as tp


def _loss(adapter, lm_head, batch, received, n_labels, tp_group, vocab_start, model):
    hidden = adapter.llm_hidden(model, batch, received)
    return lm_loss(hidden, lm_head, batch["labels"], n_labels, tp_group, vocab_start)


def _plain(v):
    return v.item() if hasattr(v, "item") else v


def _send_inputs(st: Stage, samples: dict, mbs, step: int) -> None:
    """One message per encoder replica it shares samples with: per microbatch, the
    encoder fields of those samples (so encoders can run ahead of this replica)."""
    adapter, mine = st.adapter, [set(mb[st.part][st.dp_rank]) for mb in mbs]
    for part in adapter.encoder_parts:
        keys = ("id", *adapter.encoder_fields(part))
        for d in st.args.plan.peers(st.part, st.dp_rank, part, step):
            per_mb = [
                [{k: samples[p][k] for k in keys if k in samples[p]} for p in mb[part][d] if p in m]
                for mb, m in zip(mbs, mine)
            ]
            dst = st.args.leader_side_rank(st.side, part, d)
            st.pending.append(st.side.send_tensors(dst, {}, {"step": step, "mbs": per_mb}, False))


def _receive_crossings(st: Stage, step: int, j: int, mb, samples: dict):
    """``{crossing: rows of this replica's microbatch, in its samples' order}`` (float32)
    and, per encoder replica it heard from, the positions and dtypes (for the gradients)."""
    adapter, mine = st.adapter, mb[st.part][st.dp_rank]
    pieces, routes, own = {}, [], set(mine)
    for part in adapter.encoder_parts:
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
            rows = [adapter.crossing_rows(part, samples[p]) for p in positions]
            for name, t in tensors.items():
                for p, piece in zip(positions, t.split([r[name] for r in rows])):
                    pieces[(name, p)] = piece
            routes.append((part, src, positions, {n: t.dtype for n, t in tensors.items()}))
    received = {}
    for part in adapter.encoder_parts:
        for c in adapter.crossings(part):
            parts = [pieces[(c.name, p)] for p in mine if (c.name, p) in pieces]
            if parts:  # the loss runs in float32 (autocast inside), as the single-process model
                received[c.name] = (parts[0] if len(parts) == 1 else torch.cat(parts)).float()
    return received, routes


def _send_grads(st: Stage, received: dict, routes, mb, samples: dict, step: int, j: int) -> None:
    mine, adapter = mb[st.part][st.dp_rank], st.adapter
    for part, dst, positions, dtypes in routes:
        grads = {}
        for name in dtypes:
            rows = [adapter.crossing_rows(part, samples[p])[name] for p in mine]
            g = received[name].grad
            g = torch.zeros_like(received[name]) if g is None else g
            by_pos = dict(zip(mine, g.split(rows)))
            grads[name] = torch.cat([by_pos[p] for p in positions]).to(dtypes[name])
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
    text_keys = ("id", "input_ids", "labels", *adapter.llm_fields())

    for step in range(start, cfg.max_steps):
        lc.maybe_inject_failure(cfg, st.part, st.group_rank, step)
        mbs = plan.assign(step)
        share = [p for mb in mbs for p in mb[st.part][st.dp_rank]]
        t_wait = time.perf_counter()
        samples = {}
        if st.leader:
            samples = dict(zip(share, ingest.read_samples(source, step, share, args)))
            _send_inputs(st, samples, mbs, step)
        t_wait = time.perf_counter() - t_wait
        t0 = time.perf_counter()
        items = {p: {k: s[k] for k in text_keys if k in s} for p, s in samples.items()}
        items = st.broadcast_object(items)
        local_labels = sum(count_label_tokens(adapter.labels(it)) for it in items.values())
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
            received = {n: v.requires_grad_() for n, v in _share(st, received).items()}
            batch = adapter.collate_llm([items[p] for p in mb[st.part][st.dp_rank]])
            batch = {n: v.to(st.device) if torch.is_tensor(v) else v for n, v in batch.items()}
            loss_args = (batch, received, n_labels, tp_group, vocab_start)
            with torch.autocast(st.device.type, torch.bfloat16, enabled=cfg.bf16):
                loss = st.runner(functools.partial(_loss, adapter, lm_head, *loss_args))
            loss.backward()
            loss_sum += loss.item()
            tokens += int(batch["attention_mask"].sum())
            if st.leader:
                _send_grads(st, received, routes, mb, samples, step, j)
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
        st.finish(step, stats, t_compute, t_wait, extra, sample_ids=ids)
