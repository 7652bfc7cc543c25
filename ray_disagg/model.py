"""How each worker gets the model: :class:`HFModelSpec` (a config or a local pretrained
directory; the family comes from ``config.model_type``) and its parts.

A part is the family's HF ``...ForConditionalGeneration`` with every other part's
submodules removed, so its state-dict keys are the HF keys (``model.visual.*``,
``model.language_model.*``, ``lm_head.*``) and checkpoints merge back into one HF model.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass

from torch import nn
from transformers import AutoConfig, PretrainedConfig

from ray_disagg.config.settings import check_settings, setting
from ray_disagg.lora import layers as lora
from ray_disagg.models import ADAPTERS, IGNORE_INDEX, get_adapter, loading
from ray_disagg.models.base import ModelAdapter
from ray_disagg.parallel.row_blocks import block_rows

SLOW_LOAD_S = 5.0  # a load taking longer logs its progress every quarter

__all__ = ["HFModelSpec", "IGNORE_INDEX"]


def _hf_shapes(module: nn.Module, adapter: ModelAdapter) -> dict[str, tuple[int, ...]]:
    """The HF tensors ``module``'s parameters come from, with their global shapes (a row
    block of a split Linear reads the fused tensor)."""
    shapes, hf_name = {}, lora.hf_name_map(adapter.hf_param_name)
    blocks = block_rows(module, hf_name)
    for name, p in module.named_parameters():
        if lora.is_factor(name):
            continue  # from the adapter directory (checked on the driver) or fresh
        fused, index, _ = hf_name(name)
        shape = tuple(p.shape)
        shapes[fused] = (blocks[name][2], *shape[1:]) if index is not None else shape
    return shapes


@dataclass(kw_only=True)
class HFModelSpec:
    """A Hugging Face multimodal model of any supported family (``ray_disagg.models``).

    Give either a ``config`` (random init from ``seed``, no download) or a local
    ``pretrained_path`` (a ``save_pretrained`` directory).

    Example:
        >>> from ray_disagg.models import tiny_qwen3_vl_config
        >>> spec = HFModelSpec(config=tiny_qwen3_vl_config(), seed=0)
        >>> spec.adapter.parts
        ('vision', 'text')
        >>> sorted(spec.build_part("vision").state_dict())[0]
        'model.visual.blocks.0.attn.proj.bias'
    """

    config: PretrainedConfig | dict | None = None
    """Model config (an HF config, or its dict with ``model_type``) for random init."""

    pretrained_path: str | os.PathLike | None = None
    """Local directory with ``config.json`` + safetensors weights (``save_pretrained`` layout)."""

    seed: int = setting(0)
    """Seed of the random initialisation (every group builds the same weights)."""

    attn_implementation: str = setting("sdpa")
    """Attention kernel passed to ``transformers`` (e.g. ``"sdpa"`` or ``"eager"``)."""

    peft_path: str | os.PathLike | None = None
    """A saved PEFT LoRA adapter directory (``PeftModel.save_pretrained``: its
    ``adapter_config.json`` and ``adapter_model.safetensors``) to start from: it adapts the
    modules of every part that its ``target_modules`` match, trains its
    ``modules_to_save`` in full and freezes the rest, as ``PeftModel.from_pretrained(...,
    is_trainable=True)`` does (:mod:`ray_disagg.lora`). Needs ``pip install
    'ray_disagg[lora]'``."""

    def __post_init__(self) -> None:
        check_settings(self, lambda name, value: f"{type(self).__name__}({name}={value!r})")
        if (self.config is None) == (self.pretrained_path is None):
            raise ValueError(
                f"{type(self).__name__} needs exactly one of config= or pretrained_path=."
            )
        if isinstance(self.config, dict):
            cfg = dict(self.config)
            if "model_type" not in cfg:
                raise ValueError(
                    f"config dict needs a 'model_type' key (one of {sorted(ADAPTERS)})."
                )
            self.config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        if self.config is not None and not isinstance(self.config, PretrainedConfig):
            raise ValueError(
                f"config must be a transformers config or dict, got {type(self.config)}."
            )
        if self.pretrained_path is not None:
            path = os.fspath(self.pretrained_path)
            if not os.path.isfile(os.path.join(path, "config.json")):
                raise ValueError(
                    f"pretrained_path={path!r} has no config.json; pass a local directory "
                    "written by save_pretrained (downloads are not supported)."
                )
            self.pretrained_path = path
        if self.peft_path is not None:
            self.peft_path = os.fspath(self.peft_path)
            self.adapter_config  # noqa: B018 - a missing file or unsupported setting fails here
        self.adapter  # noqa: B018 - an unsupported model_type fails here, on the driver

    def load_config(self) -> PretrainedConfig:
        if self.config is not None:
            return self.config
        return AutoConfig.from_pretrained(self.pretrained_path, local_files_only=True)

    @functools.cached_property
    def adapter(self) -> ModelAdapter:
        return get_adapter(self.load_config())

    @functools.cached_property
    def adapter_config(self):
        """The ``peft.LoraConfig`` of :attr:`peft_path` (``None`` without one)."""
        return None if self.peft_path is None else lora.read_adapter_config(self.peft_path)

    def meta_model(self, part: str | None = None) -> nn.Module:
        """The HF model (pruned to ``part`` when given) on the ``meta`` device: no memory
        is allocated until :meth:`materialize`, after the parallel plans have sharded it."""
        model = loading.meta_model(self.adapter, self.attn_implementation)
        return model if part is None else self.adapter.prune(model, part)

    def weight_source(self, meta: nn.Module):
        """Where the initial weights come from (``.get(hf_name)`` -> full tensor)."""
        if self.pretrained_path is None:
            return loading.InitSource(meta, self.seed)
        return loading.SafetensorsSource(self.pretrained_path, meta)

    def materialize(
        self, module: nn.Module, device="cpu", part: str | None = None, log=None, adapter=None
    ) -> None:
        """Allocate only this rank's shards of ``module`` (a :meth:`meta_model`, possibly
        sharded by DTensor TP/FSDP2) on ``device`` and fill them, one tensor at a time,
        from the pretrained weights or the per-name random init; ``adapter``: the
        :class:`~ray_disagg.lora.layers.PartLora` injected into ``module`` (its factors from
        its directory or freshly initialized). ``log(message)`` gets where the weights
        come from and, once the load has taken ``SLOW_LOAD_S``, its progress every quarter."""
        meta = self.meta_model(part)
        params = self.weight_source(meta)
        if isinstance(params, loading.SafetensorsSource):
            params.check(_hf_shapes(module, self.adapter))
        hf_name = self.adapter.hf_param_name
        if adapter is not None:
            params = lora.lora_weights(params, adapter, module, hf_name)
            hf_name = lora.hf_name_map(hf_name)
        progress = None
        if log is not None:
            what = part or "model"
            source = self.pretrained_path or f"random init (seed {self.seed})"
            log(f"{what}: loading weights from {source}")
            t0, marks = time.perf_counter(), set()

            def progress(done: int, total: int) -> None:  # a quarter's mark, once slow
                quarter, elapsed = 4 * done // total, time.perf_counter() - t0
                if quarter not in marks and quarter > 0 and elapsed >= SLOW_LOAD_S:
                    marks.add(quarter)
                    log(f"{what}: loaded {done}/{total} tensors ({elapsed:.1f}s)")

        init = loading.InitSource(meta, self.seed)
        loading.materialize(module, device, params, init, progress, hf_name)

    def build_full(self) -> nn.Module:
        """The whole HF model on the CPU (the single-process reference)."""
        model = self.meta_model()
        self.materialize(model)
        return model

    def build_part(self, part: str, device="cpu") -> nn.Module:
        """The HF model pruned to ``part``'s submodules, materialized on ``device``."""
        model = self.meta_model(part)
        self.materialize(model, device, part)
        return model

    def check_weights(self) -> None:
        """On the driver: every part's tensors exist in ``pretrained_path`` (``ValueError``
        naming the missing key and the index file otherwise)."""
        if self.pretrained_path is not None:
            meta = self.meta_model()
            loading.SafetensorsSource(self.pretrained_path, meta).check(
                _hf_shapes(meta, self.adapter)
            )
