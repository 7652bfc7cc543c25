"""One worker of the group that trains a part: its meshes, its channel to the other
groups, its model (built on ``meta``, parallelized, then materialized) and optimizer."""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from ray_disagg.config.freezing import apply_freeze
from ray_disagg.lora.files import base_record
from ray_disagg.lora.layers import adapter_names, adapters_disabled, is_factor
from ray_disagg.lora.parts import apply_lora, part_lora
from ray_disagg.models import loading
from ray_disagg.parallel import expert_parallel as ep
from ray_disagg.parallel import fsdp
from ray_disagg.parallel import tensor_parallel as tp
from ray_disagg.worker import checkpoint, standby
from ray_disagg.worker.args import LoopArgs
from ray_disagg.worker.console import log_line
from ray_disagg.worker.context import WorkerContext
from ray_disagg.worker.optim import build_optimizer
from ray_disagg.worker.parallelize import ParallelPart, parallelize_part
from ray_disagg.worker.runtime import get_runtime
from ray_disagg.worker.shards import ShardWriter
from ray_disagg.worker.state import WorkerState


@dataclass(frozen=True)
class ParameterCounts:
    """A part's parameter elements, trainable and in all: the whole part's (a DTensor
    counts its full shape, so these are the same in every layout) and this rank's own
    (a DTensor's local shard: less under FSDP2, TP or EP)."""

    trainable: int
    total: int
    local_trainable: int
    local_total: int

    @classmethod
    def of(cls, model: torch.nn.Module) -> ParameterCounts:
        """The counts of ``model``'s parameters (each once, tied ones included)."""
        sizes = [  # (whole, this rank's, trainable)
            (
                p.numel(),
                p.to_local().numel() if isinstance(p, DTensor) else p.numel(),
                p.requires_grad,
            )
            for p in model.parameters()
        ]
        return cls(
            trainable=sum(n for n, _, train in sizes if train),
            total=sum(n for n, _, _ in sizes),
            local_trainable=sum(held for _, held, train in sizes if train),
            local_total=sum(held for _, held, _ in sizes),
        )

    def __str__(self) -> str:
        held = ""
        if (self.local_trainable, self.local_total) != (self.trainable, self.total):
            held = f" (this rank holds {self.local_trainable:,} of {self.local_total:,})"
        return f"{self.trainable:,} of {self.total:,} parameter elements trainable{held}"


@dataclass(frozen=True)
class PartModel:
    """A part's model with what runs it: the trained one, or a frozen copy
    (:meth:`PartWorker.build_reference`)."""

    model: torch.nn.Module
    runner: fsdp.PartRunner
    parallel: ParallelPart
    without_adapters: bool = False
    """Run with the LoRA adapters disabled (``DPO(reference="adapters_disabled")``)."""
    shares_root: bool = False
    """``runner`` is the trained part's own (its adapters off, or a frozen part)."""

    def run(self, fn):
        """``fn(model)`` through the part's runner (one FSDP2 root call), forward only: the
        reference model, in eval mode (no dropout), its adapters off when asked."""
        training = self.model.training
        self.model.eval()
        try:
            with adapters_disabled(self.model) if self.without_adapters else nullcontext():
                return self.runner(fn)
        finally:
            self.model.train(training)
            if not self.shares_root:  # a copy's root: it never runs a backward
                fsdp.end_forward_only(self.runner)


class PartWorker:
    """One worker of group ``part``: its :class:`WorkerContext` (``ctx``: meshes, ranks,
    settings, channel; replaced as a whole when the channel is rebuilt), its
    :class:`WorkerState` (``state``: clock, posted sends, failure flag, counters) and,
    once :meth:`build` and :meth:`setup` ran, its model, runner, optimizer and checkpoint
    writer."""

    __slots__ = ("ctx", "state", "lora", "model", "runner", "parallel", "params", "opt",
                 "writer", "start", "data_state")  # fmt: skip

    def __init__(self, args: LoopArgs, part: str):
        rt = get_runtime()
        # a standby joins the channel only once it takes a group's place (setup)
        timeout = args.cfg.collective_timeout_s
        channel = None if standby.is_standby() else rt.wait_channel(timeout)
        self.ctx = WorkerContext.create(args, part, rt, channel)
        self.state = WorkerState()

    def rejoin(self, channel) -> None:
        """Continue over a rebuilt ``channel`` after a group restart (the other groups'
        sizes may have changed): a new context, the step's failure flag and backward
        passes forgotten, a new clock."""
        self.ctx = self.ctx.rejoined(channel)
        self.state.rejoined()

    def build(self) -> torch.nn.Module:
        """The part on the ``meta`` device (no memory yet), frozen where asked: then
        :meth:`setup` parallelizes it, shards it with FSDP2 and materializes this rank's
        shards."""
        self.lora = part_lora(self.ctx.args.spec, self.ctx.part, self.ctx.group)
        model = self._meta_part()
        apply_freeze(model, self.ctx.group)  # before any plan: every wrapper keeps the flag
        if self.ctx.group.activation_checkpointing:
            for root in self.ctx.adapter.part_roots(model, self.ctx.part):
                if hasattr(root, "gradient_checkpointing_enable"):  # not e.g. an lm_head
                    root.gradient_checkpointing_enable({"use_reentrant": False})
        return model

    def setup(self, model: torch.nn.Module) -> int:
        """The group's parallel plans (:func:`parallelize_part`), FSDP2 (when the group
        uses it), this rank's shards of the weights, the optimizer, the checkpoint writer
        and the restore (a standby first waits to take over, then joins the channel);
        returns the step to start from."""
        self.model = model
        log = log_line if self.ctx.group_rank == 0 else None
        self.runner, self.parallel = self._place(model, log)
        if self.ctx.is_tp:
            tp.mark_partial_grads(model, self.ctx.adapter.per_head_norms)
        self.params = [p for p in model.parameters() if p.requires_grad]
        zero1 = getattr(self.ctx.group.parallelism, "zero1", False)
        self.opt = build_optimizer(self.params, self.ctx.cfg, zero1=zero1)
        hf_config = self.ctx.args.spec.load_config() if self.ctx.is_llm else None
        lead = self.ctx.group_rank == 0
        names = lora = None
        if self.lora is not None:  # the checkpoint keeps the adapter and names the base
            names = adapter_names(model, self.lora.config)
            spec = self.ctx.args.spec
            lora = (self.lora.config, base_record(spec.pretrained_path, spec.seed))
        self.writer = ShardWriter(
            self.ctx.part, lead, hf_config, self.ctx.cfg, names=names, lora=lora
        )
        if self.ctx.channel is None:  # a standby: until it takes a failed group's place
            standby.wait_take_over()
            channel = self.ctx.rt.wait_channel(self.ctx.cfg.collective_timeout_s)
            self.ctx = dataclasses.replace(self.ctx, channel=channel)
        # data_state: a stream's read position, saved with the LLM's checkpoint
        self.start, self.data_state = checkpoint.restore(
            model, self.opt, self.ctx.part, self.ctx.args, log=log, writer=self.writer
        )
        if log is not None:
            log(
                f"{self.ctx.part}: ready, {ParameterCounts.of(model)}; "
                f"starting at step {self.start + 1}/{self.ctx.cfg.max_steps}"
            )
        return self.start

    def build_reference(self) -> PartModel | None:
        """A frozen copy of the part's initial weights for an objective's reference model
        (``DPO(reference="copy")``), with the same plans and FSDP2 sharding as the
        trained part: parameters only (no gradients, no optimizer state); with
        ``"adapters_disabled"`` the trained part itself, its adapters off. ``None``
        without such an objective, with ``"precompute"`` (no model: the log-probs were
        computed before training), or for a frozen part (its model is the reference)."""
        obj = self.ctx.cfg.objective
        if obj is None or not obj.needs_reference or self.ctx.frozen:
            return None
        if obj.reference == "precompute":
            return None
        if obj.reference == "adapters_disabled":  # the trained part, its adapters off
            return PartModel(
                self.model, self.runner, self.parallel, without_adapters=True, shares_root=True
            )
        model = self._meta_part().requires_grad_(False).eval()  # with the initial adapter
        runner, parallel = self._place(model)  # the policy's units: all-gathers in its order
        return PartModel(model=model, runner=runner, parallel=parallel)

    def _meta_part(self) -> torch.nn.Module:
        """The part on ``meta`` with its LoRA layers (the base frozen) in the run's
        parameter dtype (pure bf16 keeps the LoRA factors fp32, as PEFT)."""
        model = self.ctx.args.spec.meta_model(self.ctx.part)
        apply_lora(model, self.lora)
        if self.ctx.cfg.param_dtype == "bfloat16":
            factors = {n for n, _ in model.named_parameters() if is_factor(n)}
            loading.cast_parameters(model, torch.bfloat16, keep=factors)
        return model

    def _place(self, model: torch.nn.Module, log=None):
        """``(runner, ParallelPart)``: ``model``'s parallel plans (:func:`parallelize_part`),
        FSDP2 when the group uses it (over the ranks that hold the same tp shard), and this
        rank's shards of its weights."""
        ctx = self.ctx
        parallel = parallelize_part(ctx, model)
        runner = fsdp.PartRunner(model)
        if ctx.fsdp:
            experts = set(ep.expert_parameters(model))
            units = self._own_units(model)
            fsdp.apply_fsdp(runner, ctx.shard_mesh, ctx.cfg.bf16, units, ignored=experts)
        ctx.args.spec.materialize(model, ctx.device, ctx.part, log=log, adapter=self.lora)
        return runner, parallel

    def _own_units(self, model) -> list[torch.nn.Module]:
        """FSDP2 units besides the blocks: the LLM's input embedding and ``lm_head`` (large
        with a big vocabulary; the root unit stays unsharded for the whole step), unless
        they are tied (one parameter cannot be in two units)."""
        if not self.ctx.is_llm or loading.tied_parameters(model):
            return []
        decoder, lm_head = self.ctx.adapter.llm_modules(model)
        return [decoder.embed_tokens, lm_head]
