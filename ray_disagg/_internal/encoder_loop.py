"""Training loop of an encoder group's workers (vision, audio, ...).

Encoder replica ``d`` (its model-parallel rank 0) receives, from every LLM replica routed
to it, the encoder fields of its slice of the global batch, shares them with its SP/TP
peers, runs the encoder part, sends each LLM replica the crossing tensors of the samples
routed to it, receives their gradients back and finishes backward, the gradient
reduction and the optimizer step.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ray_disagg._internal import loop_common as lc
from ray_disagg._internal.stage import Stage
from ray_disagg.parallel import tensor_parallel as tp
from ray_disagg.parallel import ulysses


def _row_offsets(adapter, part, samples) -> dict[str, list[int]]:
    """Per crossing, the first row of each sample (and the end)."""
    rows = [adapter.crossing_rows(part, s) for s in samples]
    out = {}
    for c in adapter.crossings(part):
        counts = [r[c.name] for r in rows]
        out[c.name] = [sum(counts[:k]) for k in range(len(counts) + 1)]
    return out


def _encode(st: Stage, samples) -> dict:
    """The part's crossings for ``samples`` (one FSDP2 root call)."""
    sp = st.is_sp or None

    def run(model):
        return st.adapter.encode(model, st.part, samples, st.device, sp=sp)

    with torch.autocast(st.device.type, torch.bfloat16, enabled=st.cfg.bf16):
        return st.runner(run)


def encoder_train_loop(args: lc.LoopArgs, part: str) -> None:
    st = Stage(args, part)
    adapter, cfg, plan, side = st.adapter, st.cfg, args.plan, st.side
    llm = adapter.llm_part
    model = st.build()
    tower = adapter.part_roots(model, part)[0]
    if st.is_sp:
        ulysses.enable_ulysses(tower, adapter.sp_plan(part), st.mp_mesh.get_group())
    if st.is_tp:
        tp.parallelize_vision(tower, adapter.tower_tp_plan(part), st.mp_mesh)
    start = st.setup(model)
    crossings = adapter.crossings(part)

    for step in range(start, cfg.max_steps):
        lc.maybe_inject_failure(cfg, part, st.group_rank, step)
        routes = plan.routes(part, st.dp_rank, llm) if st.leader else []
        t_wait = time.perf_counter()
        samples = []
        for t, _lo, _hi in routes:
            meta = side.recv_object(args.leader_side_rank(side, llm, t))
            if meta["step"] != step:
                raise RuntimeError(f"{part} group got step {meta['step']} inputs at step {step}")
            samples += meta["samples"]
        t_wait = time.perf_counter() - t_wait
        t0 = time.perf_counter()
        samples = st.broadcast_object(samples)
        # FSDP2: every rank must run the same units; one without inputs runs a stand-in
        counts = adapter.item_counts(part, samples)
        real = not st.fsdp or sum(counts.values()) > 0
        outputs = _encode(st, samples if real else adapter.stand_in_samples(part))
        offsets = _row_offsets(adapter, part, samples)
        t_compute = time.perf_counter() - t0

        t1 = time.perf_counter()
        base = plan.span(part, st.dp_rank)[0]
        for t, lo, hi in routes:
            spans = {
                c.name: (offsets[c.name][lo - base], offsets[c.name][hi - base]) for c in crossings
            }
            tensors = {n: outputs[n][a:b].detach() for n, (a, b) in spans.items() if b > a}
            rows = {n: b - a for n, (a, b) in spans.items()}
            side.send_tensors(
                args.leader_side_rank(side, llm, t), tensors, {"step": step, "rows": rows}
            )
        grads = {c.name: [] for c in crossings}
        for t, _lo, _hi in routes:
            meta, received = side.recv_tensors(args.leader_side_rank(side, llm, t), st.device)
            if meta["step"] != step:
                raise RuntimeError(f"{part} group got step {meta['step']} gradients at step {step}")
            for name, g in received.items():
                grads[name].append(g)
        t_wait += time.perf_counter() - t1

        t2 = time.perf_counter()
        outs, out_grads = [], []
        for name, out in outputs.items():
            # sp: non-leaders hold an empty slice but must join the backward;
            # tp: every rank holds the replicated output and needs the full gradient
            has = st.leader and real
            grad = torch.cat(grads[name]).to(st.device) if has else torch.zeros_like(out)
            if st.is_tp:
                dist.broadcast(grad, src=st.mp_src, group=st.mp_mesh.get_group())
            outs.append(out)
            out_grads.append(grad.to(st.device, out.dtype))
        if outs:
            torch.autograd.backward(outs, out_grads)
        stats = st.layout.new()
        if st.leader:
            for name, n in counts.items():
                stats[st.layout.index[name]] = n
        ids = [s.get("id") for s in samples]
        st.finish(step, stats, t_compute + time.perf_counter() - t2, t_wait, sample_ids=ids)
