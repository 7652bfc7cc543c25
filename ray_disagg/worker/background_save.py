"""Checkpoints written in the background (``async_checkpoint``): DCP's ``async_save``
of one rank's shard, staged into host memory that the next checkpoint reuses.

The checkpoint step copies the shard into the staging buffers (on GPUs it only starts
the copy: the next step computes meanwhile and its optimizer step waits for it,
``ShardWriter.wait_staged``); the files are written by a writer process of DCP's (or a
thread, without room in ``/dev/shm``) at the lowest CPU priority, over a gloo group of its
own.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import threading
import zlib

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import (
    AsyncCheckpointerType,
    AsyncSaveResponse,
)

__all__ = ["start"]


def start(state: dict, directory: str, group, stager=None):
    """Start writing ``state`` (this rank's tensors) into ``directory`` in the background
    over ``group``: ``(the future of the write, the future of its staging copy or None,
    the staging buffers)``. ``stager``: the previous checkpoint's staging buffers
    (``None``: none yet; made here when DCP's writer process needs them), to pass again
    with the next checkpoint."""
    kind = _background_kind(state, group, stager is not None)
    shared = kind == AsyncCheckpointerType.PROCESS
    if shared and stager is None:
        stager = _shared_stager()
    if shared and torch.cuda.is_available():  # the staging stream reads the
        torch.cuda.current_stream().synchronize()  # optimizer step's results
    future = dcp.async_save(
        state,
        storage_writer=_BackgroundWriter(directory),
        process_group=group,
        async_checkpointer_type=kind,
        async_stager=stager if shared else None,
    )
    if isinstance(future, AsyncSaveResponse):  # the staging copy overlaps the next step
        return future.upload_completion, future.staging_completion, stager
    return future, None, stager


def _background_kind(state: dict, group, staged: bool) -> AsyncCheckpointerType:
    """A writer process of DCP's (the write never holds the training process's GIL) when
    /dev/shm holds twice the staged shards of the group's ranks on this node (``staged``:
    one copy is there already, the previous checkpoint's staging buffers, kept for the
    run), else a thread of this process. Every rank of the group chooses alike (a
    collective: the two kinds' setups differ). Other groups' shared memory on the node
    is only seen as used space."""
    try:
        free = shutil.disk_usage("/dev/shm").free
    except OSError:
        free = 0
    need = sum(_local(t).numel() * _local(t).element_size() for t in state.values())
    host = zlib.crc32(socket.gethostname().encode())
    mine = torch.tensor([host, need], dtype=torch.int64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)  # (node, bytes) of every rank
    here = sum(int(n) for h, n in every if int(h) == host)
    fits = torch.tensor([int(free + staged * here >= 2 * here)], dtype=torch.int64)
    dist.all_reduce(fits, op=dist.ReduceOp.MIN, group=group)
    return AsyncCheckpointerType.PROCESS if int(fits) else AsyncCheckpointerType.THREAD


def _shared_stager():
    """DCP's stager into shared memory (pinned on GPUs) that keeps its buffers: after the
    first checkpoint, staging is one copy into memory already mapped, and the writer
    process reads the same buffers (each write finishes before the next staging:
    ``worker.checkpoint.flush``). They hold one copy of the shard for the run.
    On GPUs the copy runs on a stream of its own, from a thread of DCP's, while the next
    step computes; that step's optimizer waits for it (``ShardWriter.wait_staged``). On CPUs it
    runs in the checkpoint step: there it would only compete with the next step for the
    cores (measured slower: ``benchmarks/checkpoint.py``, ``docs/checkpoints-and-recovery.md``)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    gpu = torch.cuda.is_available()
    return DefaultStager(StagingOptions(gpu, True, gpu, gpu))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class _BackgroundWriter(dcp.FileSystemWriter):
    """DCP's file writer, run by ``async_save`` in the background at the lowest CPU
    priority (Linux: per thread), so the training steps it overlaps keep the cores."""

    def write_data(self, plan, planner):
        with contextlib.suppress(Exception):  # best effort (a platform without it)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        return super().write_data(plan, planner)
