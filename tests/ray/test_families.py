"""Tier 3, one family beyond Qwen2.5-VL on Ray Train worker groups: InternVL with its tower
under tile SP2, frozen, text TP2, packed rows, validation and an export equals HF. The
other families' runs of ``tests/family_runs.py`` are in the gloo tier
(``tests/gloo/test_family_runs.py``): Ray adds nothing to a family's numerics."""

from tests.family_runs import check_llava_family_trains_like_hf


def test_llava_family_trains_on_ray_like_hf(ray_start_4_cpus, tmp_path):
    check_llava_family_trains_like_hf(tmp_path, "internvl", local=False)
