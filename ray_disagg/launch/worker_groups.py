"""One Ray Train ``WorkerGroup`` per module, presented to the controller as one group.

Ray Train's ``TrainController`` drives exactly one worker group. ``ModuleWorkerGroups``
owns a real ``WorkerGroup`` per module (own placement group, resources, backend and
default process group) and exposes the few methods the controller calls, so Ray Train's
own state machine, failure policy and checkpoint manager run unchanged:

- poll: the union of every group's worker statuses (in group order), so a
  report is consolidated, and a checkpoint registered, only when every worker of every
  group has reported it;
- shutdown/abort: all groups together, so no peer stays blocked in a cross-group recv.

With colocated placement every group schedules into one shared placement group (bundle
``i`` holds worker ``i`` of every group), owned here and removed after all groups stop.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import remove_placement_group

from ray_disagg.launch.group_start import shutdown_all, start_group
from ray_disagg.launch.launches import Colocation, GroupLaunch, Transfers
from ray_disagg.launch.ray_compat import (
    PreemptionCallback,
    ReportCallbackHandler,
    TrainRunContext,
    UserCallbackHandler,
    WorkerGroup,
    WorkerGroupCallback,
    WorkerGroupPollStatus,
    WorkerGroupStartupTimeoutError,
)
from ray_disagg.launch.recovery.restart import GroupRecovery
from ray_disagg.launch.recovery.survivors import Relaunch, interrupt, park
from ray_disagg.launch.reservations import reserve
from ray_disagg.transport.channel import ChannelSpec
from ray_disagg.transport.select import group_offsets, pair_tiers
from ray_disagg.worker import runtime

logger = logging.getLogger(__name__)

# Callbacks that consume the consolidated poll status of all workers.
_UNION_CALLBACKS = (ReportCallbackHandler, UserCallbackHandler)
# The preemption watcher assumes one group's rank numbering; not supported across groups.
_DROPPED_CALLBACKS = (PreemptionCallback,)
# Worker-group callbacks without per-start state: with only these the groups start at
# once; any other (a user's WorkerGroupCallback, NCCL RAS, state tracking) makes them
# start one after another.
_THREAD_SAFE_CALLBACKS = {
    "CheckpointManager",  # before_init_train_context only reads the latest checkpoint
    "WorkingDirectorySetupCallback",
    "AcceleratorSetupCallback",
    "BackendSetupCallback",
    "ControllerMetricsCallback",
    "ValidationManager",
}


@dataclass(frozen=True)
class ModulePollStatus(WorkerGroupPollStatus):
    """Poll status whose error text names the module group and its rank."""

    labels: dict[int, str] = field(default_factory=dict)

    def get_error_string(self) -> str:
        lines = []
        for idx, status in self.worker_statuses.items():
            if status.error is not None:
                text = str(status.error)
                if len(text) > 2000:
                    text = text[:1000] + "\n...\n" + text[-1000:]
                lines.append(f"[{self.labels.get(idx, idx)} failed]:\n{text}")
        return "\n".join(lines)


class ModuleWorkerGroups:
    """The module groups of one run attempt (see module docstring)."""

    def __init__(self, groups: dict[str, WorkerGroup], union_callbacks: list, shared_pg=None):
        self._groups = groups
        self._shared_pg = shared_pg
        self._union_callbacks = union_callbacks
        self._latest_poll_status = None
        self._relabel()
        self.recovery: GroupRecovery | None = None  # set by create()
        self._store_at: tuple[str, int] | None = None

    @classmethod
    def create(
        cls,
        *,
        launches: dict[str, GroupLaunch],
        train_run_context: TrainRunContext,
        run_attempt_id: str,
        callbacks: list,
        side_timeout_s: float,
        transfers: Transfers,
        colocation: Colocation | None = None,
    ) -> ModuleWorkerGroups:
        union = [c for c in callbacks if isinstance(c, _UNION_CALLBACKS)]
        shared = [
            c
            for c in callbacks
            if not isinstance(c, _UNION_CALLBACKS) and not isinstance(c, _DROPPED_CALLBACKS)
        ]
        started: dict[str, WorkerGroup] = {}
        shared_pg = None
        try:
            if colocation is not None:
                shared_pg = reserve(
                    [dict(colocation.bundle)] * colocation.num_bundles,
                    colocation.strategy,
                    train_run_context.run_id,
                    "colocated",
                )
            started = cls._start_groups(
                launches, train_run_context, run_attempt_id, shared, shared_pg
            )
            groups = cls(started, union, shared_pg)
            groups.recovery = GroupRecovery(Relaunch(
                launches, train_run_context, run_attempt_id, shared, side_timeout_s,
                transfers,
            ))  # fmt: skip
            if shared_pg is not None:
                groups.check_pairing()
            groups.connect_channel(run_attempt_id, side_timeout_s, transfers)
            groups.recovery.start_standbys(_unsafe(shared))
        except BaseException:
            shutdown_all(started.values())
            _remove(shared_pg)
            raise
        for cb in union:
            cb.after_worker_group_start(groups)
        return groups

    @classmethod
    def _start_groups(
        cls, launches, base_ctx, run_attempt_id, shared, shared_pg
    ) -> dict[str, WorkerGroup]:
        """Start every group, in ``launches`` order in the result: all at once (each in its
        own thread) when every shared callback is one known to be thread-safe, else one
        after another. On an error the groups that did start are stopped, every error is
        logged, and a non-retryable one is raised before a start timeout."""

        def start(launch: GroupLaunch) -> WorkerGroup:
            return start_group(launch, base_ctx, run_attempt_id, shared, shared_pg)

        unsafe = _unsafe(shared)
        if unsafe:
            logger.info("Starting the groups one after another (callbacks %s).", unsafe)
        parallel = not unsafe
        with ThreadPoolExecutor(max_workers=len(launches) if parallel else 1) as pool:
            futures = {name: pool.submit(start, launch) for name, launch in launches.items()}
            wait(futures.values())
        started, errors = {}, []
        for name, fut in futures.items():
            if fut.exception() is None:
                started[name] = fut.result()
            else:
                errors.append(fut.exception())
                logger.warning("Starting the %s group failed: %r", name, fut.exception())
        if errors:
            shutdown_all(started.values())
            errors.sort(key=lambda e: isinstance(e, WorkerGroupStartupTimeoutError))
            raise errors[0]
        return started

    def check_pairing(self) -> None:
        """Colocated: rank ``r`` of every group must sit in the same bundle (Ray Train
        orders ranks by node and GPU id, identically for groups sharing the bundles)."""
        bundles = {
            name: [w.placement_group_bundle_index for w in wg.get_workers()]
            for name, wg in self._groups.items()
        }
        if len({tuple(b) for b in bundles.values()}) != 1:
            raise RuntimeError(f"colocated groups' ranks are not paired by bundle: {bundles}")

    def connect_channel(self, run_attempt_id: str, timeout_s: float, transfers) -> None:
        """Every worker joins the side channel (its store hosted by the first group's
        rank 0: the LLM group, which a group restart never replaces)."""
        if self._store_at is None:
            host = next(iter(self._groups.values())).get_workers()[0]
            self._store_at = ray.get(host.execute_async(runtime.host_channel_store, timeout_s))
        addr, port = self._store_at
        sizes = {name: len(wg.get_workers()) for name, wg in self._groups.items()}
        offsets = group_offsets(sizes)
        workers = [w for wg in self._groups.values() for w in wg.get_workers()]
        locations = ray.get([w.execute_async(runtime.locate) for w in workers], timeout=timeout_s)
        tiers = pair_tiers(offsets, transfers.pairs, locations, transfers.requested)
        shown = {
            f"{ga}[{ra}]<->{gb}[{rb}]": tiers[tuple(sorted((offsets[ga] + ra, offsets[gb] + rb)))]
            for (ga, ra), (gb, rb) in transfers.pairs
        }
        logger.info("Transfer tiers: %s", shown)
        r = self.recovery
        prefix = f"side/{run_attempt_id}" + (f"/g{r.generation}" if r.generation else "")
        spec = ChannelSpec(
            addr, port, offsets, sizes, timeout_s, prefix, locations, tiers,
            generation=r.generation, restarts=dict(r.restarts), takeovers=dict(r.takeovers),
        )  # fmt: skip
        refs = [
            w.execute_async(runtime.join_channel, spec, name, w.distributed_context.world_rank)
            for name, wg in self._groups.items()
            for w in wg.get_workers()
        ]
        ray.get(refs, timeout=timeout_s)

    # ---- restarting one group (the steps of GroupRecovery.restart) -------------------

    def failed_groups(self, status: WorkerGroupPollStatus) -> set[str]:
        return {self._owners[i] for i in status.errors}

    def stop_group(self, name: str) -> None:
        """Stop group ``name`` (every worker); it has no workers until installed again."""
        try:
            self._groups[name].abort()
        except Exception:
            logger.warning("Stopping the failed %s group failed.", name, exc_info=True)
        self._replace(name, None)

    def interrupt_survivors(self, failed: str, generation: int, checkpoint, timeout_s):
        workers = [w for n, wg in self._groups.items() if n != failed for w in wg.get_workers()]
        interrupt(workers, failed, generation, checkpoint, timeout_s)

    def park_survivors(self, failed: str, timeout_s: float) -> None:
        park({n: wg for n, wg in self._groups.items() if n != failed}, timeout_s)

    def start_group(self, launch: GroupLaunch, relaunch: Relaunch) -> WorkerGroup:
        """A new group for ``launch`` (colocated: in the shared placement group)."""
        r = relaunch
        return start_group(launch, r.train_run_context, r.run_attempt_id, r.shared, self._shared_pg)

    def install_group(self, name: str, wg: WorkerGroup) -> None:
        """``wg`` (of any size) takes the place of the stopped group ``name``."""
        self._replace(name, wg)
        self._reset_reports()  # for the union's new size
        if self._shared_pg is not None:
            self.check_pairing()

    def _replace(self, name: str, wg: WorkerGroup | None) -> None:
        self._groups[name] = wg
        self._relabel()

    def _relabel(self) -> None:
        """Each worker's index in the union (group order), its label and group."""
        self._labels, self._owners = {}, {}
        for name, wg in self._groups.items():
            for r in range(len(wg.get_workers()) if wg is not None else 0):
                self._labels[len(self._owners)] = f"{name} group rank {r}"
                self._owners[len(self._owners)] = name

    def _reset_reports(self) -> None:
        """Forget reports not yet consolidated (the survivors continue from a checkpoint)."""
        for cb in self._union_callbacks:
            if isinstance(cb, ReportCallbackHandler):
                cb.after_worker_group_start(self)

    # ---- what TrainController calls -------------------------------------------------

    def __len__(self) -> int:
        return len(self._labels)

    def _live(self) -> list[WorkerGroup]:
        """The groups (a failed group restart may leave one stopped: ``None``)."""
        return [wg for wg in self._groups.values() if wg is not None]

    def has_started(self) -> bool:
        return all(wg.has_started() for wg in self._live())

    def get_workers(self):
        return [w for wg in self._live() for w in wg.get_workers()]

    def get_worker_group_state(self):
        return next(iter(self._groups.values())).get_worker_group_state()

    def get_latest_poll_status(self):
        return self._latest_poll_status

    def set_required_barrier_ranks(self, ranks) -> bool:
        return False

    def poll_status(self, timeout: float | None = None) -> ModulePollStatus:
        statuses, idx = {}, 0
        for wg in self._groups.values():
            for status in wg.poll_status(timeout=timeout).worker_statuses.values():
                statuses[idx] = status
                idx += 1
        result = ModulePollStatus(worker_statuses=statuses, labels=self._labels)
        for cb in self._union_callbacks:
            cb.after_worker_group_poll_status(result)
        self._latest_poll_status = result
        return result

    def _close_channels(self, abort: bool, timeout_s: float = 30.0) -> None:
        """Every worker releases its channel (shm segments, NCCL pair groups) before its
        group stops; best effort, bounded by ``timeout_s`` (a hung worker is killed by the
        group shutdown anyway)."""
        try:
            refs = [w.execute_async(runtime.close_channel, abort) for w in self.get_workers()]
            ray.get(refs, timeout=timeout_s)
        except Exception:
            logger.warning("Closing the workers' channels failed.", exc_info=True)

    def shutdown(self) -> None:
        if self.recovery is not None:
            self.recovery.close(wait_s=60.0)
        for cb in self._union_callbacks:
            cb.before_worker_group_shutdown(self)
        self._close_channels(abort=False)
        errors = []
        for wg in self._live():
            try:
                wg.shutdown()
            except Exception as e:  # shut the other groups down regardless
                errors.append(e)
        _remove(self._shared_pg)
        if errors:
            raise errors[0]

    def abort(self) -> None:
        if self.recovery is not None:
            self.recovery.close()
        self._close_channels(abort=True, timeout_s=10.0)
        for wg in self._live():
            try:
                wg.abort()
            except Exception:
                logger.warning("Aborting a module group failed.", exc_info=True)
        _remove(self._shared_pg)


def _unsafe(shared) -> list[str]:
    """The worker-group callbacks not known to be thread-safe."""
    return [
        type(c).__name__
        for c in shared
        if isinstance(c, WorkerGroupCallback)  # the others run in the workers
        and type(c).__name__ not in _THREAD_SAFE_CALLBACKS
    ]


def _remove(pg) -> None:
    if pg is not None:
        try:
            remove_placement_group(pg)
        except Exception:  # already removed
            logger.debug("Removing the shared placement group failed.", exc_info=True)
