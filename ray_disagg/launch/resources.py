"""What the module groups need from the cluster, checked on the driver before any worker
starts."""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Literal, get_args

import ray

from ray_disagg.launch.ray_compat import resources_per_worker

logger = logging.getLogger(__name__)


Placement = Literal["separate", "colocated"]
"""Where the groups' workers go: each group its own placement group, or bundles shared."""
PLACEMENTS = get_args(Placement)


def colocation_for(groups, placement: str):
    """``None`` for separate placement; for colocated the shared bundle (``ValueError``
    naming the fix when the groups cannot share bundles)."""
    from ray_disagg.launch.launches import Colocation

    if placement not in PLACEMENTS:
        raise ValueError(f"placement={placement!r}: must be one of {PLACEMENTS}.")
    if placement == "separate":
        _check_whole_gpus(groups)
        return None
    counts = {name: g.scaling_config.num_workers for name, g in groups.items()}
    if len(set(counts.values())) != 1:
        raise ValueError(
            "placement='colocated' puts worker i of every group in bundle i, so all groups "
            f"need the same num_workers; got {counts}. Give them equal worker counts (their "
            "layouts may differ, e.g. vision DataParallel x SequenceParallel(2) and text "
            "TensorParallel(2) on 2 workers each) or use placement='separate'."
        )
    gpu = {name: g.scaling_config.use_gpu for name, g in groups.items()}
    if len(set(gpu.values())) != 1:
        raise ValueError(
            f"placement='colocated' needs every group on the same devices; use_gpu is {gpu}."
        )
    strategies = {name: g.scaling_config.placement_strategy for name, g in groups.items()}
    if len(set(strategies.values())) != 1:
        raise ValueError(
            "placement='colocated' uses one placement group: give every group the same "
            f"ScalingConfig(placement_strategy=...); got {strategies}."
        )
    bundle: dict[str, float] = defaultdict(float)
    for g in groups.values():
        for k, v in resources_per_worker(g.scaling_config).items():
            bundle[k] += v
    if "GPU" in bundle and abs(bundle["GPU"] - 1) > 1e-9:
        # above 1 a bundle spans GPUs; below 1 two bundles (two ranks of one group) could
        # share a GPU, which the group's own NCCL process group refuses
        shares = {
            n: resources_per_worker(g.scaling_config).get("GPU", 0) for n, g in groups.items()
        }
        raise ValueError(
            f"placement='colocated' shares each GPU between the groups, but their GPU shares "
            f"{shares} add up to {bundle['GPU']:g}, not 1. Give each group a fraction so they "
            "sum to 1, e.g. ScalingConfig(num_workers=N, use_gpu=True, "
            "resources_per_worker={'GPU': 0.5})."
        )
    selectors = {n: g.scaling_config.label_selector for n, g in groups.items()}
    if any(selectors.values()):
        raise ValueError(
            f"placement='colocated' does not support ScalingConfig(label_selector=...) "
            f"(got {selectors}); use placement='separate'."
        )
    n = next(iter(counts.values()))
    return Colocation(bundle=dict(bundle), num_bundles=n, strategy=next(iter(strategies.values())))


def _check_whole_gpus(groups) -> None:
    """Separate placement: two workers of one group on one GPU (a fractional GPU share)
    make the group's NCCL process group fail ("Duplicate GPU detected")."""
    for name, g in groups.items():
        sc = g.scaling_config
        gpu = resources_per_worker(sc).get("GPU", 0) if sc.use_gpu else 0
        if sc.max_workers > 1 and gpu and gpu != int(gpu):
            raise ValueError(
                f"The {name} group asks for resources_per_worker={{'GPU': {gpu:g}}} with "
                f"{sc.max_workers} workers and placement='separate': two of its workers "
                'could share a GPU, which its NCCL process group refuses ("Duplicate GPU '
                'detected"). Give each worker a whole GPU (resources_per_worker='
                "{'GPU': 1}), or use placement='colocated' to share GPUs between the groups."
            )


def demand_lines(groups, colocation=None) -> list[str]:
    if colocation is not None:
        return [
            f"colocated: {colocation.num_bundles} x {colocation.bundle} "
            f"({colocation.strategy}), one worker of each of {list(groups)} per bundle"
        ]
    lines = []
    for name, g in groups.items():
        sc = g.scaling_config
        per = resources_per_worker(sc)
        lines.append(f"{name}: {sc.num_workers} x {per} ({sc.placement_strategy})")
    return lines


def stream_actor_cpus(data, llm_replicas: int) -> tuple[float, str] | None:
    """The CPUs a conversation stream's converting actors reserve while training runs
    (every LLM data-parallel replica converts on actors of its own) and how they add up;
    ``None`` for other data."""
    from ray_disagg.worker.ingest import is_record_stream

    if not is_record_stream(data):
        return None
    need = data.concurrency * data.num_cpus * llm_replicas
    how = (
        f"{data.concurrency} actor(s) x num_cpus={data.num_cpus:g} x {llm_replicas} LLM replica(s)"
    )
    return need, how


def _stream_room(stream: tuple[float, str], reserved: float, have: float) -> str | None:
    from ray_disagg.data.stream import STREAM_FIXES

    need, how = stream
    if reserved + need <= have + 1e-9:
        return None
    return (
        f"the conversation stream's converting actors need {need:g} CPUs ({how}) beside the "
        f"groups' {reserved:g} CPUs, but the cluster has {have:g} CPUs "
        f"({max(have - reserved, 0):g} free once the groups are placed): the actors would "
        f"wait forever. {STREAM_FIXES}"
    )


def check_cluster_capacity(groups, wait_for_resources: bool, colocation=None, stream=None) -> None:
    """``ValueError`` when the groups together cannot be placed on the cluster as it is,
    or leave no room for a conversation stream's converting actors (``stream``: their
    :func:`stream_actor_cpus`), unless ``wait_for_resources``: an autoscaling cluster may
    grow."""
    if not ray.is_initialized():
        ray.init()  # what Ray Train would do when it starts the controller
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    total: dict[str, float] = defaultdict(float)
    for node in nodes:
        for k, v in node.items():
            total[k] += v
    demand: dict[str, float] = defaultdict(float)
    problems = []
    if colocation is not None:  # one kind of bundle holding a worker of every group
        units = [
            ("colocated bundle", colocation.bundle, colocation.num_bundles, colocation.strategy)
        ]
    else:
        units = [
            (
                f"{name} worker",
                resources_per_worker(g.scaling_config),
                g.scaling_config.num_workers,
                g.scaling_config.placement_strategy,
            )
            for name, g in groups.items()
        ]
    for name, per, count, strategy in units:
        for k, v in per.items():
            demand[k] += v * count
        if not any(all(node.get(k, 0) >= v for k, v in per.items()) for node in nodes):
            problems.append(f"no node can hold one {name} ({per})")
        if strategy == "STRICT_PACK":
            whole = {k: v * count for k, v in per.items()}
            if not any(all(node.get(k, 0) >= v for k, v in whole.items()) for node in nodes):
                problems.append(f"STRICT_PACK: no node can hold all {count} of {name} ({whole})")
    for k, v in demand.items():
        if v > total.get(k, 0) + 1e-9:
            problems.append(
                f"{k}: the groups need {v:g} together, the cluster has {total.get(k, 0):g}"
            )
    room = None if stream is None else _stream_room(stream, demand["CPU"], total.get("CPU", 0))
    if room is not None and not problems and not wait_for_resources:
        raise ValueError(room[0].upper() + room[1:])
    if room is not None:
        problems.append(room)
    if problems and not wait_for_resources:
        raise ValueError(
            "The module groups cannot all be placed on this cluster: "
            + "; ".join(problems)
            + ". Demand: "
            + "; ".join(demand_lines(groups, colocation))
            + f". Cluster capacity: {dict(total)}. Lower num_workers or resources_per_worker, "
            "or pass DisaggregatedTrainer(wait_for_resources=True) on an autoscaling cluster."
        )
    if problems:
        logger.warning("Waiting for resources the cluster does not have yet: %s", problems)
