"""Tier 2, the family runs of ``tests/family_runs.py`` on the workers without Ray
(``testing.local``): Ray adds nothing to a family's numerics (the groups' Ray runs are
Qwen2.5-VL's, in ``tests/ray``)."""

import pytest

from tests.family_runs import (
    LAYOUTS,
    LLAVA_FAMILIES,
    check_family_trains_like_hf,
    check_llava_family_trains_like_hf,
)


@pytest.mark.parametrize("model_type", sorted(LAYOUTS))
def test_family_trains_like_hf(tmp_path, model_type):
    check_family_trains_like_hf(tmp_path, model_type)


@pytest.mark.parametrize("model_type", LLAVA_FAMILIES)
def test_llava_family_trains_like_hf(tmp_path, model_type):
    check_llava_family_trains_like_hf(tmp_path, model_type)
