"""Tier 2: a family added from a package of its own (``register_family`` and
transformers' ``AutoConfig.register``, no edit of ``ray_disagg``) trains through the
local runner (its workers import the package when they unpickle its config) equal to the
family it copies, and its conversations become the same samples."""

import json
import sys
import textwrap

import numpy as np
import pytest

import ray_disagg.models as models
from ray_disagg import HFModelSpec, tiny_qwen2_5_vl_config
from ray_disagg.data.examples import synthetic_samples
from tests.helpers import assert_matches_reference, group, run_layout, vt

LOOP = {"max_steps": 2, "global_batch_size": 4, "lr": 1e-3, "eps": 1e-6, "seed": 3}
GRIDS = [(1, 4, 4), None, (1, 8, 4)]

PACKAGE = """
from transformers import AutoConfig, Qwen2_5_VLConfig

import ray_disagg
from ray_disagg.models.qwen2_5_vl.adapter import Qwen2_5_VLAdapter
from ray_disagg.models.qwen2_5_vl.flavors import tiny_qwen2_5_vl_config


class CopyConfig(Qwen2_5_VLConfig):
    model_type = "qwen2_5_vl_copy"


def tiny_copy_config(**kwargs):
    fields = tiny_qwen2_5_vl_config(**kwargs).to_dict()
    fields.pop("model_type")
    return CopyConfig(**fields)


class CopyAdapter(Qwen2_5_VLAdapter):
    model_type = "qwen2_5_vl_copy"
    config_class = CopyConfig
    tiny_config = staticmethod(tiny_copy_config)


AutoConfig.register("qwen2_5_vl_copy", CopyConfig, exist_ok=True)
ray_disagg.register_family("qwen2_5_vl_copy", __name__)
"""


@pytest.fixture
def copy_family(tmp_path, monkeypatch):
    (tmp_path / "pkgs" / "copy_family").mkdir(parents=True)
    (tmp_path / "pkgs" / "copy_family" / "__init__.py").write_text(textwrap.dedent(PACKAGE))
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))  # forkserver children get sys.path
    monkeypatch.setattr(models, "_FAMILIES", dict(models._FAMILIES))  # restored after
    import copy_family

    yield copy_family
    sys.modules.pop("copy_family", None)


def test_a_registered_family_trains_as_the_family_it_copies(copy_family, tmp_path):
    cfg = copy_family.tiny_copy_config()
    spec = HFModelSpec(config=cfg, seed=11)
    assert type(spec.adapter) is copy_family.CopyAdapter
    data = synthetic_samples(cfg, 8, grids=GRIDS)
    original = HFModelSpec(config=tiny_qwen2_5_vl_config(), seed=11)
    result = run_layout(spec, data, LOOP, vt(group(1), group(1)), tmp_path, "copy", local=True)
    assert_matches_reference(result, original, data, LOOP)  # the original family's run
    saved = json.loads((tmp_path / "copy" / "checkpoint_000002" / "config.json").read_text())
    assert saved["model_type"] == "qwen2_5_vl_copy"


def test_registering_another_module_for_a_known_type_names_the_fix(copy_family):
    models.register_family("qwen2_5_vl_copy", "copy_family")  # the same: a no-op
    with pytest.raises(ValueError, match="already served by ray_disagg.models.qwen2_5_vl"):
        models.register_family("qwen2_5_vl", "copy_family")
    models.register_family("qwen2_5_vl_copy", "copy_family:CopyAdapter", exist_ok=True)
    assert models.ADAPTERS["qwen2_5_vl_copy"] is copy_family.CopyAdapter


def test_a_registered_family_processes_conversations_as_the_family_it_copies(copy_family, tmp_path):
    """The data code asks the adapter's processing hooks (no family named outside
    ``models/``): the copy's samples of real records equal Qwen2.5-VL's, field by field."""
    from tests.conversation_data import RECORDS, build_media, build_model_dir, make_processor

    model_dir, media = build_model_dir(tmp_path / "model"), build_media(tmp_path)
    ours = make_processor(model_dir, media, copy_family.tiny_copy_config())
    theirs = make_processor(model_dir, media, tiny_qwen2_5_vl_config())
    for record in RECORDS:
        mine, want = ours(record), theirs(record)
        assert mine.keys() == want.keys()
        for key, value in want.items():
            if value is None or isinstance(value, str):
                assert mine[key] == value, key
            else:
                np.testing.assert_array_equal(mine[key], value, err_msg=key)
