"""What ``ray-disagg plan --auto`` plans for: the cluster and the device figures.

A :class:`Cluster` says how many devices there are and how much memory each has (GPUs,
or CPU cores for CPU workers); :class:`DeviceFigures` how fast they compute and move
bytes. Nominal figures ship with the package (marked uncalibrated); ``--calibrate``
measures them on the connected cluster (:mod:`ray_disagg.planner.calibrate`) and stores
them in a JSON file later runs reuse.

Example:
    >>> c = parse_cluster("nodes=1,gpus_per_node=8,gpu_memory_gib=141")
    >>> c.devices, c.device_memory_gib
    (8, 141.0)
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

__all__ = [
    "Cluster",
    "DeviceFigures",
    "NOMINAL",
    "cluster_from_ray",
    "default_figures_path",
    "load_figures",
    "parse_cluster",
    "save_figures",
]

INTERCONNECTS = ("nvlink", "pcie", "loopback")


@dataclass(kw_only=True)
class Cluster:
    """The devices a layout may use."""

    nodes: int = 1
    """Nodes of the cluster (identical)."""
    gpus_per_node: int = 0
    """GPUs per node; 0 plans CPU workers, one per core."""
    gpu_memory_gib: float = 80.0
    """Memory of one GPU."""
    cpus_per_node: int = 2
    """CPU cores per node (the devices of a CPU cluster)."""
    host_memory_gib: float = 24.0
    """Host memory per node (a CPU cluster's workers share it)."""
    interconnect: str = "nvlink"
    """Between the GPUs of a node: ``nvlink``, ``pcie``; ``loopback`` for CPU workers."""

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node", "cpus_per_node"):
            v = getattr(self, name)
            if (
                isinstance(v, bool)
                or not isinstance(v, int)
                or v < (1 if name != "gpus_per_node" else 0)
            ):
                raise ValueError(f"cluster {name}={v!r}: must be an int >= 1 (gpus_per_node >= 0).")
        for name in ("gpu_memory_gib", "host_memory_gib"):
            if not float(getattr(self, name)) > 0:
                raise ValueError(f"cluster {name}={getattr(self, name)!r}: must be > 0.")
        if self.interconnect not in INTERCONNECTS:
            raise ValueError(
                f"cluster interconnect={self.interconnect!r}: must be one of {INTERCONNECTS}."
            )

    @property
    def gpu(self) -> bool:
        return self.gpus_per_node > 0

    @property
    def per_node(self) -> int:
        """Devices per node."""
        return self.gpus_per_node if self.gpu else self.cpus_per_node

    @property
    def devices(self) -> int:
        return self.nodes * self.per_node

    @property
    def device_memory_gib(self) -> float:
        """Memory one worker may use: a GPU's, or a core's share of the host's."""
        return float(self.gpu_memory_gib if self.gpu else self.host_memory_gib / self.per_node)


def parse_cluster(text: str) -> Cluster:
    """``"nodes=2,gpus_per_node=8,gpu_memory_gib=80,interconnect=nvlink"`` -> Cluster."""
    kw = {}
    names = {f.name: f.type for f in dataclasses.fields(Cluster)}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in names:
            raise ValueError(
                f"--cluster {text!r}: {item!r} is not KEY=VALUE with KEY in {list(names)}."
            )
        kw[key] = value if key == "interconnect" else (float(value) if "gib" in key else int(value))
    return Cluster(**kw)


def cluster_from_ray() -> Cluster:
    """The connected Ray cluster (its alive nodes; the first GPU node's figures)."""
    import psutil
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    gpus = [int(n["Resources"].get("GPU", 0)) for n in nodes]
    cpus = [int(n["Resources"].get("CPU", 0)) for n in nodes]
    memory = psutil.virtual_memory().total / 2**30
    if any(gpus):
        import torch

        mem = (
            torch.cuda.get_device_properties(0).total_memory / 2**30
            if torch.cuda.is_available()
            else 80.0
        )
        return Cluster(nodes=sum(1 for g in gpus if g), gpus_per_node=max(gpus), gpu_memory_gib=mem,
                       cpus_per_node=max(cpus), host_memory_gib=memory)  # fmt: skip
    return Cluster(nodes=len(nodes), cpus_per_node=max(1, min(cpus)), host_memory_gib=memory,
                   interconnect="loopback")  # fmt: skip


@dataclass(kw_only=True)
class DeviceFigures:
    """How fast one device computes and moves bytes (per second)."""

    name: str
    flops: dict[str, float]
    """Achieved matmul FLOP/s of one device (one worker) per dtype: ``float32``,
    ``bfloat16``."""
    collective_bw: float
    """Bytes/s of a collective between devices of one node (ring bandwidth)."""
    inter_node_bw: float
    """Bytes/s of a collective across nodes."""
    tier_bw: dict[str, float]
    """Bytes/s of a crossing between groups, per transfer tier."""
    memory_bw: float
    """Bytes/s the optimizer step streams (AdamW reads and writes each state)."""
    encoder_speed: float = 1.0
    """An encoder's achieved FLOP/s relative to ``flops`` (the LLM's): below 1 where its
    smaller matmuls, convolutions and many small ops run slower per FLOP; from the
    calibration's per-group compute seconds."""
    grad_sync_bw: float | None = None
    """Bytes/s of the data-parallel gradient sync within a node (DDP's all-reduce,
    FSDP2's gathers and reduce-scatters) as a training step runs it: below
    ``collective_bw`` where it competes with the backward (CPU workers share their cores
    with gloo's reductions); from the calibration's data-parallel run (None:
    ``collective_bw``)."""
    microbatch_exponent: float = 1.0
    """Compute time grows as (samples per microbatch per worker) ** this: above 1 when
    smaller microbatches run faster per sample (caches), 1 on a GPU's nominal figures."""
    reference_samples: float = 0.0
    """Samples per microbatch per worker at which ``flops`` was measured (0: any)."""
    overhead_s: float = 0.0
    """Fixed seconds per microbatch and group (launches, Python, messages)."""
    fsdp_unit_s: float = 0.0
    """Seconds per FSDP2 unit and pass (forward gather, backward gather, reduce-scatter)
    beyond its collective: copies in and out of the flat buffers, hooks, the sharded
    optimizer step; from the calibration's FSDP2 run."""
    collective_latency_s: float = 0.0
    """Fixed seconds per collective call (synchronising the ranks, launching it)."""
    memory_fit: dict[str, list] = field(
        default_factory=lambda: {"llm": [0.0, 1.0], "encoder": [0.0, 1.0]}
    )
    """Per kind of group (``llm``, ``encoder``): ``[fixed bytes, activation scale]``: a
    worker's memory over the idle baseline is its training state + DP/FSDP2 buffers +
    fixed bytes + scale x the estimated activations."""
    calibrated: bool = False
    """``False``: nominal figures (not measured on this cluster)."""
    idle_mb: float | None = None
    """Resident memory of an idle worker (MB; what the planner's memory leaves out)."""


NOMINAL = {
    "gpu": DeviceFigures(  # an H100/H200-class GPU on NVLink; nominal, not measured
        name="nominal H100-class GPU (uncalibrated)",
        flops={"float32": 50e12, "bfloat16": 400e12},
        collective_bw=150e9,
        inter_node_bw=40e9,
        tier_bw={"cuda_ipc": 400e9, "nccl": 150e9, "shm": 10e9, "gloo": 2e9},
        memory_bw=2.0e12,
        overhead_s=0.01,
    ),
    "cpu": DeviceFigures(  # one CPU core; nominal, not measured
        name="nominal CPU core (uncalibrated)",
        flops={"float32": 40e9, "bfloat16": 10e9},
        collective_bw=2e9,
        inter_node_bw=1e9,
        tier_bw={"shm": 2e9, "gloo": 1e9},
        memory_bw=5e9,
        overhead_s=0.05,
    ),
}


def default_figures_path(cluster: Cluster) -> str:
    kind = "gpu" if cluster.gpu else "cpu"
    root = os.environ.get("RAY_DISAGG_CACHE", os.path.expanduser("~/.cache/ray_disagg"))
    return os.path.join(root, f"calibration-{kind}.json")


def load_figures(cluster: Cluster, path: str | None = None) -> DeviceFigures:
    """The calibration file at ``path`` (default: this kind of cluster's under
    ``~/.cache/ray_disagg``), else the nominal figures."""
    path = path or default_figures_path(cluster)
    if os.path.exists(path):
        with open(path) as f:
            stored = json.load(f)
        unknown = sorted(set(stored) - {f.name for f in dataclasses.fields(DeviceFigures)})
        if unknown:
            raise ValueError(
                f"device figures {path}: {unknown} are not figures of this version's cost "
                "model (written by another version of ray_disagg); calibrate again with "
                "`ray-disagg plan --auto RECIPE --calibrate`, or delete the file."
            )
        return DeviceFigures(**stored)
    return NOMINAL["gpu" if cluster.gpu else "cpu"]


def save_figures(figures: DeviceFigures, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(dataclasses.asdict(figures), f, indent=2)
    return path
