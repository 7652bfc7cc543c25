"""Layout-independent checkpoint contents and restore.

A group's shard holds full (unsharded) tensors under Hugging Face names: the model in
``<module>/model.safetensors`` and the AdamW state in ``<module>/optimizer.pt`` as
``{hf_name: {"step", "exp_avg", "exp_avg_sq"}}``. Tensor-parallel shards are gathered and
ZeRO-1 state consolidated when saving, and re-sharded for the current layout when loading,
so a checkpoint saved with one layout loads into another (TP=2 -> TP=1, SP=2 -> DP=1, ...).
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor, distribute_tensor

from ray_disagg._internal.tensor_parallel import merge_split_qkv
from ray_disagg.model import hf_key

_STATE_KEYS = ("exp_avg", "exp_avg_sq")


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def full_optimizer_state(opt, part) -> dict[str, dict[str, torch.Tensor]] | None:
    """AdamW state by HF parameter name with full tensors (collective for TP and ZeRO-1:
    call on every rank of the group); ``None`` on ranks that do not hold the result."""
    named = [(n, p) for n, p in part.named_parameters() if p.requires_grad]
    if hasattr(opt, "consolidate_state_dict"):  # ZeRO-1: states come back by param index
        opt.consolidate_state_dict(to=0)
        if torch.distributed.get_rank() != 0:
            return None
        by_index = opt.state_dict()["state"]
        states = {n: by_index.get(i, {}) for i, (n, _) in enumerate(named)}
    else:
        states = {n: opt.state.get(p, {}) for n, p in named}
    out = {}
    for n, st in states.items():
        if st:
            entry = {k: _full(st[k]).detach().cpu() for k in _STATE_KEYS}
            entry["step"] = _full(st["step"]).detach().cpu().float().reshape(1)
            out[hf_key(part, n)] = entry
    return _merge_qkv_states(out)


def _merge_qkv_states(states):
    if not any(".qkv.q." in k for k in states):
        return states
    merged = {}
    for field in (*_STATE_KEYS, "step"):
        flat = merge_split_qkv({k: v[field] for k, v in states.items()})
        for k, v in flat.items():
            merged.setdefault(k, {})[field] = v
    return merged


def _hf_full_tensor(source: dict[str, torch.Tensor], part, name: str) -> torch.Tensor:
    """The full tensor for ``part``'s parameter ``name``, slicing HF's fused qkv for a
    :class:`SplitQKV` part."""
    key = hf_key(part, name)
    if key in source:
        return source[key]
    head, _, tail = key.rpartition(".qkv.")
    which, field = tail.split(".", 1)
    fused = source[f"{head}.qkv.{field}"]
    third = fused.shape[0] // 3
    i = "qkv".index(which)
    return fused[i * third : (i + 1) * third]


def _like(full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    full = full.to(p.device, p.dtype)
    if isinstance(p, DTensor):
        return distribute_tensor(full, p.device_mesh, p.placements)
    return full.clone()


def load_model(part, shard_dir: str) -> None:
    """Load ``<shard_dir>/model.safetensors`` into the (possibly sharded) ``part``."""
    source = load_file(os.path.join(shard_dir, "model.safetensors"))
    with torch.no_grad():
        for name, p in part.named_parameters():
            full = _hf_full_tensor(source, part, name)
            if isinstance(p, DTensor):
                p.to_local().copy_(_like(full, p).to_local())
            else:
                p.copy_(full)


def load_optimizer(opt, part, shard_dir: str) -> None:
    """Re-shard the saved full AdamW state onto this rank's parameters."""
    path = os.path.join(shard_dir, "optimizer.pt")
    saved = torch.load(path, weights_only=True)
    flat = {f: {k: v[f] for k, v in saved.items()} for f in (*_STATE_KEYS, "step")}
    inner = getattr(opt, "optim", opt)  # ZeRO-1: the local optimizer of this rank's shard
    owned = {id(p) for g in inner.param_groups for p in g["params"]}
    for name, p in part.named_parameters():
        if id(p) not in owned:
            continue
        try:
            state = {f: _hf_full_tensor(flat[f], part, name) for f in _STATE_KEYS}
            step = _hf_full_tensor(flat["step"], part, name)
        except KeyError:
            continue  # never stepped (no gradient yet)
        inner.state[p] = {
            "step": step.reshape(()).clone().float(),
            **{f: _like(state[f], p) for f in _STATE_KEYS},
        }


def trained_steps(root: str) -> int:
    """Optimizer steps done when the checkpoint under ``root`` was written."""
    with open(os.path.join(root, "vision", "trainer_state.json")) as f:
        return int(json.load(f)["step"])
