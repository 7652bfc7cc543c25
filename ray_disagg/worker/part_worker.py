"""One worker of the group that trains a part: its meshes, its channel to the other
groups, its model (built on ``meta``, parallelized, then materialized) and optimizer."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ray_disagg.config import ExpertParallel
from ray_disagg.freezing import apply_freeze
from ray_disagg.lora import apply_lora, part_lora
from ray_disagg.models import loading
from ray_disagg.models.lora import adapter_names, adapters_disabled, is_factor
from ray_disagg.models.lora_files import base_record
from ray_disagg.parallel import expert_parallel as ep
from ray_disagg.parallel import fsdp
from ray_disagg.parallel import tensor_parallel as tp
from ray_disagg.worker import checkpoint, mfu, standby
from ray_disagg.worker.args import LoopArgs
from ray_disagg.worker.metrics import StepClock, log_line
from ray_disagg.worker.parallelize import ParallelPart, parallelize_part
from ray_disagg.worker.runtime import get_runtime
from ray_disagg.worker.shards import ShardWriter
from ray_disagg.worker.step import build_optimizer


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


def _flat_mesh(mesh, device):
    """A 1-D mesh over every rank of the group (FSDP2 over ``dp x sp``)."""
    if mesh.size() == mesh.size(0):
        return mesh[mesh.mesh_dim_names[0]]
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (mesh.size(),), mesh_dim_names=("dp_sp",))


class PartWorker:
    """One worker of group ``part`` (mesh axes ``("dp", <mp axis>)``, the mp axis ``"sp"``,
    ``"cp"`` or ``"tp"``, or ``("dp", "cp", "tp")``). A replica's ranks form its
    model-parallel group (``mp_mesh``); its rank 0 is the replica's leader: it reads or
    receives the samples and talks to the other groups."""

    def __init__(self, args: LoopArgs, part: str):
        self.args, self.part, self.cfg = args, part, args.cfg
        self.adapter = args.adapter
        self.rt = get_runtime()
        self.device = self.rt.device
        # a standby joins the channel only once it takes a group's place (setup)
        timeout = self.cfg.collective_timeout_s
        self.channel = None if standby.is_standby() else self.rt.wait_channel(timeout)
        mesh, names = self.rt.mesh, self.rt.mesh.mesh_dim_names
        self.dp_mesh = mesh[names[0]]  # "dp", or "dp_shard" with FSDP2
        self.mp_mesh = mesh[names[1]] if len(names) == 2 else mesh[names[1:]]._flatten()
        self.dp_rank, self.group_rank = self.dp_mesh.get_local_rank(), mesh.get_rank()
        self.mp_size, self.mp_rank = self.mp_mesh.size(), self.mp_mesh.get_local_rank()
        self.leader = self.mp_rank == 0
        self.mp_src = self.group_rank - self.mp_rank
        self.tp_mesh = mesh["tp"] if "tp" in names else None
        self.cp_mesh = mesh["cp"] if "cp" in names else None
        self.is_tp = self.tp_mesh is not None and self.tp_mesh.size() > 1
        self.is_cp = self.cp_mesh is not None and self.cp_mesh.size() > 1
        self.is_sp = names[1] == "sp" and self.mp_size > 1
        self.group = args.groups[part]
        self.fsdp = self.group.fsdp
        # None: the whole group (its default process group) without FSDP2
        self.shard_mesh = self._shard_mesh() if self.fsdp or self.tp_mesh is not None else None
        self.expert_mesh = self._expert_mesh()  # ("ep_replica", "ep"), or None
        self.token_group = self._token_group()
        self.frozen = part in args.frozen_parts  # every parameter frozen: forward only
        self.is_llm = part == self.adapter.llm_part
        self.clock = StepClock()
        share = mfu.device_share(self.group.scaling_config)
        self.peak_flops = mfu.peak_flops(self.device, self.cfg, self.group_rank == 0, share)
        self.pending = []  # posted cross-group sends not yet known delivered
        self.skipped = 0  # steps not applied (no label token, or non-finite with skipping)
        self.backward_passes = 0  # of this step
        self.peer_failed = False  # a transfer of this step failed (worker.recovery)

    def wait_pending(self, _mb=None) -> None:
        """Wait for the posted sends (before their tensors may change)."""
        for handle in self.pending:
            handle.wait()
        self.pending = []

    def build(self) -> torch.nn.Module:
        """The part on the ``meta`` device (no memory yet), frozen where asked: then
        :meth:`setup` parallelizes it, shards it with FSDP2 and materializes this rank's
        shards."""
        self.lora = part_lora(self.args.spec, self.part, self.group)
        model = self._meta_part()
        apply_freeze(model, self.group)  # before any plan: every wrapper keeps the flag
        if self.group.activation_checkpointing:
            for root in self.adapter.part_roots(model, self.part):
                if hasattr(root, "gradient_checkpointing_enable"):  # not e.g. an lm_head
                    root.gradient_checkpointing_enable({"use_reentrant": False})
        return model

    def setup(self, model: torch.nn.Module) -> int:
        """The group's parallel plans (:func:`parallelize_part`), FSDP2 (when the group
        uses it), this rank's shards of the weights, the optimizer, the checkpoint writer
        and the restore (a standby first waits to take over, then joins the channel);
        returns the step to start from."""
        self.model = model
        log = log_line if self.group_rank == 0 else None
        self.runner, self.parallel = self._place(model, log)
        if self.is_tp:
            tp.mark_partial_grads(model, self.adapter.per_head_norms)
        self.params = [p for p in model.parameters() if p.requires_grad]
        zero1 = getattr(self.group.parallelism, "zero1", False)
        self.opt = build_optimizer(self.params, self.cfg, zero1=zero1)
        hf_config = self.args.spec.load_config() if self.is_llm else None
        lead = self.group_rank == 0
        self.writer = ShardWriter(self.part, lead, hf_config, self.cfg)
        if self.lora is not None:  # the checkpoint keeps the adapter and names the base
            self.writer.names = adapter_names(model, self.lora.config)
            spec = self.args.spec
            base = base_record(spec.pretrained_path, spec.seed)
            self.writer.lora = (self.lora.config, base)
        if self.channel is None:  # a standby: until it takes a failed group's place
            standby.wait_take_over()
            self.channel = self.rt.wait_channel(self.cfg.collective_timeout_s)
        # data_state: a stream's read position, saved with the LLM's checkpoint
        self.start, self.data_state = checkpoint.restore(
            model, self.opt, self.part, self.args, log=log, writer=self.writer
        )
        if log is not None:
            n_all = sum(p.numel() for p in model.parameters())
            n_train = sum(p.numel() for p in self.params)
            log(
                f"{self.part}: ready, {n_train:,} of {n_all:,} local parameter elements "
                f"trainable; starting at step {self.start + 1}/{self.cfg.max_steps}"
            )
        return self.start

    def build_reference(self) -> PartModel | None:
        """A frozen copy of the part's initial weights for an objective's reference model
        (``DPO(reference="copy")``), with the same plans and FSDP2 sharding as the
        trained part: parameters only (no gradients, no optimizer state); with
        ``"adapters_disabled"`` the trained part itself, its adapters off. ``None``
        without such an objective, with ``"precompute"`` (no model: the log-probs were
        computed before training), or for a frozen part (its model is the reference)."""
        obj = self.cfg.objective
        if obj is None or not obj.needs_reference or self.frozen or obj.reference == "precompute":
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
        model = self.args.spec.meta_model(self.part)
        apply_lora(model, self.lora)
        if self.cfg.param_dtype == "bfloat16":
            factors = {n for n, _ in model.named_parameters() if is_factor(n)}
            loading.cast_parameters(model, torch.bfloat16, keep=factors)
        return model

    def _place(self, model: torch.nn.Module, log=None):
        """``(runner, ParallelPart)``: ``model``'s parallel plans (:func:`parallelize_part`),
        FSDP2 when the group uses it (over the ranks that hold the same tp shard), and this
        rank's shards of its weights."""
        parallel = parallelize_part(self, model)
        runner = fsdp.PartRunner(model)
        if self.fsdp:
            experts = set(ep.expert_parameters(model))
            units = self._own_units(model)
            fsdp.apply_fsdp(runner, self.shard_mesh, self.cfg.bf16, units, ignored=experts)
        self.args.spec.materialize(model, self.device, self.part, log=log, adapter=self.lora)
        return runner, parallel

    def _shard_mesh(self):
        """1-D mesh over the ranks whose gradients are partial sums of the same tensors:
        ``dp`` with TP, ``dp x cp`` with CP x TP, else the whole group. FSDP2 shards over
        it; without FSDP2 the gradients are all-reduced over it."""
        mesh, names = self.rt.mesh, self.rt.mesh.mesh_dim_names
        if names[-1] != "tp":
            return _flat_mesh(mesh, self.device)
        return self.dp_mesh if len(names) == 2 else mesh[names[:2]]._flatten()

    def _token_group(self):
        """The ranks holding different tokens of a step, over which the router's auxiliary
        loss and the expert load reduce: the data-parallel ranks and, under context
        parallelism, their ``cp`` ranks (``None``: one rank holds them all)."""
        mesh, names = self.rt.mesh, self.rt.mesh.mesh_dim_names
        if self.is_cp:
            return mesh[(names[0], "cp")]._flatten().get_group()
        return self.dp_mesh.get_group() if self.dp_mesh.size() > 1 else None

    def _expert_mesh(self):
        """With :class:`~ray_disagg.config.ExpertParallel`: the group's ``(dp, tp)`` ranks
        as ``("ep_replica", "ep", "tp")``: ``ep`` consecutive replicas split the experts
        (each tp rank with its peers of the same tp index)."""
        p = self.group.parallelism
        if not isinstance(p, ExpertParallel):
            return None
        from torch.distributed.device_mesh import init_device_mesh

        shape = (self.rt.mesh.size() // (p.size * p.tp), p.size, p.tp)
        names = ("ep_replica", "ep", "tp")
        return init_device_mesh(self.device.type, shape, mesh_dim_names=names)

    def _own_units(self, model) -> list[torch.nn.Module]:
        """FSDP2 units besides the blocks: the LLM's input embedding and ``lm_head`` (large
        with a big vocabulary; the root unit stays unsharded for the whole step), unless
        they are tied (one parameter cannot be in two units)."""
        if not self.is_llm or loading.tied_parameters(model):
            return []
        decoder, lm_head = self.adapter.llm_modules(model)
        return [decoder.embed_tokens, lm_head]

    def broadcast_object(self, obj):
        """``obj`` of the model-parallel leader, on every rank of its mp group (over gloo:
        objects never go through NCCL)."""
        if self.mp_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.mp_src, group=self.rt.mp_object_group)
        return box[0]

    def side_rank(self, group: str, dp_rank: int) -> int:
        """Side rank of the leader of replica ``dp_rank`` of ``group``."""
        return self.args.leader_side_rank(self.channel, group, dp_rank)
