"""The LLM group's side of an objective (``train_loop_config["objective"]``,
:mod:`ray_disagg.objectives`): a sample's sequences, its crossings repeated for each of
them, the policy's, the reference's and (``num_iterations > 1``) the old per-token
log-probabilities (the sequence of each label position:
:func:`ray_disagg.worker.llm_batch.sequence_index`), the step's values from its whole
global batch (:meth:`~ray_disagg.objectives.Objective.prepare_step`), and the
objective's loss and metrics of a microbatch.

A sample's sequences (DPO: chosen, rejected; GRPO: a prompt's completions) share the
sample's encoder outputs: the encoder group encodes the sample once; here its crossing
rows are repeated for each sequence, so the gradients of all its sequences add up in the
rows the encoder gets back.
The reference's log-probabilities come from the frozen copy of each trained part
(``ReferenceCopy``; a trained encoder sends its copy's outputs under :data:`REF` names),
or from the trained model itself where the part is frozen.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
import torch.distributed as dist

from ray_disagg.models.packing import host_to_device
from ray_disagg.objectives import TokenLogps
from ray_disagg.pipeline.assignment import count_label_tokens
from ray_disagg.worker.llm_batch import LossInputs, collate, sequence_index, token_logps
from ray_disagg.worker.metrics import plain
from ray_disagg.worker.part_worker import PartWorker

__all__ = ["REF", "ObjectiveRunner", "repeat_rows", "sequence_index"]

REF = "ref/"
"""Prefix of the crossing names that carry a trained encoder's reference outputs."""


def repeat_rows(received: dict, rows: dict, counts: list[int]) -> dict:
    """``received`` (per crossing, the rows of each sample in order, sizes ``rows``) with
    each sample's rows repeated ``counts[i]`` times, in the order of the sequences."""
    out = {}
    for name, t in received.items():
        pieces = t.split(rows[name])
        out[name] = torch.cat([p for p, k in zip(pieces, counts) for _ in range(k)])
    return out


class ObjectiveRunner:
    """Runs a microbatch of an objective on one LLM worker: ``w`` its ``PartWorker``,
    ``reference`` its reference ``PartModel`` (``None``: a frozen LLM or ``"precompute"``,
    the trained part itself runs the reference's forwards)."""

    def __init__(self, w: PartWorker, reference):
        self.w, self.obj, self.reference = w, w.ctx.cfg.objective, reference
        n = len(self.obj.metric_names)
        self.sums = torch.zeros(n, dtype=torch.float64, device=w.ctx.device)
        self.step_values = [0.0] * len(self.obj.step_metric_names)  # this rank's share
        self.totals = (1.0, 1.0, 1.0)  # the global batch's samples, sequences, label tokens
        self.step, self.iteration = None, 0  # prepare_step's values; the step's iteration
        self.old = {}  # a microbatch's batch positions -> the first iteration's token log-probs
        self.load = None  # the LLM's moe.ExpertLoad, set by its owner
        self.reported = None  # the last microbatch's loss as reported (see loss)
        self.recording, self.recorded = False, []  # the reference's pass (precompute)
        self.table = {}  # record id -> the reference's log-prob of each of its sequences

    def sequences(self, samples: list[dict]) -> tuple[list[dict], list[int]]:
        seqs = [self.obj.sequences(s) for s in samples]
        return [q for ss in seqs for q in ss], [len(ss) for ss in seqs]

    def label_tokens(self, samples: list[dict]) -> int:
        return self.counts(samples)[1]

    def counts(self, samples: list[dict]) -> tuple[int, int]:
        """``(sequences, label tokens)`` of ``samples``."""
        seqs, _ = self.sequences(samples)
        return len(seqs), sum(count_label_tokens(self.w.ctx.adapter.labels(q)) for q in seqs)

    def begin_step(self, step: int, items: dict, totals: tuple[float, float, float]) -> None:
        """A training step begins (every LLM rank): ``items``, this replica's samples by
        batch position; ``totals``: the global batch's samples, sequences and label
        tokens. Runs the objective's :meth:`prepare_step` on the global batch."""
        ctx, obj = self.w.ctx, self.obj
        self.totals, self.iteration = totals, step % obj.num_iterations
        if self.iteration == 0:
            self.old = {}
        self.step, metrics = None, {}
        if obj.step_keys:
            mine = []
            if ctx.leader:
                keys = ("id", *obj.step_keys)
                mine = [(p, {k: s.get(k) for k in keys}) for p, s in items.items()]
            gathered = [None] * dist.get_world_size(ctx.rt.object_group)
            dist.all_gather_object(gathered, mine, group=ctx.rt.object_group)
            batch = [s for _, s in sorted((e for part in gathered for e in part), key=_first)]
            self.step, metrics = obj.prepare_step(batch)
        first = ctx.leader and ctx.dp_rank == 0  # the step's values are written once
        self.step_values = [float(metrics[n]) if first else 0.0 for n in obj.step_metric_names]

    def loss(self, policy, positions, samples, received, rows, grad: bool):
        """The microbatch's loss (its metric shares added to :attr:`sums`); ``policy``:
        the trained part's ``PartModel``; ``positions``: its samples' batch positions.
        While :attr:`recording` (the reference's pass), the policy's log-probs are kept
        by record id instead and the loss is 0."""
        w, adapter = self.w, self.w.ctx.adapter
        seqs, counts = self.sequences(samples)
        batch = collate(w.ctx, seqs, sequences=True)
        piece = batch.pop("context", None)  # this rank's context-parallel slice
        own = {k: v for k, v in received.items() if not k.startswith(REF)}
        if self.recording:  # the initial model, as the reference copy runs (eval mode)
            model = dataclasses.replace(policy, shares_root=True)
            logps, _ = self._run(model.run, model, batch, repeat_rows(own, rows, counts), piece)
            totals = _sequence_totals(logps.detach(), batch, piece)
            self.recorded.append(([s.get("id") for s in samples], totals, counts))
            self.reported = logps.new_zeros(())
            return self.reported
        ref, ref_totals = self._reference(
            policy, samples, batch, own, received, rows, counts, piece
        )
        if grad and adapter.router is not None:
            batch["router"] = w.ctx.token_group
        own_rows = repeat_rows(own, rows, counts)
        logps, aux = self._run(policy.runner, policy, batch, own_rows, piece)
        tokens = [count_label_tokens(adapter.labels(q)) for q in seqs]
        fields = ("id", *self.obj.fields)
        inputs = TokenLogps(
            policy=logps,
            reference=ref,
            old=self._old(positions, logps) if grad else None,
            sequence=batch["loss_seq"],
            tokens=host_to_device(torch.tensor(tokens, dtype=torch.float32), logps.device),
            samples=[{k: s[k] for k in fields if k in s} for s in samples],
            positions=list(positions),
            global_samples=self.totals[0],
            global_sequences=self.totals[1],
            global_tokens=self.totals[2],
            step=self.step,
            whole=1.0 if piece is None or piece.rank == 0 else 0.0,
            group=None if piece is None else piece.group,
            reference_totals=ref_totals,
        )
        loss, metrics = self.obj.loss(inputs)
        for i, name in enumerate(self.obj.metric_names):
            self.sums[i] += metrics[name].detach().double()
        # the reported loss: this rank's share (summed over the replica's cp ranks)
        self.reported = loss.detach() + (0.0 if aux is None else aux.detach())
        return loss if aux is None else loss + aux

    def _old(self, positions, logps) -> torch.Tensor | None:
        """The policy's token log-probs from the first iteration on the samples at these
        batch positions (``num_iterations > 1``; ``None`` in the first iteration, which
        keeps them)."""
        if self.obj.num_iterations == 1:
            return None
        key = tuple(positions)
        if self.iteration == 0:
            self.old[key] = logps.detach()
            return None
        if key not in self.old:
            raise ValueError(
                f"batch positions {list(key)}: no log-probs from the first of num_iterations="
                f"{self.obj.num_iterations} steps on them (the run resumed inside a "
                "generation); resume from a checkpoint at a multiple of num_iterations "
                "(checkpoint_every a multiple of it)."
            )
        return self.old[key]

    def _reference(self, policy, samples, batch, own, received, rows, counts, piece):
        """``(the reference's token log-probs, its precomputed per-sequence totals)``,
        either ``None``: a forward of the copy / the adapter-free or frozen part (before
        the policy's, so its backward follows at once), or the precomputed values."""
        if not self.obj.needs_reference:
            return None, None
        if self.obj.reference == "precompute":
            return None, self._precomputed(samples)
        ref = self.reference or dataclasses.replace(policy, shares_root=True)
        ref_in = {k: received.get(REF + k, v).detach() for k, v in own.items()}
        with torch.no_grad(), self.uncounted():
            logps, _ = self._run(ref.run, ref, batch, repeat_rows(ref_in, rows, counts), piece)
        return logps, None

    def _precomputed(self, samples) -> torch.Tensor:
        values = []
        for s in samples:
            if s.get("id") not in self.table:
                raise ValueError(
                    f"sample {s.get('id')!r} has no precomputed reference log-probs: the "
                    "training set changed since they were computed (at the run's start); "
                    "start a new run, or use DPO(reference='copy')."
                )
            values += self.table[s["id"]]
        return host_to_device(torch.tensor(values, dtype=torch.float32), self.w.ctx.device)

    @contextlib.contextmanager
    def uncounted(self):
        """The MoE routers' load is not counted (the reference's forward, which may run
        the trained model with its adapters off)."""
        load = self.load
        active = load is not None and load.active
        if active:
            load.active = False
        try:
            yield
        finally:
            if active:
                load.active = True

    def _run(self, run, model, batch, received, piece):
        """``(token log-probs, router aux loss)`` of ``model`` (a ``PartModel``) through
        ``run`` (its runner, or its forward-only ``run``); ``piece``: this rank's
        context-parallel slice, or ``None``."""
        ctx = self.w.ctx
        inputs = LossInputs.of_part(
            ctx, model.parallel, batch, received, piece, temperature=self.obj.temperature
        )
        with torch.autocast(ctx.device.type, torch.bfloat16, enabled=ctx.cfg.bf16):
            return run(functools.partial(token_logps, inputs))

    def start_recording(self) -> None:
        """The reference's pass begins: the policy's log-probs are kept by record id."""
        self.recording, self.recorded = True, []

    def finish_recording(self) -> list:
        """After the reference's pass: every sample's ``[id, log-prob of each of its
        sequences]`` on every LLM rank (gathered from the replicas' leaders over the
        group's gloo group), as the checkpoint keeps them: ``[[id, *values], ...]``."""
        w, mine = self.w, []
        if w.ctx.leader:
            for ids, logps, counts in self.recorded:
                values = logps.tolist()
                ends = [sum(counts[: k + 1]) for k in range(len(counts))]
                for i, end, n in zip(ids, ends, counts):
                    mine.append([plain(i), *values[end - n : end]])
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine, group=w.ctx.rt.object_group)
        self.recording, self.recorded = False, []
        return [e for part in gathered for e in part]

    def load_table(self, entries: list, ids: set) -> None:
        """Take ``entries`` (``[[id, *values], ...]``) for the training set whose sample
        ids are ``ids``; ``ValueError`` on every rank alike when they differ (another
        dataset than the one they were computed for, ids missing or repeated)."""
        self.table = {e[0]: list(e[1:]) for e in entries}
        num_samples = self.w.ctx.args.plan.num_samples
        if set(self.table) != ids or len(ids) != num_samples:
            missing = sorted(map(str, ids - set(self.table)))[:5]
            raise ValueError(
                f"the precomputed reference log-probs cover {len(self.table)} sample ids, "
                f"the training set has {len(ids)} distinct ids in {num_samples} "
                f"samples (not covered e.g. {missing}): give every pair a unique 'id', and "
                "resume with the training set the values were computed for (or start a new "
                "run, or use DPO(reference='copy'))."
            )

    def reset(self) -> None:
        """Forget a step's sums (at the start of every step: an abandoned one's too)."""
        self.sums.zero_()

    def take_metrics(self) -> list[float]:
        """The step's metric shares and step values (read once on every rank, at the end
        of the step, after its last gradients were posted; summed over the replica's cp
        ranks), then zeroed."""
        ctx = self.w.ctx
        if ctx.is_cp:
            dist.all_reduce(self.sums, group=ctx.cp_mesh.get_group())
        out = [*self.sums.tolist(), *self.step_values]
        self.reset()
        return out


def _sequence_totals(logps: torch.Tensor, batch: dict, piece) -> torch.Tensor:
    """Each sequence's summed token log-probs (over the replica's cp ranks; no
    gradients)."""
    sums = logps.new_zeros(batch["num_sequences"]).index_add(0, batch["loss_seq"], logps)
    if piece is not None:
        dist.all_reduce(sums, group=piece.group)
    return sums


def _first(entry):
    return entry[0]
