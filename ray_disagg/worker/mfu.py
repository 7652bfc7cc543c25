"""MFU's two halves on a worker: the model FLOPs of the samples a step ran
(:func:`samples_flops`, from the adapter's per-family count, :mod:`ray_disagg.models.flops`)
and the device's peak (:func:`peak_flops`: ``peak_tflops`` when set, else a table of
accelerators' dense peaks; ``None``, and no MFU, on a CPU or an unknown GPU).

``<group>_mfu = <group>'s model FLOPs / (step time x Σ its workers' peaks)``, and ``mfu``
the same over all groups (:class:`~ray_disagg.worker.stats.StepStats`).

Example:
    >>> dense_peak("NVIDIA H100 80GB HBM3", bf16=True) / 1e12
    989.4
    >>> dense_peak("NVIDIA GeForce GT 710", bf16=True) is None
    True
"""

from __future__ import annotations

import math
import re
import warnings

import torch

from ray_disagg.models.flops import step_flops

__all__ = ["PEAK_TFLOPS", "dense_peak", "device_share", "peak_flops", "samples_flops"]

# Dense (no sparsity) peak TFLOP/s from the vendors' datasheets: (bf16 tensor cores,
# fp32 without TF32, as PyTorch's default ``float32_matmul_precision="highest"`` runs).
# Matched against ``torch.cuda.get_device_name()`` in order: the first key it contains as
# whole words ("A10" is not "A10G", "L4" not "L40S"). A MIG slice gets its GPU's peak.
PEAK_TFLOPS: dict[str, tuple[float, float]] = {
    "H200 NVL": (835.0, 60.0),
    "H200": (989.4, 66.9),
    "H100 PCIe": (756.0, 51.2),
    "H100 NVL": (835.0, 60.0),
    "H100": (989.4, 66.9),  # SXM ("H100 80GB HBM3")
    "A100": (312.0, 19.5),
    "L40S": (362.05, 91.6),
    "L40": (181.05, 90.5),
    "L4": (121.0, 30.3),
    "A10": (125.0, 31.2),
}


def dense_peak(device_name: str, bf16: bool) -> float | None:
    """The table's dense peak FLOP/s of ``device_name`` (``None``: not in the table)."""
    for key, (half, single) in PEAK_TFLOPS.items():
        if re.search(rf"\b{re.escape(key)}\b", device_name):
            return (half if bf16 else single) * 1e12
    return None


def device_share(scaling_config) -> float:
    """The fraction of a GPU each worker of ``scaling_config`` holds (``resources_per_worker
    ={"GPU": 0.5}`` under ``placement="colocated"``: two groups' workers share one GPU);
    1 without GPUs."""
    if not scaling_config.use_gpu:
        return 1.0
    return float((scaling_config.resources_per_worker or {}).get("GPU", 1.0))


def peak_flops(device: torch.device, cfg, warn: bool, share: float = 1.0) -> float | None:
    """This worker's peak FLOP/s in the run's dtype (bf16 under ``bf16`` or
    ``param_dtype="bfloat16"``) times its ``share`` of the device (:func:`device_share`:
    a device's peak counts once over the groups sharing it): ``cfg.peak_tflops`` when
    set; a GPU's from the table (an unknown one warns when ``warn``); ``None`` on a CPU
    (no MFU without the setting: a CPU's peak depends on its cores, vector units and
    clocks)."""
    if cfg.peak_tflops is not None:
        return cfg.peak_tflops * 1e12 * share
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    bf16 = cfg.bf16 or cfg.param_dtype == "bfloat16"
    peak = dense_peak(name, bf16)
    if peak is None and warn:
        warnings.warn(
            f"no peak FLOP/s known for {name!r}: MFU is left out of the metrics; set "
            "train_loop_config['peak_tflops'] to the device's dense peak in the run's dtype",
            stacklevel=2,
        )
    return None if peak is None else peak * share


def samples_flops(adapter, part: str, samples, backward: bool, trains: bool = True) -> float:
    """Model FLOPs ``part`` runs over ``samples`` (:func:`~ray_disagg.models.flops.
    step_flops`: forward only without ``backward``; input gradients only when the part
    ``trains`` nothing but passes gradients on); NaN (no MFU) for an adapter of one's own
    that counts none (``tower_flops`` not written)."""
    try:
        return sum(step_flops(adapter.sample_flops(part, s), backward, trains) for s in samples)
    except NotImplementedError:
        return math.nan
