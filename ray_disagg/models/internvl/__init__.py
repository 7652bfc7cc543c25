"""InternVL (see ``adapter.py``)."""

from ray_disagg.models.internvl.adapter import InternVLAdapter
from ray_disagg.models.internvl.flavors import tiny_internvl_config

__all__ = ["InternVLAdapter", "tiny_internvl_config"]
