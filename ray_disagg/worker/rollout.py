"""The LLM group's side of GRPO's rollouts on the training groups
(``GRPO(rollouts="generate")``): the pass that begins each generating step.

A generating step (the first of each batch's ``num_iterations``) runs, before its update:

1. **Read and exchange** as a forward-only step does, under ``StepKey(step,
   rollout=True)``: the replica's leader reads the step's prompts and sends the encoder
   groups their media, which they encode once, without gradients.
2. **Generate** (per microbatch): each prompt ``num_generations`` times, its crossing
   rows repeated, with the LLM as it is placed for training
   (:func:`ray_disagg.rollout.decode.generate`: a KV cache, the vocabulary split under
   TP, FSDP2 and expert-parallel ranks in lockstep), seeded per (seed, step, prompt id,
   completion), in eval mode.
3. **Score** on each replica's leader (completions decoded with the tokenizer, each
   reward function called as TRL calls it); a failing function fails the step on every
   rank alike, naming the function and the prompts, before anything is saved.

The update then trains on the completed samples as on recorded rollouts, with the same
microbatches (the prompts' assignment: each prompt's completions stay with it, so a
trained tower re-encodes each image once more, with gradients, and a frozen tower's rows
from the rollout are reused: it encodes once per step). Later iterations of the batch
read the prompts again and take the kept completions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from ray_disagg.models.packing import host_to_device
from ray_disagg.parallel import fsdp
from ray_disagg.pipeline.messages import StepKey
from ray_disagg.pipeline.schedule import llm_actions
from ray_disagg.rollout.decode import DecodeSettings, generate, left_padded
from ray_disagg.rollout.rewards import RewardError, score
from ray_disagg.rollout.sampling import completion_keys
from ray_disagg.worker import recovery
from ray_disagg.worker.llm_step import LLMStep, share_crossings
from ray_disagg.worker.objective import repeat_rows
from ray_disagg.worker.session import get_session

__all__ = ["Rollout", "Rollouts", "load_tokenizer"]


@dataclass(frozen=True)
class Rollout:
    """A step's completions as its update takes them (on the replica's leader)."""

    fields: dict
    """Batch position -> the sample's rollout fields (``prompt_input_ids``,
    ``completion_ids``, ``rewards``, ``truncated``)."""
    samples: dict | None = None
    """A generating step: batch position -> the sample as the rollout read it (the update
    reads nothing)."""
    mbs: list | None = None
    """A generating step: its microbatches (``BatchPlan.assign``) as the rollout used them."""
    rows: dict = field(default_factory=dict)
    """``(crossing, batch position) -> rows`` of the encoders the update does not ask
    again (:attr:`parts`)."""
    parts: frozenset = frozenset()
    """Encoder parts whose rollout rows the update reuses (the frozen ones)."""


def load_tokenizer(objective, spec):
    """The tokenizer that decodes completions for the reward functions
    (``GRPO.tokenizer``, else the model's ``pretrained_path``); ``ValueError`` naming the
    fix when there is none."""
    tok = objective.tokenizer
    if tok is not None and not isinstance(tok, (str, bytes)) and not hasattr(tok, "__fspath__"):
        return tok
    path = tok if tok is not None else spec.pretrained_path
    if path is None:
        raise ValueError(
            "train_loop_config['objective'] GRPO generates completions and decodes them for "
            "its reward functions: set GRPO(tokenizer=<a local tokenizer directory or a "
            "tokenizer>), or give HFModelSpec(pretrained_path=...) a saved tokenizer."
        )
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"GRPO's tokenizer: no tokenizer loads from {str(path)!r} ({e}); save one there "
            "(tokenizer.save_pretrained) or set GRPO(tokenizer=...)."
        ) from None


class RolloutStep(LLMStep):
    """The forward-only pass of a generating step (see the module): ``completions``,
    per batch position of this replica, ``(token lists, truncated flags)``."""

    def __init__(self, llm, source, plan, step: int, key: StepKey, reused=frozenset(),
                 greedy: bool = False):  # fmt: skip
        super().__init__(llm, source, plan, step, key, grad=False)
        self.reused, self.greedy, self.rows, self.completions = reused, greedy, {}, {}
        self.generations = 1 if greedy else llm.w.ctx.cfg.objective.num_generations

    def train(self, j: int) -> None:  # the GENERATE of microbatch j
        w, mine = self.w, self.mbs[j][self.w.ctx.part][self.w.ctx.dp_rank]
        ctx = w.ctx
        recovery.agree(w)
        received, _, rows = self.received[j]
        if ctx.leader:
            self._keep_rows(received, rows, mine)
        shared, rows = share_crossings(ctx, received, rows)
        samples, g = [self.items[p] for p in mine], self.generations
        tokens, truncated = draw(self.llm, samples, mine, shared, rows, self.key.step, g,
                                 self.greedy)  # fmt: skip
        for i, p in enumerate(mine):
            self.completions[p] = (tokens[i * g : (i + 1) * g], truncated[i * g : (i + 1) * g])
        self.received[j] = None

    def _keep_rows(self, received: dict, rows: dict, mine: list) -> None:
        """Each sample's rows of the crossings of the reused (frozen) encoders."""
        adapter = self.w.ctx.adapter
        names = {c.name for part in self.reused for c in adapter.crossings(part)}
        for name in names & set(received):
            for p, piece in zip(mine, received[name].split(rows[name])):
                if len(piece):
                    self.rows[(name, p)] = piece


def draw(llm, samples: list[dict], positions: list[int], received: dict, rows: dict, step: int,
         g: int, greedy: bool = False):  # fmt: skip
    """``(completion tokens, truncated)``, ``g`` rows per sample in order, sampled with
    the keys of ``(seed, step, the sample's batch position, completion)`` (or
    ``greedy``), from the LLM part as placed for training (eval mode, no gradients)."""
    w = llm.w
    ctx, obj, adapter = w.ctx, w.ctx.cfg.objective, w.ctx.adapter
    per_row = [s for s in samples for _ in range(g)]
    batch = left_padded(adapter.collate_llm(per_row), [len(s["input_ids"]) for s in per_row])
    batch = {
        k: host_to_device(v, ctx.device) if torch.is_tensor(v) else v for k, v in batch.items()
    }
    crossings = repeat_rows(received, rows, [g] * len(samples))
    keys = completion_keys(ctx.cfg.seed, step, positions, g)
    pad = getattr(adapter.config.text_config, "pad_token_id", None) or 0
    settings = DecodeSettings(
        max_new_tokens=obj.max_completion_length, stop_ids=adapter.stop_token_ids(),
        temperature=obj.temperature, top_k=obj.top_k, top_p=obj.top_p, pad_id=pad,
        suppress_ids=tuple(adapter.placeholder_ids()), greedy=greedy,
    )  # fmt: skip
    part = llm.policy.parallel
    # ranks whose forwards run collectives across replicas decode until all have ended
    sync = dist.group.WORLD if ctx.fsdp or ctx.expert_mesh is not None else None

    def run(model):
        return generate(
            adapter, model, part.lm_head, batch, crossings, keys, settings,
            tp_group=part.tp_group, vocab_start=part.vocab_start, sync_group=sync,
        )  # fmt: skip

    training = llm.model.training
    llm.model.eval()
    try:
        with torch.autocast(ctx.device.type, torch.bfloat16, enabled=ctx.cfg.bf16):
            out = w.runner(run)
    finally:
        llm.model.train(training)
        fsdp.end_forward_only(w.runner)
    return out.tokens, out.truncated


class Rollouts:
    """One LLM worker's rollouts across steps: the completions of the batch in progress
    (kept for its later iterations), the tokenizer and reward functions (leaders), the
    last rollout's ``rollout_s`` and ``reward_s``."""

    def __init__(self, llm):
        self.llm, self.w = llm, llm.w
        ctx = self.w.ctx
        self.obj = ctx.cfg.objective
        self.funcs = self.obj.reward_callables()
        self.tokenizer = load_tokenizer(self.obj, ctx.args.spec) if ctx.leader else None
        self.reused = frozenset(p for p in ctx.adapter.encoder_parts if p in ctx.args.frozen_parts)
        self.actions = llm_actions(ctx.cfg.micro_batches, 1, sends_grads=False)
        self.fields: dict = {}
        self.times = {"rollout_s": 0.0, "reward_s": 0.0}

    def before_update(self, source, step: int) -> Rollout:
        """The rollout of ``step`` when it generates, else the kept completions."""
        args = self.w.ctx.args
        self.times = {"rollout_s": 0.0, "reward_s": 0.0}
        if not args.generates(step):
            return Rollout(fields=self.fields)
        t0 = time.perf_counter()
        key = StepKey(step, rollout=True)
        run = RolloutStep(self.llm, source, args.plan, step, key, self.reused)
        run.run(self.actions)
        t1 = time.perf_counter()
        positions, rewards = self._rewards(run)
        self.fields = {p: self._fields(run, p, r) for p, r in zip(positions, rewards)}
        self.times = {"rollout_s": t1 - t0, "reward_s": time.perf_counter() - t1}
        return Rollout(
            fields=self.fields, samples=run.samples, mbs=run.mbs, rows=run.rows, parts=self.reused
        )

    def evaluate(self, source, step: int) -> list[float]:
        """This rank's sums over the validation prompts' greedy completions
        (:meth:`~ray_disagg.objectives.GRPO.eval_sums`; non-zero on replica leaders)."""
        plan, sums = self.w.ctx.args.val_plan, [0.0] * self.obj.eval_width
        for v in range(plan.steps_per_epoch):
            run = RolloutStep(self.llm, source, plan, v, StepKey(step, v), greedy=True)
            run.run(self.actions)
            _, rewards = self._rewards(run)
            sums = [a + b for a, b in zip(sums, self.obj.eval_sums(rewards))]
        return sums

    def _rewards(self, run: RolloutStep) -> tuple[list[int], list[dict]]:
        """``(this replica's batch positions, each one's rewards)`` on leaders (else empty):
        a failing reward function raises :class:`RewardError` on every rank of the group."""
        ctx, error, positions, rewards = self.w.ctx, None, [], []
        if ctx.leader:
            positions = sorted(run.completions)
            try:  # whatever fails here, every rank hears of it (no rank waits alone)
                records = [self._record(run.samples[p]) for p in positions]
                completions = [run.completions[p][0] for p in positions]
                rewards = self._score(records, completions)
            except RewardError as e:
                error = str(e)
            except Exception as e:
                error = f"scoring the completions of prompts {positions} failed: {e!r}"
        errors = [None] * dist.get_world_size(ctx.rt.object_group)
        dist.all_gather_object(errors, error, group=ctx.rt.object_group)
        failed = [e for e in errors if e is not None]
        if failed:
            raise RewardError(f"{run.key}: {failed[0]}")
        return positions, rewards

    def _score(self, records: list[dict], completions: list) -> list[dict]:
        """Each record's rewards: here, or split over ``reward_workers`` Ray tasks."""
        texts = [[self._decode(c) for c in cs] for cs in completions]
        args = (self.funcs, self.obj.reward_names)
        n = min(self.obj.reward_workers, len(records))
        if n == 0:
            return score_texts(*args, records, completions, texts)
        cuts = [len(records) * i // n for i in range(n + 1)]
        calls = [(*args, records[a:b], completions[a:b], texts[a:b])
                 for a, b in zip(cuts, cuts[1:])]  # fmt: skip
        timeout = self.w.ctx.cfg.collective_timeout_s
        try:
            parts = get_session().run_tasks(score_texts, calls, timeout)
        except TimeoutError as e:
            raise RewardError(
                f"GRPO(reward_workers={n}): {e}; free CPUs in the cluster for them, or "
                "set reward_workers=0 (score on the LLM group's leaders)."
            ) from None
        return [r for part in parts for r in part]

    @staticmethod
    def _fields(run: RolloutStep, p: int, rewards: dict) -> dict:
        tokens, truncated = run.completions[p]
        return {
            "prompt_input_ids": np.asarray(run.samples[p]["input_ids"], np.int64),
            "completion_ids": [np.asarray(t, np.int64) for t in tokens],
            "rewards": rewards,
            "truncated": list(truncated),
        }

    def _record(self, sample: dict) -> dict:
        """The columns a reward function gets: the sample's own (not the model's inputs)."""
        adapter = self.w.ctx.adapter
        model_keys = {"input_ids", "labels", *adapter.llm_fields()}
        for part in adapter.encoder_parts:
            model_keys.update(adapter.encoder_fields(part))
        return {k: v for k, v in sample.items() if k not in model_keys}

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def score_texts(funcs, names, records, completions, texts) -> list[dict]:
    """:func:`~ray_disagg.rollout.rewards.score` of completions decoded already (what a
    reward task runs: no tokenizer to ship)."""
    decoded = {tuple(c): t for cs, ts in zip(completions, texts) for c, t in zip(cs, ts)}
    return score(funcs, records, completions, lambda ids: decoded[tuple(ids)], names)
