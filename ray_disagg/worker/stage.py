"""What every group's loop shares: its mesh and side group, model setup (activation
checkpointing, optimizer, restore) and the end of a step (gradient reduction, the stats
exchange, global clipping, the optimizer step, reporting)."""

from __future__ import annotations

import logging
import math
import time

import torch
import torch.distributed as dist

from ray_disagg.freezing import apply_freeze
from ray_disagg.models import loading
from ray_disagg.parallel import fsdp
from ray_disagg.parallel import tensor_parallel as tp
from ray_disagg.parallel.data_parallel import all_reduce_gradients
from ray_disagg.worker import common as lc
from ray_disagg.worker import memory
from ray_disagg.worker.runtime import get_runtime

logger = logging.getLogger(__name__)


def _flat_mesh(mesh, device):
    """A 1-D mesh over every rank of the group (FSDP2 over ``dp x sp``)."""
    if mesh.size() == mesh.size(0):
        return mesh[mesh.mesh_dim_names[0]]
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (mesh.size(),), mesh_dim_names=("dp_sp",))


class Stage:
    """One worker of group ``part`` (mesh axes ``("dp", <mp axis>)``)."""

    def __init__(self, args: lc.LoopArgs, part: str):
        self.args, self.part, self.cfg = args, part, args.cfg
        self.adapter = args.adapter
        self.rt = get_runtime()
        self.device = self.rt.device
        self.side = self.rt.wait_side_group(self.cfg.collective_timeout_s)
        mesh = self.rt.mesh
        self.dp_mesh = mesh[mesh.mesh_dim_names[0]]  # "dp", or "dp_shard" with FSDP2
        self.mp_axis = mesh.mesh_dim_names[1]  # "sp" or "tp"
        self.mp_mesh = mesh[self.mp_axis]
        self.dp_rank, self.group_rank = self.dp_mesh.get_local_rank(), mesh.get_rank()
        self.mp_size, self.mp_rank = self.mp_mesh.size(), self.mp_mesh.get_local_rank()
        self.leader = self.mp_rank == 0  # reads/receives samples and talks to other groups
        self.mp_src = self.group_rank - self.mp_rank
        self.layout = args.stats
        self.timer = lc.StepTimer()
        self.is_tp = self.mp_axis == "tp" and self.mp_size > 1
        self.is_sp = self.mp_axis == "sp" and self.mp_size > 1
        self.skipped = 0  # steps not applied (no label token, or non-finite with skipping)
        self.pending = []  # posted cross-group sends of this step
        self.group = args.groups[part]
        self.frozen = part in args.frozen_parts  # every parameter frozen: forward only
        self.backward_passes = 0  # of this step

    def wait_pending(self) -> None:
        """Wait for this step's posted sends (before their tensors may change)."""
        for handle in self.pending:
            handle.wait()
        self.pending = []

    def build(self) -> torch.nn.Module:
        """The part on the ``meta`` device (no memory yet): the loop applies its SP/TP plan,
        then :meth:`setup` shards it with FSDP2 and materializes this rank's shards."""
        model = self.args.spec.meta_model(self.part)
        if self.cfg.param_dtype == "bfloat16":  # pure bf16
            loading.cast_parameters(model, torch.bfloat16)
        apply_freeze(model, self.group)  # before any plan: every wrapper keeps the flag
        if self.args.groups[self.part].activation_checkpointing:
            for root in self.adapter.part_roots(model, self.part):
                if hasattr(root, "gradient_checkpointing_enable"):  # not e.g. an lm_head
                    root.gradient_checkpointing_enable({"use_reentrant": False})
        return model

    def setup(self, model: torch.nn.Module) -> int:
        """FSDP2 (when the group uses it), this rank's shards of the weights, the optimizer,
        the checkpoint writer and the restore; returns the step to start from."""
        self.model = model
        self.runner = fsdp.PartRunner(model)
        self.fsdp = self.args.groups[self.part].fsdp
        if self.fsdp:
            mesh = self.rt.mesh
            # tp: shard over dp_shard (FSDP2 x TP); sp/dp: over every rank of the group
            shard_mesh = self.dp_mesh if self.is_tp else _flat_mesh(mesh, self.device)
            fsdp.apply_fsdp(self.runner, shard_mesh, self.cfg.bf16, self._own_units(model))
        log = lc.log_line if self.group_rank == 0 else None
        self.args.spec.materialize(model, self.device, self.part, log=log)
        if self.is_tp:
            tp.mark_partial_grads(model, self.adapter.per_head_norms)
        self.params = [p for p in model.parameters() if p.requires_grad]
        zero1 = getattr(self.args.groups[self.part].parallelism, "zero1", False)
        self.opt = lc.build_optimizer(self.params, self.cfg, zero1=zero1)
        lead = self.group_rank == 0
        hf_config = self.args.spec.load_config() if self.part == self.adapter.llm_part else None
        self.writer = lc.ShardWriter(self.part, lead=lead, hf_config=hf_config, cfg=self.cfg)
        self.start = lc.restore(model, self.opt, self.part, self.args, log=log)
        if log is not None:
            n_all = sum(p.numel() for p in model.parameters())
            n_train = sum(p.numel() for p in self.params)
            log(
                f"{self.part}: ready, {n_train:,} of {n_all:,} local parameter elements "
                f"trainable; starting at step {self.start + 1}/{self.cfg.max_steps}"
            )
        return self.start

    def _own_units(self, model) -> list[torch.nn.Module]:
        """FSDP2 units besides the blocks: the LLM's input embedding and ``lm_head`` (large
        with a big vocabulary; the root unit stays unsharded for the whole step), unless
        they are tied (one parameter cannot be in two units)."""
        if self.part != self.adapter.llm_part or loading.tied_parameters(model):
            return []
        decoder, lm_head = self.adapter.llm_modules(model)
        return [decoder.embed_tokens, lm_head]

    def broadcast_object(self, obj):
        """``obj`` of the model-parallel leader, on every rank of its mp group."""
        if self.mp_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.mp_src, group=self.mp_mesh.get_group())
        return box[0]

    def finish(
        self,
        step: int,
        stats,
        t_compute: float,
        t_wait: float,
        extra=None,
        sample_ids=(),
        inflight: int = 1,
        evaluate=None,
    ) -> None:
        """Reduce the gradients, exchange the step's stats, clip, step (at the scheduled
        learning rate), run ``evaluate(step)`` (returns this rank's ``[loss sum, label
        tokens]`` of the validation set) on evaluation steps, and report."""
        t0 = time.perf_counter()
        # tp: replicas of a shard differ in samples only; dp x sp: replicas hold different
        # samples and sp ranks partial sums of the replicated weights
        if not self.fsdp:  # FSDP2 reduce-scattered them in backward
            reduce = self.dp_mesh.get_group() if self.mp_axis == "tp" else dist.group.WORLD
            all_reduce_gradients(self.params, reduce)
        if self.is_tp:
            tp.all_reduce_partial_grads(self.params, self.mp_mesh.get_group())
        sq = tp.grad_sq_norm(self.params, dist.group.WORLD, self.device)
        ix = self.layout.index
        if self.group_rank == 0:
            stats[ix[f"{self.part}_sq"]] = sq
            stats[ix[f"{self.part}_time"]] = t_compute + time.perf_counter() - t0
            stats[ix[f"{self.part}_wait"]] = t_wait
            stats[ix[f"{self.part}_peak"]] = memory.peak_memory_mb(self.device)
            memory.reset_peak_memory(self.device)  # the next step's peak: from here
            stats[ix[f"{self.part}_inflight"]] = inflight
            stats[ix[f"{self.part}_bwd"]] = self.backward_passes
        self.backward_passes = 0
        stats[ix["transfer_fallbacks"]] = self.side.fallbacks
        self.side.fallbacks = 0
        is_timer = self.part == self.adapter.llm_part and self.group_rank == 0
        stats = self.timer.exchange(self.side, stats, self.layout, is_timer)
        total_norm = self.layout.total_norm(stats)
        if self.fsdp and not self._group_had_inputs(stats):
            for p in self.params:  # every rank ran a stand-in: zero gradients, not real ones
                p.grad = None  # so AdamW skips these parameters, as single-process does
        if self._should_apply(step, stats, total_norm, sample_ids):
            lc.scale_grads(self.params, lc.clip_coef(total_norm, self.cfg.max_grad_norm))
            lc.set_lr(self.opt, self.cfg, step, self.group.lr_multiplier)
            self.opt.step()
        else:
            self.skipped += 1
        self.opt.zero_grad(set_to_none=True)
        memory.trim_heap()  # the step's activations and gradients are freed
        fallbacks = int(stats[ix["transfer_fallbacks"]])
        extra = {
            **(extra or {}),
            "skipped_steps": self.skipped,
            **self.placement_metrics(fallbacks),
        }
        if evaluate is not None and lc.is_eval_step(self.args, step):
            extra.update(self._validate(evaluate, step))
        lc.maybe_report(
            self.args, stats, step, self.writer, self.timer, self.model, self.opt, extra
        )
        first = step == self.start and not lc.is_reported_step(self.args, step)
        if first and self.group_rank == 0 and self.part == self.adapter.llm_part:
            lc.log_line(f"step {step + 1}/{self.cfg.max_steps} done (first of this run)")

    def _validate(self, evaluate, step: int) -> dict:
        """``val_loss``: the validation set's summed token losses over its label tokens,
        all-reduced over every rank of every group (its time is not step time)."""
        t0 = time.perf_counter()
        sums = torch.tensor(evaluate(step), dtype=torch.float64)
        sums = self.side.all_reduce_sum(sums)
        self.timer.excluded += time.perf_counter() - t0
        loss_sum, labels = float(sums[0]), float(sums[1])
        return {"val_loss": loss_sum / labels if labels else float("nan")}

    def placement_metrics(self, fallbacks: int = 0) -> dict:
        """``transfer_tier``: the tiers that carried tensors between the groups this step
        (e.g. "shm", "cuda_ipc+nccl"; "gloo" joins when messages fell back to it); with
        ``extra={"report_placement": True}`` also ``placement``: each worker's
        ``[placement group id, bundle index]`` as the worker saw it."""
        spec = self.side.spec
        tiers = set(spec.tiers.values()) | ({"gloo"} if fallbacks else set())
        out = {"transfer_tier": "+".join(sorted(tiers)) or "none"}
        if self.cfg.extra.get("report_placement"):
            out["placement"] = {
                spec.label(r): [loc.placement_group, loc.bundle]
                for r, loc in enumerate(spec.locations)
            }
        return out

    def _group_had_inputs(self, stats) -> bool:
        """Whether any rank of this group had real inputs this step (the LLM group always;
        an encoder group when its counters, e.g. ``images + videos``, are not all 0)."""
        if self.part == self.adapter.llm_part:
            return True
        ix = self.layout.index
        return sum(stats[ix[c]] for c in self.adapter.counter_names(self.part)) > 0

    def _should_apply(self, step: int, stats, total_norm: float, sample_ids) -> bool:
        """Every rank of every group decides alike, from the exchanged stats: a batch with
        no label token is skipped (its loss is reported as NaN); a non-finite loss or
        gradient norm raises, or is skipped with ``skip_nonfinite_steps``."""
        ix = self.layout.index
        if stats[ix["label_tokens"]] == 0:
            stats[ix["loss"]] = float("nan")
            if self.group_rank == 0 and self.part == self.adapter.llm_part:
                logger.warning("step %d: the global batch has no label token; skipped", step + 1)
            return False
        loss = float(stats[ix["loss"]])
        if math.isfinite(loss) and math.isfinite(total_norm):
            return True
        if self.cfg.skip_nonfinite_steps:
            return False
        raise FloatingPointError(
            f"step {step + 1}: loss {loss} / global grad norm {total_norm} is not finite; the "
            f"step was not applied. Samples of this {self.part} worker: {list(sample_ids)}. "
            "Check these samples (e.g. NaN pixels) or set "
            "train_loop_config={'skip_nonfinite_steps': True} to skip such steps."
        )
