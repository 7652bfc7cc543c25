"""A :class:`~ray_disagg.data.stream.ConversationStream` read by the LLM group, resumable.

Every LLM rank holds a :class:`RecordSource`; the data-parallel leaders read. Leader ``d``
of ``n`` converts the epoch's records ``d, d + n, ...`` (``epoch_order``) in order and
takes each step's ``global_batch_size / n`` samples from them. Every read ends with one
small all-reduce over the group's gloo object group, so all ranks agree on:

- the epoch's end: when any leader runs out of records, every leader starts the next
  epoch (records it had read for the unfinished batch are not used this epoch);
- the broken (a sequence shorter than the LLM's context-parallel degree counts as
  broken) and too-long records so far (metrics ``records_bad`` /
  ``records_too_long``); more than ``max_bad_records`` broken ones fail the run, naming
  the ones seen.

With balanced assignment every LLM rank also gets the costs of the step's samples
(computed with each sample by the converting actors) to split the encoders' work by.

Under a token budget (``max_tokens_per_microbatch``: a
:class:`~ray_disagg.pipeline.budget.StreamBudgetPlan`) each leader fills its own
microbatches with the samples that fit; the first that does not waits for the leader's
next step (a checkpoint's position is before it, so a resume reads it again); a sample
over the budget is a too-long record. Every LLM rank gets the step's layout (samples per
leader and microbatch, their costs). An epoch in which no leader made a step (every
record broken or too long) fails the run instead of starting the next one.

The position (epoch, records read per leader, counts) is gathered at checkpoint steps and
saved with the LLM checkpoint (``data_state.json``); a restart or resume starts from it.
"""

from __future__ import annotations

import logging
import pickle

import numpy as np
import torch
import torch.distributed as dist

from ray_disagg.data.preference import sequence_lengths
from ray_disagg.data.stream import BAD, LONG, OK, epoch_order
from ray_disagg.pipeline.budget import StreamBudgetPlan

logger = logging.getLogger(__name__)


class RecordSource:
    def __init__(
        self,
        stream,
        plan,
        group: str,
        dp_rank: int,
        leader: bool,
        object_group,
        state: dict | None,
    ):
        self.stream, self.leader, self.object_group = stream, leader, object_group
        self.dp, self.dp_rank = plan.dp_sizes[group], dp_rank
        self.seed, self.shuffle = plan.seed, plan.shuffle
        self.per_step = plan.global_batch_size // self.dp
        self.min_tokens = plan.min_tokens
        self.balanced = plan.streamed_costs  # the step's costs go to every LLM rank
        self.budget = plan if isinstance(plan, StreamBudgetPlan) else None
        self.parts = stream.adapter.parts
        self.step_costs = None  # the last step's, when balanced
        self.epoch, self.pos, self.bad, self.long = self._resume(state)
        self.totals = (0, 0)  # every leader's (bad, too long), as of the last read
        self.bad_names: list[str] = []  # this leader's broken records in this attempt
        self.waiting = None  # budget: (its position, the read) of a sample left for the next step
        self.resumed = self.pos > 0  # this epoch was not read from its start
        self.steps_this_epoch = 0
        self._records = None

    def _key(self) -> dict:
        return {"records": self.stream.num_records, "seed": self.seed, "shuffle": self.shuffle}

    def _resume(self, state: dict | None) -> tuple[int, int, int, int]:
        if state is None:
            return 0, 0, 0, 0
        if {k: state.get(k) for k in self._key()} != self._key():
            logger.warning(
                "the checkpoint's data position is for other records or another order "
                "(%s, now %s): reading this stream from its start",
                {k: state.get(k) for k in self._key()},
                self._key(),
            )
            return 0, 0, 0, 0
        bad, long = sum(state["bad"]), sum(state["long"])  # kept by leader 0
        if state["dp"] != self.dp:
            logger.warning(
                "the checkpoint was read by %d LLM replicas, now %d: the positions do not "
                "carry over, reading from the start of epoch %d",
                state["dp"],
                self.dp,
                state["epoch"] + 1,
            )
            first = self.dp_rank == 0
            return state["epoch"] + 1, 0, bad if first else 0, long if first else 0
        d = self.dp_rank
        return state["epoch"], state["positions"][d], state["bad"][d], state["long"][d]

    def _fill(self) -> list | None:
        """The step's samples, or ``None`` when this leader's records ran out."""
        if self.budget is not None:
            return self._fill_budget()
        out = []
        while len(out) < self.per_step:
            got = self._next()
            if got is None:
                return None
            out.append(got)
        return out

    def _next(self) -> tuple | None:
        """The next sample read ``(record, sample, costs)``, or ``None`` at the end of
        this leader's records (broken and too-long records counted and skipped)."""
        while True:
            if self._records is None:
                order = epoch_order(self.stream.num_records, self.seed, self.epoch, self.shuffle)
                mine = order[self.dp_rank :: self.dp][self.pos :]
                self._records = iter(self.stream.outcomes(mine))
            outcome = next(self._records, None)
            if outcome is None:
                return None
            self.pos += 1
            if outcome["status"] == OK:
                sample = pickle.loads(outcome["sample"])
                got = (outcome["record"], sample, list(outcome["costs"]))
                outcome = self._unfit(sample)
                if outcome is None:
                    return got
            logger.warning("skipped %s", outcome["message"])
            if outcome["status"] == BAD:
                self.bad += 1
                self.bad_names.append(outcome["message"])
            else:
                self.long += 1

    def _unfit(self, sample) -> dict | None:
        """The outcome of a converted sample this run cannot train (``None``: it can):
        shorter than the context-parallel degree (broken), over the budget (too long)."""
        n = min(sequence_lengths(sample))
        if n < self.min_tokens:
            why = (
                f"fewer than the LLM group's ContextParallel(size={self.min_tokens}) (every "
                "rank needs a token of each sequence; lower the size to train such records)"
            )
            return {"status": BAD, "message": f"record {sample.get('id')!r}: {n} tokens, {why}"}
        too_long = self.budget is not None and self._over_budget(sample)
        return {"status": LONG, "message": too_long} if too_long else None

    def _sizes(self, sample) -> tuple[tuple, dict[str, int]]:
        """The sample's LLM sequence lengths and each encoder's input patches."""
        adapter = self.stream.adapter
        patches = {p: adapter.encoder_patches(p, sample) for p in adapter.encoder_parts}
        return tuple(sequence_lengths(sample)), patches

    def _over_budget(self, sample) -> str | None:
        why = self.budget.over_budget(*self._sizes(sample))
        return why and f"record {sample.get('id')!r} {why}"

    def _fill_budget(self) -> list | None:
        """This leader's step under the budget: its microbatches' samples in order."""
        parts = {p: 1 for p in self.stream.adapter.encoder_parts}
        reads, lengths, patches = [], {}, {p: {} for p in parts}
        shape = (self.budget.micro_batches, 1, parts)
        filler = self.budget.filler(lengths, patches, self.budget.per_replica, shape)
        step = filler.new_step()
        while True:
            if self.waiting:
                (start, got), self.waiting = self.waiting, None
            else:
                got, start = self._next(), self.pos - 1  # the sample's own record
            if got is None:
                return None
            i = len(reads)
            reads.append(got)
            lengths[i], sizes = self._sizes(got[1])
            for p, n in sizes.items():
                patches[p][i] = n
            placed = filler.place(step, i)
            if not placed:  # every microbatch holds a sample already
                self.waiting = (start, got)
            if not placed or step.count == self.budget.per_replica:
                self.counts = [len(mb[0]) for mb in step.llm]
                return [reads[i] for mb in step.llm for i in mb[0]]

    def take(self, step: int, positions: list[int]) -> list[tuple[int, dict]]:
        """Collective over the group: this leader's samples of the step (``[]`` off the
        leaders), in record order (under a budget: by microbatch)."""
        while True:
            got = self._fill() if self.leader else []
            mine = [got is None, self.bad, self.long, self.resumed] if self.leader else [0] * 4
            flags = torch.tensor(mine, dtype=torch.float64)
            dist.all_reduce(flags, group=self.object_group)
            self.totals = (int(flags[1]), int(flags[2]))
            self._check_bad()
            if not flags[0]:
                self.steps_this_epoch += 1
                return self._share(got, positions)
            if not self.steps_this_epoch and not flags[3]:
                self._no_step()
            self.epoch, self.pos, self._records = self.epoch + 1, 0, None
            self.waiting, self.resumed, self.steps_this_epoch = None, False, 0

    def _share(self, got: list, positions: list[int]) -> list[tuple[int, dict]]:
        """Collective: the step's reads, with (balanced, budget) the step's costs or
        layout gathered on every LLM rank."""
        costs = [c for _, _, c in got]
        if self.budget is not None:
            mine = (self.counts, costs) if self.leader else None
            every = [None] * dist.get_world_size(self.object_group)
            dist.all_gather_object(every, mine, group=self.object_group)
            every = [e for e in every if e is not None]
            self.step_costs = {"counts": [e[0] for e in every], "costs": self._by_part(
                [c for e in every for c in e[1]])}  # fmt: skip
        elif self.balanced:
            assert not self.leader or len(got) == len(positions)
            self.step_costs = self._gather_costs(costs)
        return [(i, sample) for i, sample, _ in got]

    def _no_step(self) -> None:
        raise ValueError(
            f"Epoch {self.epoch} of the conversation stream ({self.stream.num_records} records) "
            f"made no step: {self.totals[0]} broken and {self.totals[1]} too-long records so "
            "far (over max_seq_len or max_tokens_per_microbatch / max_patches_per_microbatch), "
            "and too few samples left for one step of every LLM replica. Check the records "
            "(the warnings name them), or raise the limits."
        )

    def _gather_costs(self, mine: list[list[float]]) -> dict[str, np.ndarray]:
        """Collective: per part, the cost of every position of the global batch (the
        leaders' contiguous shares in replica order)."""
        every = [None] * dist.get_world_size(self.object_group)
        dist.all_gather_object(every, mine if self.leader else None, group=self.object_group)
        return self._by_part([c for part in every if part is not None for c in part])

    def _by_part(self, costs: list[list[float]]) -> dict[str, np.ndarray]:
        rows = np.asarray(costs, np.float64).reshape(len(costs), len(self.parts))
        return {part: rows[:, k] for k, part in enumerate(self.parts)}

    def _check_bad(self) -> None:
        limit = self.stream.max_bad_records
        if self.totals[0] <= limit:
            return
        names = [None] * dist.get_world_size(self.object_group)
        dist.all_gather_object(names, self.bad_names, group=self.object_group)
        shown = [n for part in names for n in part][:20]
        raise ValueError(
            f"{self.totals[0]} broken records, more than max_bad_records={limit}; the "
            f"ones seen in this attempt: {shown}. Fix or remove them, or raise "
            "ConversationStream(max_bad_records=...)."
        )

    def state(self) -> dict:
        """Collective over the group: the position of every leader (for the checkpoint)."""
        pos = self.waiting[0] if self.waiting else self.pos  # a waiting sample: read again
        mine = [pos, self.bad, self.long] if self.leader else None
        every = [None] * dist.get_world_size(self.object_group)
        dist.all_gather_object(every, mine, group=self.object_group)
        every = [m for m in every if m is not None]  # leaders, in dp order
        return {
            **self._key(),
            "dp": self.dp,
            "epoch": self.epoch,
            "positions": [m[0] for m in every],
            "bad": [m[1] for m in every],
            "long": [m[2] for m in every],
        }

    def metrics(self) -> dict:
        return {
            "epoch": self.epoch,
            "records_bad": self.totals[0],
            "records_too_long": self.totals[1],
        }
