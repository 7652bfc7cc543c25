"""What one worker is fixed to, in one frozen value: :class:`WorkerContext`.

A worker's meshes, ranks, process groups, device, settings, adapter, loop arguments and
its channel to the other groups do not change during a step. They change only when the
channel is connected late or rebuilt (a standby taking a group's place joins it; a
survivor of a group restart rejoins it, an elastic group perhaps resized:
:meth:`WorkerContext.rejoined`): then the whole context is replaced, never one of its
fields.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ray_disagg.config.groups import ExpertParallel, ModuleGroup, TrainLoopConfig
from ray_disagg.transport.channel import Channel
from ray_disagg.worker import mfu
from ray_disagg.worker.args import LoopArgs
from ray_disagg.worker.runtime import WorkerRuntime

__all__ = ["WorkerContext"]


@dataclass(frozen=True, kw_only=True)
class WorkerContext:
    """One worker of group ``part`` (mesh axes ``("dp", <mp axis>)``, the mp axis ``"sp"``,
    ``"cp"`` or ``"tp"``, or ``("dp", "cp", "tp")``). A replica's ranks form its
    model-parallel group (``mp_mesh``); its rank 0 is the replica's ``leader``: it reads or
    receives the samples and talks to the other groups. Built by :meth:`create`."""

    args: LoopArgs
    """The loop's arguments (at the groups' current sizes)."""
    part: str
    """The group's name (``"vision"``, ``"audio"``, ``"text"``)."""
    rt: WorkerRuntime
    """The process's runtime: the group's mesh and its gloo groups for objects."""
    device: torch.device
    """Where this worker computes."""
    channel: Channel | None
    """The side channel to the other groups (``None``: a standby not yet taking over)."""
    dp_mesh: DeviceMesh
    """The data-parallel axis (``"dp"``, or ``"dp_shard"`` with FSDP2)."""
    mp_mesh: DeviceMesh
    """The replica's model-parallel ranks (sp, cp, tp, or cp x tp flattened)."""
    tp_mesh: DeviceMesh | None
    """The tensor-parallel axis, where the group has one."""
    cp_mesh: DeviceMesh | None
    """The context-parallel axis, where the group has one."""
    shard_mesh: DeviceMesh | None
    """The ranks whose gradients are partial sums of the same tensors (FSDP2 shards over
    it; else gradients are all-reduced over it); ``None``: the whole group."""
    expert_mesh: DeviceMesh | None
    """``("ep_replica", "ep", "tp")`` with :class:`~ray_disagg.config.groups.ExpertParallel`."""
    token_group: Any
    """The ranks holding different tokens of a step (MoE load, router loss), or ``None``."""
    dp_rank: int
    group_rank: int
    mp_size: int
    mp_rank: int
    mp_src: int
    """The group rank of this replica's leader."""
    leader: bool
    is_tp: bool
    is_cp: bool
    is_sp: bool
    fsdp: bool
    frozen: bool
    """Every parameter of the part is frozen: forward only."""
    is_llm: bool
    peak_flops: float | None
    """This worker's peak FLOP/s (MFU), ``None`` where unknown."""

    @classmethod
    def create(cls, args: LoopArgs, part: str, rt: WorkerRuntime, channel) -> WorkerContext:
        """The context of this process's worker of ``part`` over ``rt``'s mesh."""
        mesh, names = rt.mesh, rt.mesh.mesh_dim_names
        dp_mesh = mesh[names[0]]
        mp_mesh = mesh[names[1]] if len(names) == 2 else mesh[names[1:]]._flatten()
        tp_mesh = mesh["tp"] if "tp" in names else None
        cp_mesh = mesh["cp"] if "cp" in names else None
        group = args.groups[part]
        group_rank, mp_rank = mesh.get_rank(), mp_mesh.get_local_rank()
        is_cp = cp_mesh is not None and cp_mesh.size() > 1
        lead = group_rank == 0
        return cls(
            args=args,
            part=part,
            rt=rt,
            device=rt.device,
            channel=channel,
            dp_mesh=dp_mesh,
            mp_mesh=mp_mesh,
            tp_mesh=tp_mesh,
            cp_mesh=cp_mesh,
            shard_mesh=_shard_mesh(mesh, dp_mesh, rt.device)
            if group.fsdp or tp_mesh is not None
            else None,
            expert_mesh=_expert_mesh(group, mesh, rt.device),
            token_group=_token_group(mesh, dp_mesh, is_cp),
            dp_rank=dp_mesh.get_local_rank(),
            group_rank=group_rank,
            mp_size=mp_mesh.size(),
            mp_rank=mp_rank,
            mp_src=group_rank - mp_rank,
            leader=mp_rank == 0,
            is_tp=tp_mesh is not None and tp_mesh.size() > 1,
            is_cp=is_cp,
            is_sp=names[1] == "sp" and mp_mesh.size() > 1,
            fsdp=group.fsdp,
            frozen=part in args.frozen_parts,
            is_llm=part == args.adapter.llm_part,
            peak_flops=mfu.peak_flops(
                rt.device, args.cfg, lead, mfu.device_share(group.scaling_config)
            ),
        )

    @property
    def cfg(self) -> TrainLoopConfig:
        return self.args.cfg

    @property
    def adapter(self):
        """The family's adapter (:class:`~ray_disagg.models.base.FamilyAdapter`)."""
        return self.args.adapter

    @property
    def group(self) -> ModuleGroup:
        return self.args.groups[self.part]

    def rejoined(self, channel: Channel) -> WorkerContext:
        """This context over a rebuilt ``channel``, with the groups' sizes it names (an
        elastic group resized: the plans re-split each batch over its replicas)."""
        args = self.args.at_sizes(channel.spec.sizes)
        return dataclasses.replace(self, channel=channel, args=args)

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


def _flat_mesh(mesh: DeviceMesh, device: torch.device) -> DeviceMesh:
    """A 1-D mesh over every rank of the group (FSDP2 over ``dp x sp``)."""
    if mesh.size() == mesh.size(0):
        return mesh[mesh.mesh_dim_names[0]]
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (mesh.size(),), mesh_dim_names=("dp_sp",))


def _shard_mesh(mesh: DeviceMesh, dp_mesh: DeviceMesh, device: torch.device) -> DeviceMesh:
    """1-D mesh over the ranks whose gradients are partial sums of the same tensors:
    ``dp`` with TP, ``dp x cp`` with CP x TP, else the whole group."""
    names = mesh.mesh_dim_names
    if names[-1] != "tp":
        return _flat_mesh(mesh, device)
    return dp_mesh if len(names) == 2 else mesh[names[:2]]._flatten()


def _token_group(mesh: DeviceMesh, dp_mesh: DeviceMesh, is_cp: bool):
    """The data-parallel ranks and, under context parallelism, their ``cp`` ranks
    (``None``: one rank holds every token)."""
    if is_cp:
        return mesh[(mesh.mesh_dim_names[0], "cp")]._flatten().get_group()
    return dp_mesh.get_group() if dp_mesh.size() > 1 else None


def _expert_mesh(group: ModuleGroup, mesh: DeviceMesh, device: torch.device):
    """With :class:`~ray_disagg.config.groups.ExpertParallel`: the group's ``(dp, tp)`` ranks as
    ``("ep_replica", "ep", "tp")``: ``ep`` consecutive replicas split the experts (each tp
    rank with its peers of the same tp index)."""
    p = group.parallelism
    if not isinstance(p, ExpertParallel):
        return None
    from torch.distributed.device_mesh import init_device_mesh

    shape = (mesh.size() // (p.size * p.tp), p.size, p.tp)
    return init_device_mesh(device.type, shape, mesh_dim_names=("ep_replica", "ep", "tp"))
