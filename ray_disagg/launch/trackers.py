"""Experiment trackers (``DisaggregatedTrainer(report_to=["tensorboard", "mlflow",
"wandb"])``, a recipe's ``run_config.report_to``): every reported step's metrics (the
merged metrics of all groups, as the run's metrics history has them) and the run's
settings (the loop config and the layout, as parameters) are logged from one place per
run, the driver, as each step reaches it (:mod:`ray_disagg.launch.progress`): never once
per worker, and the same tracker run across the run's restarts (a resumed ``fit()`` of
the same run continues it: ``trackers.json`` keeps its ids).

Where each logs by default, in ``<run>``: the run's directory when its storage is local or
mounted, else ``~/ray_results/<name>`` on the driver (a run on S3 or GCS: the trackers'
files stay on the driver); the driver's environment (the trackers' own ``MLFLOW_*`` /
``WANDB_*`` settings) applies as is and points them elsewhere:

- ``tensorboard``: ``<run>/tensorboard`` (event files; ``tensorboard --logdir``);
- ``mlflow``: ``MLFLOW_TRACKING_URI``, else ``sqlite:///<run>/mlflow.db``; experiment
  ``MLFLOW_EXPERIMENT_NAME``, else ``ray_disagg``; run name: the run's;
- ``wandb``: project ``WANDB_PROJECT``, else ``ray_disagg``; files in ``<run>/wandb``;
  ``WANDB_MODE=offline`` (sync later with ``wandb sync``) or online with credentials.

A missing package is a ``ValueError`` naming its extra; a tracker that fails mid-run
warns once and is left out, and training goes on.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import math
import os
import threading
import time

from ray_disagg.run_files import TRACKERS_FILE

__all__ = ["TRACKERS", "Trackers", "check_report_to", "run_params"]

logger = logging.getLogger("ray_disagg.trainer")

TRACKERS = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}
"""Each tracker and the package (and ``ray_disagg`` extra) it needs."""


def check_report_to(report_to) -> tuple[str, ...]:
    """``report_to`` as a tuple of tracker names, each installed (``ValueError`` naming
    the fix: an unknown or repeated name, a missing extra, W&B online without a key)."""
    names = (report_to,) if isinstance(report_to, str) else tuple(report_to or ())
    for name in names:
        if name not in TRACKERS:
            raise ValueError(
                f"report_to={list(names)}: unknown tracker {name!r}; choose from {list(TRACKERS)}."
            )
        if names.count(name) > 1:
            raise ValueError(f"report_to={list(names)}: {name!r} is given twice.")
        if importlib.util.find_spec(TRACKERS[name]) is None:
            raise ValueError(
                f"report_to={name!r} needs the {TRACKERS[name]} package: "
                f"pip install 'ray_disagg[{name}]'."
            )
    if "wandb" in names and _wandb_online() and not _wandb_key():
        raise ValueError(
            "report_to='wandb' logs online but W&B has no credentials here: set "
            "WANDB_API_KEY (or run `wandb login`), or WANDB_MODE=offline to log to files."
        )
    return names


def _wandb_online() -> bool:
    return os.environ.get("WANDB_MODE", "online") not in ("offline", "disabled", "dryrun")


def _wandb_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = os.path.expanduser("~/.netrc")
    if not os.path.isfile(netrc):
        return False
    with open(netrc) as f:
        return "api.wandb.ai" in f.read()


def _read_json(path: str) -> dict:
    """The file's JSON object, or ``{}`` (missing, or unreadable: a fresh start)."""
    try:
        with open(path) as f:
            value = json.load(f)
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def run_params(trainer) -> dict[str, str]:
    """The run's settings as flat tracker parameters: ``loop.<field>`` of the loop
    config, ``group.<name>.{workers,parallelism,trainable}``, ``model``."""
    out = {"model": trainer.adapter.model_type, "placement": trainer.placement}
    for f in dataclasses.fields(trainer.loop_config):
        value = getattr(trainer.loop_config, f.name)
        if f.name != "extra" and value is not None:
            out[f"loop.{f.name}"] = str(value)
    for name, g in trainer.groups.items():
        out[f"group.{name}.workers"] = str(g.num_workers)
        out[f"group.{name}.parallelism"] = repr(g.parallelism)
        out[f"group.{name}.trainable"] = str(g.trainable)
    return {k: v[:500] for k, v in out.items()}


def _scalars(metrics: dict) -> dict[str, float]:
    """The finite numbers of a step's metrics (lists, strings and NaNs left out)."""
    return {
        k: float(v)
        for k, v in metrics.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


class _TensorBoard:
    def __init__(self, run_dir: str, name: str, params: dict, ids: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=os.path.join(run_dir, "tensorboard"))
        self.writer.add_text("params", json.dumps(params, indent=1), 0)

    def log(self, step: int, metrics: dict) -> None:
        for k, v in _scalars(metrics).items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()


class _MLflow:
    def __init__(self, run_dir: str, name: str, params: dict, ids: dict):
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{run_dir}/mlflow.db"
        self.client = MlflowClient(tracking_uri=uri)
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME", "ray_disagg")
        found = self.client.get_experiment_by_name(experiment)
        exp_id = found.experiment_id if found else self.client.create_experiment(experiment)
        self.run_id = self._reused(ids.get("mlflow"))
        if self.run_id is None:
            self.run_id = self.client.create_run(exp_id, run_name=name).info.run_id
            for k, v in params.items():
                self.client.log_param(self.run_id, k, v)
        ids["mlflow"] = self.run_id

    def _reused(self, run_id: str | None) -> str | None:
        """An earlier fit's run, running again (``None``: none, or it is gone)."""
        if not run_id:
            return None
        try:
            if self.client.get_run(run_id).info.lifecycle_stage != "active":
                return None
        except Exception:  # noqa: BLE001 - another store, or deleted: a new run
            return None
        self.client.update_run(run_id, status="RUNNING")
        return run_id

    def log(self, step: int, metrics: dict) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(_mlflow_key(k), v, now, step) for k, v in _scalars(metrics).items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def finish(self) -> None:
        self.client.set_terminated(self.run_id)


def _mlflow_key(key: str) -> str:
    """MLflow's metric names allow ``/``, ``.``, ``-``, ``_`` and spaces, 250 at most."""
    return "".join(c if c.isalnum() or c in "/._- " else "_" for c in key)[:250]


class _Wandb:
    def __init__(self, run_dir: str, name: str, params: dict, ids: dict):
        import wandb

        os.makedirs(os.path.join(run_dir, "wandb"), exist_ok=True)
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "ray_disagg"),
            name=name,
            id=ids.get("wandb"),
            resume="allow",
            dir=run_dir,
            config=params,
            reinit="create_new",
        )
        ids["wandb"] = self.run.id

    def log(self, step: int, metrics: dict) -> None:
        self.run.log(_scalars(metrics), step=step)

    def finish(self) -> None:
        self.run.finish()


_OPEN = {"tensorboard": _TensorBoard, "mlflow": _MLflow, "wandb": _Wandb}


class Trackers:
    """The run's trackers: opened with the run (their ids in ``<run>/trackers.json``,
    reused by a later ``fit()`` in the same directory), given each new step (:meth:`log`:
    a step a restart redoes keeps the values logged first), closed at the end. Logging
    and closing take a lock (the progress thread logs; the driver closes)."""

    def __init__(self, names: tuple[str, ...], run_dir: str, name: str, params: dict):
        os.makedirs(run_dir, exist_ok=True)
        self.path, self.lock = os.path.join(run_dir, TRACKERS_FILE), threading.Lock()
        self.ids = _read_json(self.path)  # each tracker's run id, the last step logged
        self.warned = self.closed = False
        self.open = {}
        for tracker in names:
            try:
                self.open[tracker] = _OPEN[tracker](run_dir, name, params, self.ids)
            except Exception as e:  # noqa: BLE001 - a tracker never stops the training
                logger.warning("report_to %s: could not start (%s); not logging to it", tracker, e)
        self._save()

    def _save(self) -> None:
        """``trackers.json``, replaced whole (a crash leaves the old or the new one)."""
        try:
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(self.ids, f)
            os.replace(tmp, self.path)
        except OSError as e:
            logger.warning("report_to: could not save %s (%s)", self.path, e)

    def log(self, metrics: dict) -> None:
        with self.lock:
            if not self.closed:  # (a late poll after the end: nothing to do)
                self._log(int(metrics.get("step", 0)), metrics)

    def _log(self, step: int, metrics: dict) -> None:
        if step <= self.ids.get("last_step", 0):
            if not self.warned and self.open:
                logger.warning(
                    "report_to: steps up to %d were logged by an earlier attempt or fit of "
                    "this run; the trackers keep those values (the run's metrics history, "
                    "load_metrics, has the latest)", self.ids["last_step"],
                )  # fmt: skip
                self.warned = True
            return
        self.ids["last_step"] = step
        self._save()
        for tracker, sink in list(self.open.items()):
            try:
                sink.log(step, metrics)
            except Exception as e:  # noqa: BLE001
                logger.warning("report_to %s failed at step %d (%s); not logging to it "
                               "any more", tracker, step, e)  # fmt: skip
                del self.open[tracker]

    def finish(self) -> None:
        with self.lock:
            for tracker, sink in list(self.open.items()):
                try:
                    sink.finish()
                except Exception as e:  # noqa: BLE001
                    logger.warning("report_to %s: closing failed (%s)", tracker, e)
            self.open, self.closed = {}, True
