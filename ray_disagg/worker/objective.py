"""The LLM group's side of a per-sequence objective (``train_loop_config["objective"]``,
:mod:`ray_disagg.objectives`): a sample's sequences, its crossings repeated for each of
them, the policy's and the reference's per-sequence log-probabilities (the sequence of
each label position: :func:`ray_disagg.worker.llm_batch.sequence_index`), and the
objective's loss and metrics of a microbatch.

A sample's sequences (DPO: chosen, rejected) share the sample's encoder outputs: the
encoder group encodes the sample once; here its crossing rows are repeated for each
sequence, so the gradients of both sequences add up in the rows the encoder gets back.
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
from ray_disagg.objectives import SequenceLogps
from ray_disagg.pipeline.assignment import count_label_tokens
from ray_disagg.worker.llm_batch import LossInputs, collate, sequence_index, sequence_logps
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
        self.samples = 0  # of this step, on this replica
        self.load = None  # the LLM's moe.ExpertLoad, set by its owner
        self.reported = None  # the last microbatch's loss as reported (see loss)
        self.recording, self.recorded = False, []  # the reference's pass (precompute)
        self.table = {}  # record id -> the reference's log-prob of each of its sequences

    def sequences(self, samples: list[dict]) -> tuple[list[dict], list[int]]:
        seqs = [self.obj.sequences(s) for s in samples]
        return [q for ss in seqs for q in ss], [len(ss) for ss in seqs]

    def label_tokens(self, samples: list[dict]) -> int:
        seqs, _ = self.sequences(samples)
        return sum(count_label_tokens(self.w.ctx.adapter.labels(q)) for q in seqs)

    def loss(self, policy, samples, received, rows, global_samples: float, grad: bool):
        """The microbatch's loss (its metric sums added to :attr:`sums`); ``policy``: the
        trained part's ``PartModel``. While :attr:`recording` (the reference's pass), the
        policy's log-probs are kept by record id instead and the loss is 0."""
        w, adapter = self.w, self.w.ctx.adapter
        seqs, counts = self.sequences(samples)
        self.samples += len(samples)
        batch = collate(w.ctx, seqs, sequences=True)
        piece = batch.pop("context", None)  # this rank's context-parallel slice
        own = {k: v for k, v in received.items() if not k.startswith(REF)}
        if self.recording:  # the initial model, as the reference copy runs (eval mode)
            model = dataclasses.replace(policy, shares_root=True)
            logps, _ = self._run(model.run, model, batch, repeat_rows(own, rows, counts), piece)
            self.recorded.append(([s.get("id") for s in samples], logps, counts))
            self.reported = logps.new_zeros(())
            return self.reported
        ref_logps = self._reference(policy, samples, batch, own, received, rows, counts, piece)
        if grad and adapter.router is not None:
            batch["router"] = w.ctx.token_group
        own_rows = repeat_rows(own, rows, counts)
        logps, aux = self._run(policy.runner, policy, batch, own_rows, piece)
        tokens = [count_label_tokens(adapter.labels(q)) for q in seqs]
        fields = ("id", *self.obj.fields)
        inputs = SequenceLogps(
            policy=logps,
            reference=ref_logps,
            tokens=host_to_device(torch.tensor(tokens, dtype=torch.float32), logps.device),
            samples=[{k: s[k] for k in fields if k in s} for s in samples],
            global_samples=global_samples,
        )
        loss, metrics = self.obj.loss(inputs)
        for i, name in enumerate(self.obj.metric_names):
            self.sums[i] += metrics[name].detach().double()
        # the reported loss: the objective's once per replica (whole on every cp rank),
        # the router's auxiliary share from every rank
        whole = not w.ctx.is_cp or w.ctx.cp_mesh.get_local_rank() == 0
        self.reported = (loss.detach() if whole else torch.zeros_like(loss.detach())) + (
            0.0 if aux is None else aux.detach()
        )
        return loss if aux is None else loss + aux

    def _reference(self, policy, samples, batch, own, received, rows, counts, piece):
        """The reference's per-sequence log-probs (``None`` when the objective needs
        none): precomputed, or a forward of the copy / the adapter-free or frozen part
        (before the policy's, so its backward follows at once)."""
        if not self.obj.needs_reference:
            return None
        if self.obj.reference == "precompute":
            return self._precomputed(samples)
        ref = self.reference or dataclasses.replace(policy, shares_root=True)
        ref_in = {k: received.get(REF + k, v).detach() for k, v in own.items()}
        with torch.no_grad(), self.uncounted():
            logps, _ = self._run(ref.run, ref, batch, repeat_rows(ref_in, rows, counts), piece)
        return logps

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
        """``(per-sequence log-probs, router aux loss)`` of ``model`` (a ``PartModel``)
        through ``run`` (its runner, or its forward-only ``run``); ``piece``: this rank's
        context-parallel slice, or ``None``."""
        ctx = self.w.ctx
        inputs = LossInputs.of_part(ctx, model.parallel, batch, received, piece)
        with torch.autocast(ctx.device.type, torch.bfloat16, enabled=ctx.cfg.bf16):
            return run(functools.partial(sequence_logps, inputs))

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
        self.samples = 0

    def take_metrics(self) -> list[float]:
        """The step's sample count and metric sums (read once, at the end of the step,
        after its last gradients were posted), then zeroed."""
        out = [float(self.samples), *self.sums.tolist()]
        self.reset()
        return out
