"""Time from a vision worker's SIGKILL to the next completed step: the failed group
restarted alone (with and without a standby, ``ModuleGroup(standby=True)``) against
every group restarted, in one run.

The model is a Qwen2.5-VL whose LLM (``--size``, ~160M parameters by default, loaded
from a bf16 ``save_pretrained`` directory made once under ``--cache``) takes far longer
to build than its ~5M-parameter vision tower. Layout: vision 1 + text 1, fp32 AdamW,
a checkpoint every 3 steps, every step reported. The vision worker exits (``os._exit``,
as after a SIGKILL) at the start of step 6, two steps after checkpoint 3 was written;
both runs then continue from checkpoint 3, so the first step reported after the kill is
the rerun step 4 (the controller log gives the group restart's phases).

For each mode it prints:

- ``kill -> next step``: from the kill (the drill's marker file, written just before
  the exit) to the first step the restarted run reports in its ``metrics.jsonl`` (polled
  every 20 ms; the driver appends each step as it takes it from the coordinator, within
  a quarter second of the report, the same in both modes; the step the survivors were
  finishing when the worker died does not count);
- ``step``: the median step time of the run (``step_time``), for scale;
- ``fit``: the whole ``fit()``.

The last lines give each group restart / full restart of ``kill -> next step`` (target
<= 0.5). The runs train bit-identically (checked: the final losses are printed).

    python benchmarks/recovery.py [--size 150m|tiny] [--cache DIR]
"""

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time

os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # keep Ray on 127.0.0.1

import ray  # noqa: E402
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import memory  # noqa: E402

from ray_disagg import (  # noqa: E402
    DisaggregatedTrainer,
    HFModelSpec,
    ModuleGroup,
)
from ray_disagg.data.examples import synthetic_samples  # noqa: E402
from ray_disagg.run_files import METRICS_FILE  # noqa: E402
from ray_disagg.testing.faults import fault_drill  # noqa: E402


def _metrics_file(run_config) -> str:
    """The run's ``metrics.jsonl`` (the benchmark's storage is a local path)."""
    return os.path.join(run_config.storage_path, run_config.name, METRICS_FILE)


KILL_STEP = 5  # 0-based: the vision worker dies at the start of step 6 (after checkpoint 3)
LOOP = {
    "max_steps": 8,
    "global_batch_size": 4,
    "checkpoint_every": 3,
    "report_every": 1,
    "lr": 1e-4,
    "seed": 0,
}
SIZES = {  # as benchmarks/memory.py's (see its SIZES), and one with fewer LLM layers
    "150m": (32000, 1024, 8, 16, 4, 3072, 256, 4),
    "300m": memory.SIZES["300m"],
    "tiny": memory.SIZES["tiny"],
}


MODES = {
    "standby": "vision group from its standby",
    "group": "vision group alone",
    "full": "every group",
}


class StepTimes(threading.Thread):
    """When each reported step's line appeared in ``metrics.jsonl``."""

    def __init__(self, path: str):
        super().__init__(daemon=True)
        self.path, self.seen, self.stop = path, [], threading.Event()

    def run(self):
        offset = 0
        while not self.stop.is_set():
            if os.path.exists(self.path):
                with open(self.path) as f:
                    f.seek(offset)
                    chunk = f.read()
                done = chunk[: chunk.rfind("\n") + 1]
                offset += len(done)
                now = time.time()
                self.seen += [(now, json.loads(line)["step"]) for line in done.splitlines()]
            time.sleep(0.02)


def timed_fit(spec, data, loop: dict, run_config, drill=None, standby=False, **trainer_kwargs):
    """``fit()`` of vision 1 + text 1 (inside ``drill``, a context manager, if given);
    returns the result, ``(time, step)`` of each line of its ``metrics.jsonl``, when
    ``fit()`` started and how long it took."""
    trainer = DisaggregatedTrainer(
        model=spec,
        groups={
            "vision": ModuleGroup(scaling_config=ScalingConfig(num_workers=1), standby=standby),
            "text": ModuleGroup(scaling_config=ScalingConfig(num_workers=1)),
        },
        train_loop_config=loop,
        datasets={"train": data},
        run_config=run_config,
        **trainer_kwargs,
    )
    watcher = StepTimes(_metrics_file(run_config))
    watcher.start()
    t0 = time.time()
    with drill or contextlib.nullcontext():
        result = trainer.fit()
    fit_s = time.time() - t0
    watcher.stop.set()
    watcher.join()
    return result, watcher.seen, t0, fit_s


def bench_model(sizes: tuple, name: str, cache: str):
    """The saved model of ``sizes`` (made once under ``cache``), its LLM's parameters
    (millions) and 16 samples."""
    spec = HFModelSpec(pretrained_path=memory.saved_model(memory.config_from(sizes), name, cache))
    n = sum(p.numel() for p in spec.meta_model("text").parameters()) / 1e6
    data = synthetic_samples(spec.load_config(), 16, grids=[(1, 8, 8), (1, 4, 8), None])
    return spec, n, data


def run(mode: str, spec, data, storage: str) -> dict:
    name = f"recovery-{mode}"
    run_config = RunConfig(
        name=name,
        storage_path=storage,
        failure_config=FailureConfig(max_failures=1),
        checkpoint_config=CheckpointConfig(num_to_keep=2),
    )
    marker = os.path.join(storage, f"{name}.killed")
    drill = fault_drill(group="vision", step=KILL_STEP, marker=marker)
    result, seen, t0, fit_s = timed_fit(
        spec, data, LOOP, run_config, drill, mode == "standby", restart_failed_group=mode != "full"
    )
    killed = os.path.getmtime(marker)
    # the survivors may still finish the step before the kill (1-based KILL_STEP): not
    # a step completed after the restart
    after = [t for t, step in seen if t > killed and step != KILL_STEP]
    steps = [m["step_time_s"] for m in _lines(_metrics_file(run_config)) if "step_time_s" in m]
    return {
        "recovery": after[0] - killed,
        "timeline": [(round(t - t0, 1), s) for t, s in seen] + [("kill", killed - t0)],
        "step": statistics.median(steps) if steps else float("nan"),
        "fit": fit_s,
        "restarts": result.metrics.get("vision_restarts"),
        "takeovers": result.metrics.get("vision_standby_takeovers", 0),
        "loss": result.metrics["loss"],
    }


def _lines(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="150m", choices=sorted(SIZES))
    p.add_argument("--cache", default="/tmp/ray_disagg_bench", help="saved model directory")
    args = p.parse_args()
    spec, llm_m, data = bench_model(SIZES[args.size], f"recovery_{args.size}", args.cache)
    vision_m = sum(p.numel() for p in spec.meta_model("vision").parameters()) / 1e6
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    rows = {}
    with tempfile.TemporaryDirectory(dir=args.cache) as storage:
        for mode in MODES:
            rows[mode] = run(mode, spec, data, storage)
    ray.shutdown()
    print(
        f"\nQwen2.5-VL, vision {vision_m:.1f}M + LLM {llm_m:.1f}M parameters; "
        f"vision 1 + text 1, vision worker killed at step {KILL_STEP + 1}"
    )
    print(f"{'restart':<30}{'kill -> next step':>18}{'step':>9}{'fit':>9}  restarts  loss")
    for mode, label in MODES.items():
        r = rows[mode]
        print(
            f"{label:<30}{r['recovery']:>17.1f}s{r['step']:>8.2f}s{r['fit']:>8.1f}s"
            f"  {r['restarts']!s:>3} ({r['takeovers']} standby)  {r['loss']:.6f}"
        )
    for mode in MODES:  # seconds from fit() to each reported step's line
        *lines, (_, kill) = rows[mode]["timeline"]
        print(f"{mode} timeline (s: step), kill at {kill:.1f}s: {lines}")
    for mode in ("standby", "group"):
        ratio = rows[mode]["recovery"] / rows["full"]["recovery"]
        print(f"{MODES[mode]} / full restart (kill -> next step): {ratio:.2f}x (target <= 0.5)")


if __name__ == "__main__":
    main()
