"""User-facing configuration dataclasses.

Everything here is validated in ``__post_init__`` so that a wrong setting fails on the
driver, before any Ray worker starts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from ray.train import ScalingConfig

from ray_disagg.config.loop import TrainLoopConfig
from ray_disagg.config.settings import check_settings, setting

__all__ = [
    "DataParallel",
    "SequenceParallel",
    "TensorParallel",
    "ContextParallel",
    "ExpertParallel",
    "ModuleGroup",
    "TrainLoopConfig",
    "Parallelism",
]


def _label(obj):
    """Error messages name the setting as it is written: ``Cls(name=value)``."""
    return lambda name, value: f"{type(obj).__name__}({name}={value!r})"


def _check_sharding(p) -> None:
    check_settings(p, _label(p))
    if p.fsdp and getattr(p, "zero1", False):
        raise ValueError(
            f"{type(p).__name__}(zero1=True, fsdp=True): FSDP2 already shards the optimizer "
            "state (ZeRO-3); choose one of them."
        )


@dataclass(kw_only=True, frozen=True)
class DataParallel:
    """Every worker of the group holds a full replica; samples are split across workers.

    Example:
        >>> DataParallel(zero1=True)
        DataParallel(zero1=True, fsdp=False)
    """

    zero1: bool = setting(False)
    """Shard the AdamW state across the group's workers (ZeRO stage 1)."""

    fsdp: bool = setting(False)
    """Shard parameters, gradients and AdamW state across the group's workers with FSDP2
    (``torch.distributed.fsdp.fully_shard``; ZeRO stage 3). Mesh axes
    ``("dp_shard", "mp")``."""

    def __post_init__(self) -> None:
        _check_sharding(self)


@dataclass(kw_only=True, frozen=True)
class SequenceParallel:
    """Sequence parallelism for an encoder group, composed with data parallel: Ulysses
    for the Qwen towers (each worker holds a slice of one call's patch sequence; the
    full-attention blocks swap sequence and heads with an all-to-all), whole tiles per
    worker for the tile towers of InternVL, LLaVA-OneVision and Gemma 3 (a tile attends
    within itself: no all-to-all, no head split).

    The group's ``num_workers`` must be a multiple of ``size``; the remaining factor is the
    data-parallel degree (mesh axes ``("dp", "sp")``).

    Example:
        >>> SequenceParallel(size=2)
        SequenceParallel(size=2, zero1=False, fsdp=False)
    """

    size: int = setting(ge=1)
    """Number of workers that split one call's patches (Qwen) or tiles (tile towers)."""

    zero1: bool = setting(False)
    """Shard the AdamW state across all ``dp x sp`` workers of the group (ZeRO stage 1)."""

    fsdp: bool = setting(False)
    """Shard parameters, gradients and AdamW state across all ``dp x sp`` workers of the
    group with FSDP2 (mesh axes ``("dp_shard", "sp")``)."""

    def __post_init__(self) -> None:
        _check_sharding(self)


@dataclass(kw_only=True, frozen=True)
class TensorParallel:
    """Megatron-style tensor parallelism (DTensor) for the LLM, composed with data parallel.

    The group's ``num_workers`` must be a multiple of ``size`` (mesh axes ``("dp", "tp")``).

    Example:
        >>> TensorParallel(size=2, fsdp=True)
        TensorParallel(size=2, fsdp=True)
    """

    size: int = setting(ge=1)
    """Number of workers that shard each weight matrix."""

    fsdp: bool = setting(False)
    """Also shard every parameter, gradient and AdamW state over the data-parallel axis with
    FSDP2 (FSDP2 x TP on the 2-D mesh ``("dp_shard", "tp")``)."""

    def __post_init__(self) -> None:
        _check_sharding(self)


@dataclass(kw_only=True, frozen=True)
class ContextParallel:
    """Ulysses context parallelism for the LLM, composed with data parallel: each of
    ``size`` workers holds a contiguous slice of every sequence through the decoder layers
    and attends over the whole sequence with ``1 / size`` of the heads (an all-to-all
    before and after attention). Activations per worker shrink with ``size``.

    The group's ``num_workers`` must be a multiple of ``size x tp`` (mesh axes ``("dp",
    "cp")``, with ``tp > 1`` ``("dp", "cp", "tp")``); ``size x tp`` must divide the
    attention heads (and Qwen3.5's ``linear_num_key_heads``: its Gated DeltaNet layers
    run the whole sequence split by key heads, and refuse ``tp > 1``).

    Example:
        >>> ContextParallel(size=2, tp=2)
        ContextParallel(size=2, tp=2, fsdp=False)
    """

    size: int = setting(ge=1)
    """Number of workers that split each sequence."""

    tp: int = setting(1, ge=1)
    """Tensor-parallel degree inside each context-parallel rank (Megatron-style, as
    :class:`TensorParallel`): a replica is ``size x tp`` workers."""

    fsdp: bool = setting(False)
    """Also shard parameters, gradients and AdamW state with FSDP2 over every worker that
    holds the same tensor-parallel shard (all ``dp x cp`` workers of one tp rank)."""

    def __post_init__(self) -> None:
        _check_sharding(self)


@dataclass(kw_only=True, frozen=True)
class ExpertParallel:
    """Expert parallelism for a mixture-of-experts LLM, composed with data parallel: every
    worker is a data-parallel replica of the dense weights with its own samples, and each
    group of ``size`` consecutive workers splits the routed experts (``num_experts / size``
    each); tokens reach their experts and come back by all-to-all, routed exactly as HF
    routes them. With ``tp > 1`` the attention (and any dense MLP) is Megatron
    tensor-parallel inside each replica of ``tp`` workers (mesh axes ``("dp", "tp")``),
    and the experts are split over ``size`` replicas. ``size x tp`` must divide the
    group's ``num_workers``, and ``size`` the ``num_experts``.

    Example:
        >>> ExpertParallel(size=2, tp=2)
        ExpertParallel(size=2, tp=2, fsdp=False)
    """

    size: int = setting(ge=1)
    """Data-parallel replicas that split the experts of every MoE layer."""

    tp: int = setting(1, ge=1)
    """Tensor-parallel degree of the attention inside each replica (as
    :class:`TensorParallel`); the experts stay whole on every tp rank of a replica."""

    fsdp: bool = setting(False)
    """Also shard the dense weights (attention, embeddings, router, shared experts) with
    FSDP2 over every worker of the group; the experts stay sharded over ``size``."""

    def __post_init__(self) -> None:
        _check_sharding(self)


Parallelism = (
    Literal["none"]
    | DataParallel
    | SequenceParallel
    | TensorParallel
    | ContextParallel
    | ExpertParallel
)
_KINDS = (DataParallel, SequenceParallel, TensorParallel, ContextParallel, ExpertParallel)


def _normalize_parallelism(p: Any):
    if p is None or p == "none":
        return DataParallel()
    if isinstance(p, _KINDS):
        return p
    raise ValueError(
        f"parallelism={p!r} is not understood. Use 'none', DataParallel(), "
        "SequenceParallel(size=N), TensorParallel(size=N), ContextParallel(size=N) or "
        "ExpertParallel(size=N)."
    )


@dataclass(kw_only=True)
class ModuleGroup:
    """One Ray Train worker group that trains one submodule of the model.

    Example:
        >>> from ray.train import ScalingConfig
        >>> g = ModuleGroup(scaling_config=ScalingConfig(num_workers=2))
        >>> g.parallelism
        DataParallel(zero1=False, fsdp=False)
    """

    scaling_config: ScalingConfig
    """Workers, resources, GPU use and placement strategy of this group, as in ``TorchTrainer``."""

    parallelism: Parallelism = "none"
    """How the group's workers split the module: ``"none"`` (data parallel replicas),
    :class:`DataParallel`, :class:`SequenceParallel`, :class:`TensorParallel`,
    :class:`ContextParallel` or :class:`ExpertParallel` (the MoE LLM)."""

    activation_checkpointing: bool = setting(False)
    """Recompute each transformer block's activations in backward to save memory."""

    trainable: bool = setting(True)
    """``False`` freezes the whole group: it runs forward only (under ``no_grad``), gets no
    gradients back, keeps no optimizer state and is left out of gradient clipping."""

    freeze: tuple[str, ...] = setting(
        (), what="a list of parameter-name prefixes, e.g. ['model.visual.blocks']"
    )
    """Parameter-name prefixes (HF names, e.g. ``"model.visual.blocks"``) frozen inside the
    group; each must match at least one of the group's parameters. Freezing every
    parameter of an encoder group is the same as ``trainable=False``."""

    lr_multiplier: float = setting(1.0, ge=0)
    """This group's learning rate is ``lr_multiplier`` times the scheduled ``lr``."""

    peft_config: Any = None
    """A ``peft.LoraConfig``: train a fresh LoRA adapter on this group's part instead of
    its full weights (PEFT's fields and meanings: ``target_modules`` matched against the
    part's full HF module names, ``r``, ``lora_alpha``, ``lora_dropout``, ``use_rslora``,
    ``modules_to_save`` trained in full, ``init_lora_weights`` ``True`` / ``False`` /
    ``"gaussian"``). The part's base weights get no gradients and no optimizer state.
    ``lora_dropout > 0`` draws its masks per worker, so runs in different layouts are not
    bitwise comparable. Needs ``pip install 'ray_disagg[lora]'``; see :mod:`ray_disagg.lora`."""

    standby: bool = setting(False)
    """Keep a started copy of this group's workers (same resources, its own placement
    group) that takes the group's place when one of its workers fails: the group restart
    then skips starting workers. Costs the group's resources twice; only for a group that
    restarts alone (``docs/checkpoints-and-recovery.md``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.scaling_config, ScalingConfig):
            raise ValueError(
                "ModuleGroup.scaling_config must be a ray.train.ScalingConfig, got "
                f"{type(self.scaling_config).__name__}."
            )
        n = self.scaling_config.min_workers  # an elastic range (min, max): checked at min
        if not isinstance(n, int) or n < 1:
            raise ValueError(
                f"ScalingConfig(num_workers={n!r}): each module group needs num_workers >= 1."
            )
        self.parallelism = _normalize_parallelism(self.parallelism)
        check_settings(self, _label(self))
        if self.peft_config is not None:
            from ray_disagg.lora.layers import check_lora_config

            check_lora_config(self.peft_config, "ModuleGroup(peft_config=...)")
            if not self.trainable:
                raise ValueError(
                    "ModuleGroup(peft_config=..., trainable=False): a frozen group trains no "
                    "adapter; drop peft_config or trainable=False."
                )
        p = self.parallelism
        if isinstance(p, ExpertParallel) and n % (p.size * p.tp):
            what = f"size x tp={p.size * p.tp}" if p.tp > 1 else f"size={p.size}"
            raise ValueError(
                f"ExpertParallel({what}) must divide the group's num_workers={n}; use a "
                "size that divides it or change num_workers."
            )
        size = self.model_parallel_size
        if n % size:
            what = f"size x tp={size}" if getattr(self.parallelism, "tp", 1) > 1 else f"size={size}"
            raise ValueError(
                f"{type(self.parallelism).__name__}({what}) must divide the group's "
                f"num_workers={n}; use a size that divides it or change num_workers."
            )

    @property
    def num_workers(self) -> int:
        """The group's workers (the smallest of an elastic range ``(min, max)``)."""
        return self.scaling_config.min_workers

    @property
    def elastic(self) -> bool:
        """``ScalingConfig(num_workers=(min, max))``: the group may resize during the run
        (a data-parallel encoder group; ``ray_disagg.launch.recovery.elastic``)."""
        return self.scaling_config.elasticity_enabled

    def at_size(self, n: int) -> ModuleGroup:
        """This group with ``n`` workers (a fixed size)."""
        sc, labels = self.scaling_config, self.scaling_config.label_selector
        labels = labels[:n] if isinstance(labels, list) else labels  # one per worker
        sc = dataclasses.replace(sc, num_workers=n, label_selector=labels)
        return dataclasses.replace(self, scaling_config=sc)

    @property
    def model_parallel_size(self) -> int:
        """Workers of one replica: the SP, TP or CP x TP degree (1 for data parallel; the
        tp degree for expert parallel, whose ``size`` replicas read their own samples)."""
        if isinstance(self.parallelism, ExpertParallel):
            return self.parallelism.tp
        return getattr(self.parallelism, "size", 1) * getattr(self.parallelism, "tp", 1)

    @property
    def mesh_layout(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """The group's device mesh: shape and axis names, data parallel first (``"dp"``,
        ``"dp_shard"`` with FSDP2), then the replica's axes (``"sp"``, ``"tp"``, ``"cp"``
        or ``"cp", "tp"``)."""
        p, dp = self.parallelism, "dp_shard" if self.fsdp else "dp"
        if isinstance(p, ContextParallel) and p.tp > 1:
            return (self.dp_size, p.size, p.tp), (dp, "cp", "tp")
        mp = {SequenceParallel: "sp", ContextParallel: "cp"}.get(type(p), "tp")
        return (self.dp_size, self.model_parallel_size), (dp, mp)

    @property
    def dp_size(self) -> int:
        return self.num_workers // self.model_parallel_size

    @property
    def fsdp(self) -> bool:
        """Parameters are sharded with FSDP2."""
        return self.parallelism.fsdp
