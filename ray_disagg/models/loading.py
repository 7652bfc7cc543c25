"""Building a part without holding anything else: construction on the ``meta`` device,
then, after the parallel plans have sharded it, materialization of only this rank's
shards, one tensor at a time, from either

- :class:`InitSource`: a random initial value that is a function of ``(seed, HF name)``
  alone (the owning module is initialised by the family's own ``_init_weights`` under a
  seed derived from its name), so every layout and the single-process reference start
  from identical weights; or
- :class:`SafetensorsSource`: the tensors of a ``save_pretrained`` directory (one file or
  a sharded index), memory-mapped, read per key, keys renamed by transformers' own
  checkpoint conversion mapping (e.g. legacy ``model.layers.*`` ->
  ``model.language_model.layers.*``) and cast per tensor.

Non-persistent buffers (rotary ``inv_freq``) always come from :class:`InitSource`.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ray_disagg.models import hf_param_name
from ray_disagg.models.conversions import Converted, unsupported_operation
from ray_disagg.parallel.row_blocks import block_rows

__all__ = [
    "InitSource",
    "SafetensorsSource",
    "materialize",
    "meta_model",
    "name_seed",
    "part_tensor",
    "cast_parameters",
    "tied_parameters",
]


_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def meta_model(adapter, attn_implementation: str = "sdpa") -> nn.Module:
    """The family's whole HF model on the ``meta`` device (no memory, no init)."""
    config = adapter.config_class.from_dict(adapter.config.to_dict())
    config._attn_implementation = attn_implementation
    with torch.device("meta"):
        model = adapter.hf_class(config)
    return model.float().train()


def cast_parameters(module: nn.Module, dtype: torch.dtype, keep=frozenset()) -> None:
    """Parameters (not buffers: rope ``inv_freq`` stays fp32) to ``dtype``, keeping tied
    parameters tied; the parameters named in ``keep`` keep their dtype."""
    done: dict[int, nn.Parameter] = {}
    for prefix, mod in module.named_modules():
        for k, p in mod._parameters.items():
            if p is not None and f"{prefix}.{k}".lstrip(".") not in keep:
                if id(p) not in done:
                    done[id(p)] = nn.Parameter(p.to(dtype), requires_grad=p.requires_grad)
                mod._parameters[k] = done[id(p)]


def tied_parameters(model: nn.Module) -> dict[str, str]:
    """HF's tied parameters of ``model`` (e.g. ``{"lm_head.weight": "...embed_tokens.weight"}``)."""
    return dict(model.get_expanded_tied_weights_keys())


def name_seed(seed: int, name: str) -> int:
    """The random seed of the tensor or module ``name`` under the run's ``seed``."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:7], "little")


class InitSource:
    """Initial tensors by HF name: the owning module of ``name`` is built alone on the CPU
    (``reset_parameters`` then the model's ``_init_weights``) under a seed derived from
    ``(seed, module name)``. Only one module's tensors are alive at a time."""

    def __init__(self, model: nn.Module, seed: int):
        self.model, self.seed = model, seed  # a meta model of the family (any part of it)
        self._owner, self._tensors = None, {}

    def get(self, name: str) -> torch.Tensor:
        owner, _, leaf = name.rpartition(".")
        if owner != self._owner:
            self._owner, self._tensors = owner, self._init_module(owner)
        return self._tensors[leaf]

    def _initializer(self, owner: str) -> nn.Module:
        """The innermost HF model holding ``owner``: its ``_init_weights`` reads its own
        config (HF initializes each sub-model with its own, e.g. ``text_config``)."""
        from transformers import PreTrainedModel

        path = owner.split(".")
        for n in range(len(path) - 1, 0, -1):
            mod = self.model.get_submodule(".".join(path[:n]))
            if isinstance(mod, PreTrainedModel):
                return mod
        return self.model

    def _parent_with(self, owner: str, alone: nn.Module) -> nn.Module | None:
        """A shallow copy of ``owner``'s parent block holding ``alone`` in its place (its
        other children stay on ``meta``, where an init is a no-op); ``None`` at a model
        or list boundary. HF initializes some tensors from the parent's ``_init_weights``."""
        from transformers import PreTrainedModel

        head, _, leaf = owner.rpartition(".")
        parent = self.model.get_submodule(head) if head else None
        if parent is None or isinstance(parent, PreTrainedModel | nn.ModuleList):
            return None
        copy_ = copy.copy(parent)
        copy_._modules = {**parent._modules, leaf: alone}
        return copy_

    def _init_module(self, owner: str) -> dict[str, torch.Tensor]:
        mod = self.model.get_submodule(owner)
        alone = copy.copy(mod)  # same class and attributes, its own tensors on the CPU
        alone._parameters = {
            k: None if v is None else nn.Parameter(torch.empty(v.shape, dtype=v.dtype))
            for k, v in mod._parameters.items()
        }
        alone._buffers = {
            k: None if v is None else torch.empty(v.shape, dtype=v.dtype)
            for k, v in mod._buffers.items()
        }
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(name_seed(self.seed, owner))
            if hasattr(alone, "reset_parameters") and alone._parameters:
                alone.reset_parameters()
            init = self._initializer(owner)._init_weights
            init(alone)
            parent = self._parent_with(owner, alone)
            if parent is not None:  # e.g. an MoE block initializes its router's weight
                init(parent)
        return {k: v for k, v in {**alone._parameters, **alone._buffers}.items() if v is not None}


class SafetensorsSource:
    """Tensors of a local ``save_pretrained`` directory by the model's HF names."""

    def __init__(self, path: str, model: nn.Module):
        from safetensors import safe_open
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key

        self.path, self._open, self._files = path, safe_open, {}
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            self.index_name = index
        else:
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            if not files:
                raise ValueError(
                    f"pretrained_path={path!r} has no *.safetensors weights; save the model "
                    "with save_pretrained (safetensors) first."
                )
            weight_map = {}
            for fname in files:
                with safe_open(os.path.join(path, fname), "pt") as f:
                    weight_map.update(dict.fromkeys(f.keys(), fname))
            self.index_name = os.path.join(path, files[0])
        transforms = get_model_conversion_mapping(model)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if not isinstance(t, WeightRenaming)]
        self.model_shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        meta_sd = dict.fromkeys(self.model_shapes, True)
        self.where: dict[str, tuple[str, str]] = {}  # model name -> (file, checkpoint key)
        self.converted: dict[str, Converted] = {}  # built by a transformers conversion
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        for ck_key, fname in weight_map.items():
            key, pattern = rename_source_key(
                ck_key, renamings, converters, model.base_model_prefix, meta_sd
            )
            if pattern is None:
                self.where[key] = (fname, ck_key)
                continue
            conv = self.converted.setdefault(key, Converted(by_pattern[pattern]))
            conv.add(pattern, ck_key)
            self.where[ck_key] = (fname, ck_key)

    def _file(self, fname: str):
        if fname not in self._files:
            self._files[fname] = self._open(os.path.join(self.path, fname), "pt")
        return self._files[fname]

    def check(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """From the files' headers only: ``ValueError`` naming the first of the model's
        tensors (name -> shape) that the directory lacks, holds with another shape, or
        holds in a non-float dtype."""
        missing = [n for n in shapes if n not in self.where and n not in self.converted]
        if missing:
            raise ValueError(
                f"The weights in {self.index_name} have no tensor for {missing[0]!r}"
                f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; the "
                "directory does not hold this model (check its config.json and index)."
            )
        for name, shape in shapes.items():
            conv = self.converted.get(name)
            for ck_key in [name] if conv is None else conv.source_keys():
                self._check_dtype(ck_key)
            got = self.shape(name)
            if got != tuple(shape):
                what = (
                    name if conv is None else f"{name} (converted from {conv.source_keys()[0]}...)"
                )
                raise ValueError(
                    f"{what!r} in {self.index_name} has shape {got} but the model's {name} is "
                    f"{tuple(shape)}; the config.json does not match the weights."
                )

    def _check_dtype(self, key: str) -> None:
        fname, ck_key = self.where[key]
        dtype = self._file(fname).get_slice(ck_key).get_dtype()
        if dtype not in _DTYPES:
            raise ValueError(
                f"{ck_key!r} in {os.path.join(self.path, fname)} has dtype {dtype}; only "
                "float32/bfloat16/float16 weights are supported (no quantized models)."
            )

    def dtype(self, name: str) -> torch.dtype:
        """The stored dtype of ``name`` (a converted tensor: that of its first source)."""
        conv = self.converted.get(name)
        fname, ck_key = self.where[name if conv is None else conv.source_keys()[0]]
        return _DTYPES[self._file(fname).get_slice(ck_key).get_dtype()]

    def _converted_shape(self, name: str, conv: Converted) -> tuple[int, ...]:
        op = unsupported_operation(conv.converter)
        if op is not None:
            raise ValueError(
                f"{name!r} in {self.index_name} needs transformers' {op} weight conversion, "
                "which sharded loading does not do; re-save the model with save_pretrained "
                "from transformers >= 5 first."
            )
        meta = {k: torch.empty(self._raw_shape(k), device="meta") for k in conv.source_keys()}
        return tuple(conv.build(meta.__getitem__, self.model_shapes[name]).shape)

    def get(self, name: str) -> torch.Tensor:
        conv = self.converted.get(name)
        if conv is not None:  # e.g. per-expert tensors stacked
            return conv.build(self._raw, self.model_shapes[name])
        return self._raw(name)

    def _raw(self, key: str) -> torch.Tensor:
        fname, ck_key = self.where[key]
        return self._file(fname).get_tensor(ck_key)  # dtype and shape: see check()

    def _raw_rows(self, key: str, lo: int, hi: int) -> torch.Tensor:
        fname, ck_key = self.where[key]
        return self._file(fname).get_slice(ck_key)[lo:hi]

    def _raw_shape(self, key: str) -> tuple[int, ...]:
        fname, ck_key = self.where[key]
        return tuple(self._file(fname).get_slice(ck_key).get_shape())

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.converted:
            return self._converted_shape(name, self.converted[name])
        return self._raw_shape(name)

    def read(self, name: str, region: tuple[slice, ...]) -> torch.Tensor:
        """Only the block ``region`` of ``name`` (``get_slice``: the other bytes of the
        file are never read), on the host."""
        conv = self.converted.get(name)
        if conv is not None:  # only the experts in the region
            return conv.build_region(self._raw, self._raw_rows, self.model_shapes[name], region)
        fname, ck_key = self.where[name]
        return self._file(fname).get_slice(ck_key)[region]


def part_tensor(source, name: str, blocks, hf_name=hf_param_name) -> torch.Tensor:
    """The full tensor of a part's parameter ``name`` from ``source`` (anything with
    ``.get(hf_name)``), sliced out of the fused HF tensor for a row block of a split
    Linear. ``blocks``: the part's :func:`~ray_disagg.parallel.row_blocks.block_rows`;
    ``hf_name``: the family's :meth:`ModelAdapter.hf_param_name` (default: that of every
    registered family)."""
    fused, index, _ = hf_name(name)
    if index is None:
        return source.get(name)
    start, rows, _ = blocks[name]
    return source.get(fused)[start : start + rows]


@torch.no_grad()
def fill(p: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's shard of the global ``full`` into ``p`` (a DTensor, sharded by TP
    and/or FSDP2, or a plain tensor), slicing on the host, then copying only the shard to
    ``p``'s device (no communication)."""
    if tuple(full.shape) != tuple(p.shape):
        raise ValueError(f"shape {tuple(full.shape)} does not match the model's {tuple(p.shape)}")
    region = local_region(p)
    if region is not None:
        p.to_local().copy_(full[region])
    elif isinstance(p, DTensor):  # strided shards (FSDP2 x TP): not one block of rows
        full = full.to(p.to_local().device, p.dtype)
        shard = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
        p.to_local().copy_(shard.to_local())
    else:
        p.copy_(full)


def local_region(p: torch.Tensor) -> tuple[slice, ...] | None:
    """The block of the global tensor that this rank's shard of the DTensor ``p`` holds
    (``None``: a plain tensor, or shards that are not one block)."""
    if not isinstance(p, DTensor) or p.dim() == 0:
        return None
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not all(type(pl) in (Shard, Replicate) for pl in p.placements):
        return None
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def _check_shape(source, name: str, p: torch.Tensor, hf_name, blocks) -> None:
    if not hasattr(source, "shape"):
        return  # fill checks the full tensor
    fused, index, _ = hf_name(name)
    shape, want = tuple(source.shape(name if index is None else fused)), tuple(p.shape)
    if index is not None:  # the fused tensor against the model's blocks
        want = (blocks[name][2], *want[1:])
    if shape != want:
        raise ValueError(f"shape {shape} does not match the model's {want}")


def _read(source, name: str, region, hf_name, blocks) -> torch.Tensor:
    """``part_tensor(source, name, blocks)[region]``, read as such where the source can
    (``SafetensorsSource.read``: only those bytes)."""
    if region is None or not hasattr(source, "read"):
        full = part_tensor(source, name, blocks, hf_name)
        return full if region is None else full[region]
    fused, index, _ = hf_name(name)
    if index is not None:  # a row block of a fused tensor: shift the rows
        start, first = blocks[name][0], region[0]
        region = (slice(first.start + start, first.stop + start), *region[1:])
        name = fused
    return source.read(name, region)


def _ties(module: nn.Module) -> list[tuple[str, str, str]]:
    """``(owner module, attribute, first name)`` of every parameter that is the same
    tensor as an earlier one (tied embeddings)."""
    first, out = {}, []
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            owner, _, attr = name.rpartition(".")
            out.append((owner, attr, first[id(p)]))
        else:
            first[id(p)] = name
    return out


@torch.no_grad()
def materialize(
    module: nn.Module, device, params, buffers: InitSource, progress=None, hf_name=hf_param_name
) -> None:
    """Allocate ``module``'s (possibly sharded) tensors on ``device`` and fill them: the
    parameters from ``params``, the buffers from ``buffers``, one tensor at a time.
    ``progress(done, total)`` is called after each parameter; ``hf_name`` as in
    :func:`part_tensor`."""
    ties = _ties(module)
    module.to_empty(device=device)  # gives each module its own tensor: tied ones untie
    for owner, attr, source in ties:
        tensor = module.get_parameter(source)
        if not isinstance(tensor, DTensor):  # FSDP2 / TP keep theirs tied themselves
            setattr(module.get_submodule(owner), attr, tensor)
    named, blocks = list(module.named_parameters()), block_rows(module, hf_name)
    for i, (name, p) in enumerate(named):
        try:
            _check_shape(params, name, p, hf_name, blocks)
            region = local_region(p)
            if region is None:
                fill(p, part_tensor(params, name, blocks, hf_name))
            else:  # only this rank's block is read and copied to the device
                p.to_local().copy_(_read(params, name, region, hf_name, blocks))
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        if progress is not None:
            progress(i + 1, len(named))
    for name, b in module.named_buffers():
        fill(b, buffers.get(name))
