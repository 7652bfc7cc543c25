"""Tier 2, the family runs of ``tests/family_runs.py`` on the workers without Ray
(``testing.local``); InternVL's runs on Ray (``tests/ray/test_families.py``)."""

import pytest

from tests.family_runs import (
    LAYOUTS,
    LLAVA_FAMILIES,
    check_family_trains_like_hf,
    check_llava_family_trains_like_hf,
)


@pytest.mark.parametrize("model_type", sorted(LAYOUTS))
def test_family_trains_like_hf(tmp_path, model_type):
    check_family_trains_like_hf(tmp_path, model_type, local=True)


@pytest.mark.parametrize("model_type", [m for m in LLAVA_FAMILIES if m != "internvl"])
def test_llava_family_trains_like_hf(tmp_path, model_type):
    check_llava_family_trains_like_hf(tmp_path, model_type, local=True)
