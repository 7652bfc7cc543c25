"""The files of a checkpoint: sharded, layout-independent, with
``torch.distributed.checkpoint`` (DCP). (When to save, report and restore:
:mod:`ray_disagg.worker.checkpoint`.)

Every rank of a group saves, with one collective ``dcp.save`` over the group, the tensors
it holds under Hugging Face names: ``model.<hf_name>`` and ``optim.<hf_name>.{exp_avg,
exp_avg_sq,step}``; tensor-parallel parameters as DTensors (each rank writes its shard),
ZeRO-1 state on the rank that owns it, replicated tensors once (DCP de-duplicates). Each
rank writes into its own local directory and uploads it through ``ray.train.report``, so
``<checkpoint>/<module>/`` ends up with every rank's ``.distcp`` file plus the metadata.

Loading is a collective ``dcp.load`` straight into this rank's shards: DCP re-shards from
the layout that wrote the checkpoint to the current one (FSDP2 x TP2 -> 1 + 1, SP2 x FSDP2
-> DP, ...) and no rank materializes the full model. The vision TP baseline stores q/k/v
separately; only between such a checkpoint and a fused tower are the module's full
tensors read (``read_full``) and merged or split.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ray_disagg.config.lr_schedule import lr_at
from ray_disagg.lora.files import write_record
from ray_disagg.models import hf_param_name
from ray_disagg.models.loading import fill, part_tensor
from ray_disagg.parallel.row_blocks import block_rows
from ray_disagg.worker import background_save

__all__ = [
    "DATA_STATE",
    "MIXTURE",
    "REFERENCE_LOGPS",
    "ShardWriter",
    "check_compatible",
    "load_alone",
    "load_model",
    "load_optimizer",
    "load_sharded",
    "merge_row_blocks",
    "read_full",
    "read_metadata",
    "save_sharded",
    "sharded_state",
    "trained_steps",
]

_STATE_KEYS = ("exp_avg", "exp_avg_sq")
DATA_STATE = "data_state.json"  # a conversation stream's position, in the LLM's directory
REFERENCE_LOGPS = "reference_logps.json"  # precomputed [[record id, chosen, rejected], ...]
MIXTURE = "mixture.json"  # a training mixture's fingerprint (ray_disagg.data.mixture)


def _kept(model, names) -> dict[str, torch.Tensor]:
    """``model``'s state dict, only ``names`` when given (a LoRA part: its adapter)."""
    state = model.state_dict()
    return state if names is None else {k: v for k, v in state.items() if k in names}


def sharded_state(model, optimizer, names=None) -> dict[str, torch.Tensor]:
    """This rank's tensors for ``dcp.save`` (see module docstring); ``names``: only these
    parameters (a LoRA part's adapter; its frozen base is not saved)."""
    out = {f"model.{k}": v.detach() for k, v in _kept(model, names).items()}
    inner = getattr(optimizer, "optim", optimizer)  # ZeRO-1: this rank's shard
    for name, p in model.named_parameters():
        st = inner.state.get(p)
        if st:
            key = f"optim.{name}"
            for f in _STATE_KEYS:
                out[f"{key}.{f}"] = st[f]
            out[f"{key}.step"] = st["step"].detach().reshape(1).float().cpu()
    return out


def save_sharded(model, optimizer, directory: str, names=None) -> None:
    """Collective over the group's default process group."""
    state = sharded_state(model, optimizer, names)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(directory))


def read_metadata(directory: str):
    """The DCP metadata of a module directory (``ValueError`` when there is none)."""
    if not os.path.isfile(os.path.join(directory, ".metadata")):
        raise ValueError(
            f"{directory} holds no ray_disagg checkpoint shard (no DCP .metadata). Resume from "
            "a checkpoint written by this ray_disagg version, or start a new run name."
        )
    return dcp.FileSystemReader(directory).read_metadata().state_dict_metadata


def load_sharded(model, optimizer, directory: str, names=None) -> bool:
    """Collective over the group: read the checkpoint straight into this rank's shards
    (DTensor TP/FSDP2 parameters and AdamW state, ZeRO-1 owned state, plain tensors); DCP
    re-shards from whatever layout wrote it. No rank holds a full model. Returns False
    (nothing loaded) when the names differ from the model's (a split-qkv vision-TP
    checkpoint into a fused tower or back): use :func:`read_full` then."""
    meta = read_metadata(directory)
    state = {f"model.{k}": v for k, v in _kept(model, names).items()}
    saved = {k for k in meta if k.startswith("model.")}
    if set(state) != saved:
        fused = {hf_param_name(k)[0] for k in saved}
        if fused == {hf_param_name(k)[0] for k in state}:
            return False  # only the qkv split differs
        raise ValueError(
            f"The checkpoint in {directory} does not hold this part: missing "
            f"{sorted(set(state) - saved)[:5]}, unexpected {sorted(saved - set(state))[:5]}."
        )
    inner = getattr(optimizer, "optim", optimizer)  # ZeRO-1: the local optimizer
    owned = {id(p) for g in inner.param_groups for p in g["params"]}
    slots = {}
    for name, p in model.named_parameters():
        key = f"optim.{name}"
        if id(p) not in owned or f"{key}.step" not in meta:
            continue  # not this rank's, or never stepped
        held = inner.state.get(p) or {}  # a group restart: loaded in place, no new memory
        slot = {f: _like(held.get(f), p) for f in _STATE_KEYS}
        slot["step"] = torch.zeros(1)
        state.update({f"{key}.{f}": t for f, t in slot.items()})
        slots[p] = slot
    dcp.load(state, storage_reader=dcp.FileSystemReader(directory))
    inner.state.clear()  # in place (a group restart): state the checkpoint lacks goes too
    for p, slot in slots.items():
        inner.state[p] = {"step": slot["step"][0].clone(), **{f: slot[f] for f in _STATE_KEYS}}
    return True


def _like(held, p: torch.Tensor) -> torch.Tensor:
    """``held`` (optimizer state to overwrite) when it matches ``p``, else new zeros."""
    same = held is not None and type(held) is type(p.detach())
    if same and held.shape == p.shape and held.dtype == p.dtype:
        return held
    return torch.zeros_like(p.detach())


def load_alone(targets: dict[str, torch.Tensor], directory: str) -> None:
    """``dcp.load`` of ``targets`` (global tensors) in this process alone."""
    with warnings.catch_warnings():  # "assuming ... load in a single process": we are
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(targets, storage_reader=dcp.FileSystemReader(directory), no_dist=True)


def merge_row_blocks(state: dict[str, torch.Tensor], hf_name=hf_param_name) -> dict:
    """``state`` under HF names: the row blocks of split Linears (as ``hf_name`` names
    them) concatenated back into the fused tensors."""
    out, pending = {}, {}
    for key, value in state.items():
        fused, index, blocks = hf_name(key)
        if index is None:
            out[key] = value
        else:
            pending.setdefault(fused, [None] * blocks)[index] = value
    for key, blocks in pending.items():
        if any(b is None for b in blocks):
            raise ValueError(f"{key}: only some of its row blocks are present.")
        out[key] = torch.cat(blocks, dim=0)
    return out


def read_full(directory: str) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """Global (unsharded) tensors of a module directory, in this process alone:
    ``(model state by HF name, AdamW state by HF name)``. Used for split-qkv checkpoints
    and by tests."""
    meta = read_metadata(directory)
    full = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in meta.items()
        if isinstance(m, TensorStorageMetadata)
    }
    load_alone(full, directory)
    model = merge_row_blocks({k[6:]: v for k, v in full.items() if k.startswith("model.")})
    optim: dict[str, dict] = {}
    for k, v in full.items():
        if k.startswith("optim."):
            name, _, field = k[6:].rpartition(".")
            optim.setdefault(field, {})[name] = v
    optim = {f: merge_row_blocks(d) for f, d in optim.items()}
    return model, optim


class _Dict:
    """A dict as a :func:`part_tensor` source (a missing key raises ``KeyError``)."""

    def __init__(self, d):
        self.get = d.__getitem__


def load_model(part, source: dict[str, torch.Tensor], names=None) -> None:
    """Copy full HF-named tensors into the (possibly sharded) ``part`` (``names``: only
    these parameters)."""
    blocks = block_rows(part, hf_param_name)
    for name, p in part.named_parameters():
        if names is None or name in names:
            fill(p, part_tensor(_Dict(source), name, blocks))


def load_optimizer(opt, part, fields: dict[str, dict[str, torch.Tensor]]) -> None:
    """Re-shard the full AdamW state onto the parameters this rank's optimizer updates."""
    inner = getattr(opt, "optim", opt)  # ZeRO-1: the local optimizer of this rank's shard
    owned = {id(p) for g in inner.param_groups for p in g["params"]}
    inner.state.clear()  # in place (a group restart): state the checkpoint lacks goes too
    blocks = block_rows(part, hf_param_name)
    for name, p in part.named_parameters():
        if id(p) not in owned:
            continue
        try:
            state = {f: part_tensor(_Dict(fields[f]), name, blocks) for f in _STATE_KEYS}
            steps = fields["step"]  # one count per tensor: never sliced like qkv rows
            step = steps[name] if name in steps else steps[hf_param_name(name)[0]]
        except KeyError:
            continue  # never stepped (no gradient yet)
        inner.state[p] = {"step": step.reshape(-1)[0].clone().float()}
        for f in _STATE_KEYS:
            inner.state[p][f] = torch.zeros_like(p.detach())
            fill(inner.state[p][f], state[f])


def trained_steps(root: str) -> int:
    """Optimizer steps done when the checkpoint under ``root`` was written."""
    with open(os.path.join(root, "trainer_state.json")) as f:
        return int(json.load(f)["step"])


# Config fields that do not change the model's tensors or numerics.
_IGNORED_CONFIG_KEYS = {
    "_attn_implementation_autoset",
    "_name_or_path",
    "architectures",
    "dtype",
    "torch_dtype",
    "transformers_version",
    "_attn_implementation",
}


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if k in _IGNORED_CONFIG_KEYS:
            continue
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def check_compatible(root: str, config, max_steps: int) -> int:
    """Before any weight is loaded: the checkpoint under ``root`` must hold the run's model
    (same config, compared field by field) and be before ``max_steps``. Returns its step."""
    if os.path.isfile(os.path.join(root, "config.json")):
        with open(os.path.join(root, "config.json")) as f:
            saved_type = json.load(f).get("model_type")
        if saved_type != config.model_type:
            raise ValueError(
                f"The checkpoint at {root} is a {saved_type!r} model but this run trains "
                f"{config.model_type!r}; resume with the family it was trained with."
            )
        saved = _flat(type(config).from_pretrained(root, local_files_only=True).to_dict())
        current = _flat(config.to_dict())
        diff = sorted(k for k in saved.keys() | current.keys() if saved.get(k) != current.get(k))
        if diff:
            shown = ", ".join(
                f"{k}: checkpoint {saved.get(k)!r} vs run {current.get(k)!r}" for k in diff[:8]
            )
            raise ValueError(
                f"The checkpoint at {root} holds a different model than this run ({shown}). "
                "Resume with the model config the checkpoint was trained with, or start a new "
                "run (a new RunConfig(name=...), no resume_from_checkpoint)."
            )
    steps = [
        trained_steps(os.path.join(root, d))
        for d in sorted(os.listdir(root))
        if os.path.isfile(os.path.join(root, d, "trainer_state.json"))
    ]
    step = max(steps, default=0)
    if step >= max_steps:
        raise ValueError(
            f"The checkpoint at {root} is already at step {step} and max_steps={max_steps}: "
            "there is nothing left to train. Raise train_loop_config['max_steps'] to continue "
            "training from it, or start a new run."
        )
    return step


@dataclass(slots=True)
class ShardWriter:
    """Writes this rank's part of a checkpoint into ``<root>/<module>/``: its DCP shard
    (every rank); on the group's rank 0 (``lead``) also ``trainer_state.json`` and, when
    ``hf_config`` is set, the HF ``config.json`` at the top."""

    module: str
    lead: bool
    hf_config: object = None
    cfg: object = None  # the TrainLoopConfig: its lr schedule is recorded
    data_state: dict | None = None  # a stream's position, written with the next checkpoint
    reference_logps: list | None = None  # precomputed reference log-probs (the LLM's)
    mixture: dict | None = None  # the training mixture's fingerprint (the LLM's)

    names: set | None = None  # a LoRA part: only its adapter's parameters are saved
    lora: tuple | None = None  # a LoRA part: (its LoraConfig, the base's record)
    pending: object = None  # an asynchronous checkpoint not yet reported (worker.checkpoint)
    stager: object = None  # the staging buffers in shared memory, reused by each checkpoint
    staging: object = None  # the future of a staging copy still running (see wait_staged)

    def keep_data_state(self, state: dict) -> None:
        """A stream's read position, written with the next checkpoint."""
        self.data_state = state

    def keep_mixture(self, fingerprint: dict) -> None:
        """The training mixture's fingerprint, written with every checkpoint."""
        self.mixture = fingerprint

    def keep_reference_logps(self, entries: list) -> None:
        """The precomputed reference log-probs, written with every checkpoint."""
        self.reference_logps = entries

    def hold(self, future, tmp: str, name: str, metrics: dict) -> None:
        """An asynchronous checkpoint being written into ``tmp``, reported later
        (:func:`ray_disagg.worker.checkpoint.flush`)."""
        self.pending = (future, tmp, name, metrics)

    def take_pending(self):
        """The held asynchronous checkpoint (``None``: none), no longer held."""
        pending, self.pending = self.pending, None
        return pending

    def wait_staged(self) -> None:
        """Before the optimizer changes the parameters and their state: until the running
        checkpoint's staging copy of them is done (at once without one)."""
        staging, self.staging = self.staging, None
        if staging is not None:
            staging.result()

    def drop_staging(self) -> None:
        """Forget the running staging copy (its checkpoint will not be reported)."""
        self.staging = None

    def write(self, root: str, step: int, model, optimizer, background=None):
        """Write this rank's part; with ``background`` (a gloo group over the group) the
        shard is only staged (copied to host memory) and written by DCP's ``async_save``
        in the background: returns its future (else ``None``)."""
        d = os.path.join(root, self.module)
        os.makedirs(d, exist_ok=True)
        future = None
        if background is None:
            save_sharded(model, optimizer, d, self.names)
        else:
            state = sharded_state(model, optimizer, self.names)
            future, staging, self.stager = background_save.start(state, d, background, self.stager)
            if staging is not None:
                self.staging = staging
        if self.lead and self.lora is not None:
            write_record(d, *self.lora)
        if self.lead:
            state = {"step": step + 1}
            if self.cfg is not None:  # the schedule is a function of the step
                keys = ("lr", "lr_schedule", "warmup_steps", "min_lr_ratio", "max_steps")
                state["lr_schedule"] = {k: getattr(self.cfg, k) for k in keys}
                state["next_lr"] = lr_at(self.cfg, step + 1)
            with open(os.path.join(d, "trainer_state.json"), "w") as f:
                json.dump(state, f)
            for name, value in ((DATA_STATE, self.data_state), (MIXTURE, self.mixture),
                                (REFERENCE_LOGPS, self.reference_logps)):  # fmt: skip
                if value is not None:
                    with open(os.path.join(d, name), "w") as f:
                        json.dump(value, f)
            if self.hf_config is not None:
                self.hf_config.save_pretrained(root)
        return future
