"""Training loop of an encoder group's workers (vision, audio, ...).

At the start of a step encoder replica ``d`` (its model-parallel rank 0) receives, from
every LLM replica, the encoder fields of the samples it encodes in each microbatch
(``BatchPlan.assign``) and shares them with its SP/TP peers. Then it runs a two-stage
1F1B schedule against the LLM group: the forward of microbatch ``i`` (its crossing
tensors posted to each LLM replica, asynchronously) as long as fewer than
``max_in_flight`` microbatches await their gradients, otherwise the backward of the
oldest one as soon as its gradients are back. ``max_in_flight=1`` is the sequential
schedule. Gradients accumulate over the microbatches; the reduction and the optimizer
step run once per step.
"""

from __future__ import annotations

import functools
import time

import torch
import torch.distributed as dist

from ray_disagg.parallel import tensor_parallel as tp
from ray_disagg.parallel import ulysses
from ray_disagg.worker import common as lc
from ray_disagg.worker.stage import Stage


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
    sp = st.mp_mesh.get_group() if st.is_sp else None

    def run(model):
        return st.adapter.encode(model, st.part, samples, st.device, sp=sp)

    with torch.autocast(st.device.type, torch.bfloat16, enabled=st.cfg.bf16):
        return st.runner(run)


def _receive_inputs(st: Stage, plan, step: int, key):
    """Per microbatch: its samples (LLM replicas in order) and ``(llm replica, count)``,
    from every LLM replica it shares samples with this step (``key``: the step's name in
    messages; validation steps have their own)."""
    args, llm = st.args, st.adapter.llm_part
    mbs = [([], []) for _ in range(plan.micro_batches)]
    for t in plan.peers(st.part, st.dp_rank, llm, step):
        meta, _ = st.side.recv_tensors(args.leader_side_rank(st.side, llm, t))
        if meta["step"] != key:
            raise RuntimeError(f"{st.part} group got step {meta['step']} inputs at step {key}")
        for (samples, routes), sub in zip(mbs, meta["mbs"]):
            if sub:
                samples += sub
                routes.append((t, len(sub)))
    return mbs


class _Microbatch:
    """One microbatch in flight: its outputs (holding the graph) until its backward."""

    def __init__(self, st: Stage, tower, samples, routes, step, j: int, grad: bool = True):
        self.samples, self.routes, self.j, self.handles = samples, routes, j, []
        # FSDP2: every rank must run the same units; one without inputs runs a stand-in
        self.counts = st.adapter.item_counts(st.part, samples)
        self.real = not st.fsdp or sum(self.counts.values()) > 0
        inputs = samples if self.real else st.adapter.stand_in_samples(st.part)
        with torch.set_grad_enabled(grad):  # forward only: frozen group, validation
            self.outputs = _encode(st, inputs)
        self.offsets = _row_offsets(st.adapter, st.part, samples)
        if st.leader:
            self._send(st, step)
        if not grad:
            self.outputs = None

    def _send(self, st: Stage, step: int) -> None:
        first, llm = 0, st.adapter.llm_part
        for t, n in self.routes:
            tensors = {}
            for c in st.adapter.crossings(st.part):
                a, b = self.offsets[c.name][first], self.offsets[c.name][first + n]
                if b > a:
                    tensors[c.name] = self.outputs[c.name][a:b].detach()
            first += n
            dst = st.args.leader_side_rank(st.side, llm, t)
            st.pending.append(
                st.side.send_tensors(dst, tensors, {"step": step, "mb": self.j}, False)
            )

    def backward(self, st: Stage, tower, step: int) -> float:
        """Receive the gradients and run backward; returns the seconds spent waiting."""
        grads = {c.name: [] for c in st.adapter.crossings(st.part)}
        t_wait = time.perf_counter()
        if st.leader:
            for t, _n in self.routes:
                src = st.args.leader_side_rank(st.side, st.adapter.llm_part, t)
                meta, received = st.side.recv_tensors(src, st.device)
                if (meta["step"], meta["mb"]) != (step, self.j):
                    raise RuntimeError(
                        f"{st.part} group got step {meta['step']} microbatch {meta['mb']} "
                        f"gradients at step {step} microbatch {self.j}"
                    )
                for name, g in received.items():
                    grads[name].append(g)
        for handle in self.handles:  # answered, so delivered: release the send buffers
            handle.wait()
        self.handles = []
        t_wait = time.perf_counter() - t_wait
        outs, out_grads = [], []
        for name, out in self.outputs.items():
            # sp: non-leaders hold an empty slice but must join the backward;
            # tp: every rank holds the replicated output and needs the full gradient
            has = st.leader and self.real
            grad = torch.cat(grads[name]).to(st.device) if has else torch.zeros_like(out)
            grad = grad.to(st.device, out.dtype)
            if st.is_tp:
                dist.broadcast(grad, src=st.mp_src, group=st.mp_mesh.get_group())
            outs.append(out)
            out_grads.append(grad)
        if outs:
            torch.autograd.backward(outs, out_grads)
            st.backward_passes += 1
        self.outputs = None
        return t_wait


def _forward_only(st: Stage, tower, mbs, key) -> dict[str, int]:
    """A step's microbatches forward only, one at a time; returns the item counts."""
    counts: dict[str, int] = {}
    for j, (samples, routes) in enumerate(mbs):
        mb = _Microbatch(st, tower, samples, routes, key, j, grad=False)
        for name, n in mb.counts.items():
            counts[name] = counts.get(name, 0) + n
    st.wait_pending()
    return counts


def _evaluate(st: Stage, tower, plan, step: int) -> list[float]:
    """Encode the validation set for the LLM group (which computes the loss)."""
    for v in range(plan.steps_per_epoch):
        key = ("val", step, v)
        mbs = _receive_inputs(st, plan, v, key) if st.leader else None
        _forward_only(st, tower, st.broadcast_object(mbs), key)
    return [0.0, 0.0]


def encoder_train_loop(args: lc.LoopArgs, part: str) -> None:
    st = Stage(args, part)
    adapter, cfg = st.adapter, st.cfg
    model = st.build()
    tower = adapter.part_roots(model, part)[0]
    if st.is_sp:
        ulysses.enable_ulysses(tower)
    if st.is_tp:
        tp.parallelize_vision(tower, adapter.tower_tp_plan(part), st.mp_mesh)
    start = st.setup(model)
    k, limit = cfg.micro_batches, cfg.max_in_flight or 1
    evaluate = None
    if args.val_plan is not None:
        evaluate = functools.partial(_evaluate, st, tower, args.val_plan)

    for step in range(start, cfg.max_steps):
        lc.maybe_inject_failure(cfg, part, st.group_rank, step)
        t_wait = time.perf_counter()
        mbs = _receive_inputs(st, args.plan, step, step) if st.leader else None
        t_wait = time.perf_counter() - t_wait
        t_compute = time.perf_counter()
        mbs = st.broadcast_object(mbs)
        t_compute = time.perf_counter() - t_compute
        in_flight, done, peak = [], 0, 0
        counts: dict[str, int] = {}
        if st.frozen:  # nothing to train: forward only, no gradients come back
            t0 = time.perf_counter()
            counts, done, peak = _forward_only(st, tower, mbs, step), k, 1
            t_compute += time.perf_counter() - t0
        while done < k:
            t0 = time.perf_counter()
            if len(in_flight) + done < k and len(in_flight) < limit:  # forward the next one
                j = len(in_flight) + done
                lc.maybe_inject_failure(cfg, part, st.group_rank, step, j)
                mb = _Microbatch(st, tower, *mbs[j], step, j)
                in_flight.append(mb)
                peak = max(peak, len(in_flight))
                for name, n in mb.counts.items():
                    counts[name] = counts.get(name, 0) + n
                t_compute += time.perf_counter() - t0
            else:  # the oldest one's gradients (waiting for them is the bubble)
                mb = in_flight.pop(0)
                waited = mb.backward(st, tower, step)
                done += 1
                t_wait += waited
                t_compute += time.perf_counter() - t0 - waited
        t1 = time.perf_counter()
        st.wait_pending()
        t_wait += time.perf_counter() - t1
        stats = st.layout.new()
        if st.leader:
            for name, n in counts.items():
                stats[st.layout.index[name]] = n
        ids = [s.get("id") for samples, _ in mbs for s in samples]
        st.finish(step, stats, t_compute, t_wait, sample_ids=ids, inflight=peak, evaluate=evaluate)
