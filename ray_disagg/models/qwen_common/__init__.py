"""What the Qwen VL families share: the adapter's data handling (``adapter.py``), the
parallel plans (``parallelize.py``) and the tiny-config building blocks (``flavors.py``)."""

from ray_disagg.models.qwen_common.adapter import MODALITIES, QwenVLAdapter
from ray_disagg.models.qwen_common.flavors import (
    mrope_section,
    tiny_text_config,
    tiny_window_tower,
)
from ray_disagg.models.qwen_common.parallelize import (
    QKV_SPLIT,
    NaturalOrderPlan,
    QwenParallelMixin,
    SplitQKV,
    WindowOrderPlan,
)

__all__ = [
    "MODALITIES",
    "QKV_SPLIT",
    "NaturalOrderPlan",
    "QwenParallelMixin",
    "QwenVLAdapter",
    "SplitQKV",
    "WindowOrderPlan",
    "mrope_section",
    "tiny_text_config",
    "tiny_window_tower",
]
