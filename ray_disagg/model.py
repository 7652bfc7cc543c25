"""How each worker gets the model: :class:`HFModelSpec` (a config or a local pretrained
directory; the family comes from ``config.model_type``) and its parts.

A part is the family's HF ``...ForConditionalGeneration`` with every other part's
submodules removed, so its state-dict keys are the HF keys (``model.visual.*``,
``model.language_model.*``, ``lm_head.*``) and checkpoints merge back into one HF model.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from ray_disagg.models import IGNORE_INDEX, get_adapter, tiny_qwen2_5_vl_config
from ray_disagg.models.base import ModelAdapter

__all__ = ["HFModelSpec", "Qwen2_5_VLSpec", "tiny_qwen2_5_vl_config", "IGNORE_INDEX"]


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

    seed: int = 0
    """Seed of the random initialisation (every group builds the same weights)."""

    attn_implementation: str = "sdpa"
    """Attention kernel passed to ``transformers`` (``"sdpa"`` or ``"eager"``)."""

    def __post_init__(self) -> None:
        if (self.config is None) == (self.pretrained_path is None):
            raise ValueError(
                f"{type(self).__name__} needs exactly one of config= or pretrained_path=."
            )
        if isinstance(self.config, dict):
            cfg = dict(self.config)
            if "model_type" not in cfg:
                raise ValueError("config dict needs a 'model_type' key (e.g. 'qwen2_5_vl').")
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
        self.adapter  # noqa: B018 - an unsupported model_type fails here, on the driver

    def load_config(self) -> PretrainedConfig:
        if self.config is not None:
            return self.config
        return AutoConfig.from_pretrained(self.pretrained_path, local_files_only=True)

    @functools.cached_property
    def adapter(self) -> ModelAdapter:
        return get_adapter(self.load_config())

    def build_full(self) -> nn.Module:
        """The whole HF model (the single-process reference, and the source of the parts)."""
        adapter = self.adapter
        if self.pretrained_path is None:
            return adapter.build_full(self.seed, self.attn_implementation)
        model = adapter.hf_class.from_pretrained(
            self.pretrained_path,
            dtype=torch.float32,
            attn_implementation=self.attn_implementation,
            local_files_only=True,
        )
        return model.float().train()

    def build_part(self, part: str) -> nn.Module:
        """The HF model pruned to ``part``'s submodules."""
        return self.adapter.prune(self.build_full(), part)


@dataclass(kw_only=True)
class Qwen2_5_VLSpec(HFModelSpec):
    """:class:`HFModelSpec` for Qwen2.5-VL (kept for existing code; any family works with
    :class:`HFModelSpec`).

    Example:
        >>> Qwen2_5_VLSpec(config=tiny_qwen2_5_vl_config()).adapter.model_type
        'qwen2_5_vl'
    """

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.adapter.model_type != "qwen2_5_vl":
            raise ValueError("Qwen2_5_VLSpec needs a Qwen2.5-VL config; use HFModelSpec.")
