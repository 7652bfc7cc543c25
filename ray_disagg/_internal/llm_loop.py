"""Training loop of the LLM group's workers.

LLM data-parallel replica ``t`` (its tp rank 0) is where samples are read: it reads its
slice of each global batch, sends every encoder replica routed to it the encoder fields
of their shared samples, receives back the crossing tensors (image/video/audio embeddings,
DeepStack features, in batch order) and shares them and the text fields with its tp
peers. Every rank computes the loss through the adapter (HF's own merge and rope); the tp
leader sends the crossings' gradients back; gradients are summed over ``"dp"`` and the
optimizer steps.
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


def _send_inputs(st: Stage, samples, step: int) -> None:
    args, adapter = st.args, st.adapter
    base = args.plan.span(adapter.llm_part, st.dp_rank)[0]
    for part in adapter.encoder_parts:
        keys = ("id", *adapter.encoder_fields(part))
        for d, lo, hi in args.plan.routes(adapter.llm_part, st.dp_rank, part):
            sub = [{k: s[k] for k in keys if k in s} for s in samples[lo - base : hi - base]]
            st.side.send_object(
                {"step": step, "samples": sub}, args.leader_side_rank(st.side, part, d)
            )


def _receive_crossings(st: Stage, step: int):
    """``{crossing: rows of this replica's samples}`` (float32 leaves) and, per encoder
    route, the rows and dtype of each crossing (to send the gradients back the same way)."""
    args, adapter = st.args, st.adapter
    received, route_rows = {}, []
    for part in adapter.encoder_parts:
        parts = {c.name: [] for c in adapter.crossings(part)}
        for d, _lo, _hi in args.plan.routes(adapter.llm_part, st.dp_rank, part):
            src = args.leader_side_rank(st.side, part, d)
            meta, tensors = st.side.recv_tensors(src, st.device)
            if meta["step"] != step:
                raise RuntimeError(f"LLM group got step {meta['step']} {part} data at step {step}")
            for name, t in tensors.items():
                parts[name].append(t)
            dtypes = {name: t.dtype for name, t in tensors.items()}
            route_rows.append((part, src, meta["rows"], dtypes))
        for k, v in parts.items():
            if v:  # the loss runs in float32 (autocast inside), as the single-process model
                received[k] = (v[0] if len(v) == 1 else torch.cat(v)).float()
    return received, route_rows


def _send_grads(st: Stage, received: dict, route_rows, step: int) -> None:
    offsets = dict.fromkeys(received, 0)
    for part, dst, rows, dtypes in route_rows:
        grads = {}
        for c in st.adapter.crossings(part):
            n = rows[c.name]
            if n:
                g = received[c.name].grad
                g = torch.zeros_like(received[c.name]) if g is None else g
                o = offsets[c.name]
                grads[c.name] = g[o : o + n].to(dtypes[c.name])  # the encoder output's dtype
                offsets[c.name] += n
        st.side.send_tensors(dst, grads, {"step": step})


def _share(st: Stage, items, received):
    """tp: the leader's text items and crossing tensors on every tp rank."""
    shapes = {k: tuple(v.shape) for k, v in received.items()} if st.leader else None
    items, shapes = st.broadcast_object((items, shapes))
    received = {k: v.to(st.device) for k, v in received.items()}
    if st.mp_size > 1:
        if not st.leader:
            received = {k: torch.empty(s, device=st.device) for k, s in shapes.items()}
        for k in sorted(received):
            dist.broadcast(received[k], src=st.mp_src, group=st.mp_mesh.get_group())
    return items, received


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
        t_wait = time.perf_counter()
        items, received, route_rows = None, {}, []
        if st.leader:
            samples = ingest.read_samples(source, step, st.dp_rank, args)
            _send_inputs(st, samples, step)
            received, route_rows = _receive_crossings(st, step)
            items = [{k: s[k] for k in text_keys if k in s} for s in samples]
        t_wait = time.perf_counter() - t_wait
        t0 = time.perf_counter()
        items, received = _share(st, items, received)
        received = {k: v.requires_grad_() for k, v in received.items()}
        batch = adapter.collate_llm(items)
        local_labels = sum(count_label_tokens(adapter.labels(it)) for it in items)
        n_labels = torch.tensor([local_labels], dtype=torch.float64, device=st.device)
        dist.all_reduce(n_labels, group=st.dp_mesh.get_group())
        batch = {k: v.to(st.device) if torch.is_tensor(v) else v for k, v in batch.items()}
        loss_args = (batch, received, max(float(n_labels), 1.0), tp_group, vocab_start)
        with torch.autocast(st.device.type, torch.bfloat16, enabled=cfg.bf16):
            loss = st.runner(functools.partial(_loss, adapter, lm_head, *loss_args))
        loss.backward()
        t_compute = time.perf_counter() - t0

        t1 = time.perf_counter()
        if st.leader:
            _send_grads(st, received, route_rows, step)
        t_wait += time.perf_counter() - t1

        stats = st.layout.new()
        if st.leader:
            ix = st.layout.index
            stats[ix["loss"]] = loss.item()
            stats[ix["label_tokens"]] = local_labels
            stats[ix["llm_tokens"]] = int(batch["attention_mask"].sum())
        extra = None
        if cfg.extra.get("report_sample_ids"):  # which samples this step used (for audits)
            ids = [_plain(it.get("id")) for it in items] if st.leader else []
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, ids)
            extra = {"sample_ids": [i for part in gathered for i in part]}
        ids = [_plain(it.get("id")) for it in items]
        st.finish(step, stats, t_compute, t_wait, extra, sample_ids=ids)
