"""Tier 1: the per-step peak memory of a CPU worker starts anew at each reset."""

import sys

import pytest
import torch

from ray_disagg.worker.memory import limit_heap_fragmentation, peak_memory_mb, reset_peak_memory

CPU = torch.device("cpu")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM is Linux's")
def test_reset_peak_memory_starts_a_new_window_on_cpu():
    reset_peak_memory(CPU)
    before = peak_memory_mb(CPU)
    x = torch.ones(64 * 2**20)  # 256 MiB, touched; freed (unmapped) right away
    del x
    assert peak_memory_mb(CPU) >= before + 200
    reset_peak_memory(CPU)
    assert peak_memory_mb(CPU) < before + 100
    assert isinstance(limit_heap_fragmentation(), bool)
