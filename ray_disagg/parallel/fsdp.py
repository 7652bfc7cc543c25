"""FSDP2 (``torch.distributed.fsdp.fully_shard``, ZeRO-3) for any part, alone or composed
with tensor parallelism (a 2-D ``("dp_shard", "tp")`` mesh: ``fully_shard`` over the
``dp_shard`` axis of DTensor-TP parameters) or Ulysses SP (sharded over all ``dp x sp``
ranks: SP ranks hold replicated weights whose gradients are partial sums).

Every ``.layers`` / ``.blocks`` / ``.layer`` (InternViT) element of the part is its own
FSDP unit (all-gathered just before its forward, resharded after); the rest of the part
(embeddings, merger, norms, ``lm_head``) is one root unit around :class:`PartRunner`,
through which the loops call the part, because the loops call the part's HF submodules (a
tower, a decoder, an ``lm_head``, ...) rather than the part's own ``forward``.

Gradients are reduce-scattered as SUMs (the loss is already normalised by the global
label-token count), in ``reduce_dtype``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

__all__ = ["PartRunner", "apply_fsdp", "transformer_blocks"]


class PartRunner(nn.Module):
    """``runner(fn)`` returns ``fn(runner.model)``: one forward call around everything a
    loop does with the part, so FSDP2's root hooks run once per step."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, fn):
        return fn(self.model)


def end_forward_only(runner: nn.Module) -> None:
    """After a forward under ``no_grad`` of an FSDP2 ``runner`` (a frozen copy, a frozen
    group): FSDP2 records every unit's forward for the backward's prefetch order and
    clears the record only in backward, which a forward-only root never runs; clear it
    (``reset_iter_state``: its units are resharded already; only stream waits)."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(runner, FSDPModule):
        runner.reset_iter_state()


_BLOCK_LISTS = ("layers", "blocks", "layer")


def transformer_blocks(module: nn.Module) -> list[nn.Module]:
    """The elements of every ``ModuleList`` named ``layers``, ``blocks`` or ``layer`` in
    ``module``."""
    return [
        block
        for name, child in module.named_modules()
        if isinstance(child, nn.ModuleList) and name.rsplit(".", 1)[-1] in _BLOCK_LISTS
        for block in child
    ]


def apply_fsdp(
    runner: PartRunner,
    mesh: DeviceMesh,
    bf16: bool,
    extra_units: list[nn.Module] = (),
    reshard_after_forward: bool = True,
    ignored: set[nn.Parameter] | None = None,
) -> None:
    """Shard ``runner.model`` in place (on ``meta`` or materialized) over the 1-D ``mesh``:
    every transformer block and each of ``extra_units`` (modules called through their own
    ``forward``, e.g. a large embedding) as a unit, the rest as the root unit; ``bf16``:
    all-gather bf16 parameters and reduce fp32 gradients. ``ignored``: parameters another
    parallelism shards and reduces (expert-parallel experts), left as they are."""
    mp = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if bf16 else None,
        reduce_dtype=torch.float32 if bf16 else None,
    )
    kw = {"reshard_after_forward": reshard_after_forward, "ignored_params": ignored or None}
    units = []
    for block in [*transformer_blocks(runner.model), *extra_units]:
        fully_shard(block, mesh=mesh, mp_policy=mp, **kw)
        units.append(block)
    fully_shard(runner, mesh=mesh, mp_policy=mp, **kw)
    for unit in [*units, runner]:
        unit.set_gradient_divide_factor(1.0)  # SUM, see module docstring
        unit.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
    # a parameter unused on one rank (e.g. DeepStack taps of a short clip) still joins the
    # reduce-scatter with zeros, so every rank issues the same collectives
    runner.set_reduce_scatter_unused_params(True)
