"""``ray-disagg``: train or plan a run from a recipe (see :mod:`ray_disagg.recipes.recipe`).

    ray-disagg plan RECIPE [key=value ...]    # check the recipe, print layout + memory
    ray-disagg plan --auto RECIPE [--cluster nodes=1,gpus_per_node=8,gpu_memory_gib=80]
        [--calibrate] [--figures FILE] [--out BEST.yaml]   # rank layouts, write the best
    ray-disagg train RECIPE [key=value ...]   # build the trainer and fit()
    ray-disagg plot RUN [--out DIR]           # the run's pictures
    ray-disagg export RUN_OR_CHECKPOINT OUT [--adapter] [--base DIR]   # Hugging Face's layout
    ray-disagg recipes                        # list the bundled recipes

``RECIPE`` is a YAML file or the name of a bundled recipe (``sft_cpu``, ``lora_cpu``,
``dpo_cpu``, ``grpo_cpu``, ``digits_cpu``, ``qwen2_5_vl_32b_8gpu``). ``python -m ray_disagg`` is the
same command. A recipe error exits with status 2 and one message on stderr.

``train`` checks the recipe, then (unless a source is a Ray Dataset) builds the trainer,
which checks the samples, and only then calls ``ray.init()``, when Ray is not
initialized: with ``RAY_ADDRESS`` set (e.g. under ``ray job submit``) it connects to that
cluster, else it starts a local one.

Example:
    >>> text = main(["plan", "digits_cpu", "train_loop_config.max_steps=4"])  # doctest: +ELLIPSIS
    recipe digits_cpu: qwen2_5_vl, config (random init)
    ...
    >>> result = main(["train", "digits_cpu", "train_loop_config.max_steps=2"])  # doctest: +SKIP
    >>> result.metrics["loss"]  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import warnings

os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")

__all__ = ["auto_plan", "main", "plan", "train"]


def plan(recipe: str, overrides=()) -> str:
    """The plan of a recipe as text (no Ray, no workers, no weights)."""
    from ray_disagg.planner.render import render
    from ray_disagg.recipes.recipe import load_recipe

    return render(load_recipe(recipe, overrides))


def auto_plan(recipe: str, overrides=(), *, cluster: str | None = None, calibrate=False,
              figures: str | None = None, out: str | None = None, top: int = 5,
              verbose: bool = False) -> str:  # fmt: skip
    """``plan --auto``: rank the recipe's layouts on ``cluster`` (``"nodes=..,gpus_per_node=
    .."``; default: the connected Ray cluster) with the device figures in ``figures``
    (default: this kind of cluster's calibration file, else nominal ones), after
    measuring them first with ``calibrate``; write the best to ``out``."""
    from ray_disagg.planner import cluster as cl
    from ray_disagg.planner.render import render_auto, write_recipe
    from ray_disagg.planner.search import plan_auto
    from ray_disagg.recipes.data_stats import recipe_stream_statistics
    from ray_disagg.recipes.recipe import load_recipe

    r = load_recipe(recipe, overrides)
    if cluster is None:
        _ensure_ray({})
        c = cl.cluster_from_ray()
    else:
        c = cl.parse_cluster(cluster)
    path = figures or cl.default_figures_path(c)
    if calibrate:
        from ray_disagg.planner.calibrate import calibrate as measure

        _ensure_ray({})
        f, _ = measure(r, c)
        print(f"calibration written to {cl.save_figures(f, path)}", flush=True)
    f = cl.load_figures(c, path)
    result = plan_auto(r, c, f, recipe_stream_statistics(r))
    text = render_auto(result, top=top, verbose=verbose)
    if out is not None:
        text += f"\nbest layout written to {write_recipe(result.ranked[0], out)}"
    return text


def _ensure_ray(groups) -> None:
    """``ray.init()`` unless Ray is up: ``RAY_ADDRESS`` (Ray Jobs) or a running local
    cluster is joined as is; a new local one gets the groups' CPUs if the machine has fewer
    (the fractional-CPU layouts of small machines)."""
    import ray

    from ray_disagg.launch.ray_compat import resources_per_worker

    if ray.is_initialized():
        return
    cpus = sum(
        g.scaling_config.num_workers * resources_per_worker(g.scaling_config).get("CPU", 0)
        for g in groups.values()
    )
    if os.environ.get("RAY_ADDRESS") or math.ceil(cpus) <= (os.cpu_count() or 1):
        ray.init()
    else:
        ray.init(num_cpus=math.ceil(cpus))


def _print_result(result) -> None:
    metrics = result.metrics or {}
    print("\nfinal metrics:")
    for key in sorted(metrics):
        value = metrics[key]
        if isinstance(value, bool | int | float | str):
            print(f"  {key}: {value:.6g}" if isinstance(value, float) else f"  {key}: {value}")
    checkpoint = result.checkpoint.path if result.checkpoint is not None else None
    print(f"checkpoint: {checkpoint}\nrun directory: {result.path}")


def train(recipe: str, overrides=()):
    """Build the recipe's ``DisaggregatedTrainer``, ``fit()`` it and return the Result."""
    from ray_disagg.config.run_warnings import RunWarning
    from ray_disagg.planner.render import render
    from ray_disagg.recipes.data import reads_ray_data
    from ray_disagg.recipes.recipe import RecipeError, load_recipe, trainer_kwargs
    from ray_disagg.recipes.words import recipe_message
    from ray_disagg.trainer import DisaggregatedTrainer

    r = load_recipe(recipe, overrides, for_training=True)
    print(render(r), flush=True)  # with the run's warnings
    if reads_ray_data(r.data):  # else the samples are checked before Ray starts
        _ensure_ray(r.groups)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RunWarning)
            trainer = DisaggregatedTrainer(**trainer_kwargs(r))
    except ValueError as e:  # what the trainer found in the samples, in the recipe's words
        raise RecipeError(recipe_message(r.name, e)) from None
    _ensure_ray(r.groups)
    result = trainer.fit()
    _print_result(result)
    return result


def export(source: str, out: str, *, adapter: bool = False, base: str | None = None) -> str:
    """``ray-disagg export``: :func:`ray_disagg.export_hf` of the checkpoint ``source`` or,
    for a run's directory, of its latest checkpoint; returns ``out``."""
    from ray.train import Checkpoint

    from ray_disagg.export import export_hf
    from ray_disagg.run_files import RunDir

    run = RunDir.of(source)
    path = run.path if run.read("config.json") is not None else run.latest_checkpoint()
    if path is None:
        raise ValueError(
            f"{source!r} is neither a checkpoint (no config.json) nor a run with a "
            "checkpoint (checkpoint_<N>/): give one of them."
        )
    checkpoint = Checkpoint(path=path, filesystem=run.fs)
    return export_hf(checkpoint, out, merge_lora=not adapter, base_path=base)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ray-disagg",
        description="Disaggregated training of multimodal models on Ray Train, from recipes.",
        epilog="Overrides are dotted keys with YAML values, e.g. train_loop_config.max_steps=4 "
        "groups.vision.trainable=false 'groups.text.parallelism={type: tensor, size: 2}'.",
    )
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="{train,plan,plot,export,recipes}"
    )
    for name, text in (
        ("train", "build the trainer from RECIPE and fit() it"),
        ("plan", "check RECIPE without starting Ray; print the layout and memory per worker"),
    ):
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("recipe", help="a recipe YAML file or a bundled recipe's name")
        p.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides")
        if name == "plan":
            _auto_arguments(p)
    p = sub.add_parser("plot", help="draw a run's loss, step times and traced steps",
                       description="draw a run's loss, step times and traced steps")  # fmt: skip
    p.add_argument("run_dir", help="the run's directory (<storage_path>/<name>): a local path "
                   "or a URI such as s3://bucket/runs/name")  # fmt: skip
    p.add_argument("--out", help="where to write the pictures (default: the run's directory "
                   "when it is local, else ./<name>)")  # fmt: skip
    text = "write a checkpoint's model (or LoRA adapter) in Hugging Face's layout"
    p = sub.add_parser("export", help=text, description=text)
    p.add_argument("source", help="a checkpoint, or a run's directory (its latest checkpoint): "
                   "a local path or a URI such as s3://bucket/runs/name")  # fmt: skip
    p.add_argument("out", help="the directory to write (save_pretrained's layout)")
    p.add_argument("--adapter", action="store_true", help="a LoRA run: the PEFT adapter "
                   "directory (AutoPeftModel loads it) instead of the merged model")  # fmt: skip
    p.add_argument("--base", help="a LoRA run: where its base model is, when not where the "
                   "run read it")  # fmt: skip
    sub.add_parser("recipes", help="list the bundled recipes")
    return parser


def _auto_arguments(p) -> None:
    p.add_argument("--auto", action="store_true",
                   help="rank the layouts of RECIPE's model by predicted step time")  # fmt: skip
    p.add_argument("--cluster", help="nodes=N,gpus_per_node=G,gpu_memory_gib=M,"
                   "cpus_per_node=C,host_memory_gib=H,interconnect=nvlink|pcie|loopback "
                   "(default: the connected Ray cluster)")  # fmt: skip
    p.add_argument("--calibrate", action="store_true",
                   help="measure the device figures on the connected cluster first")  # fmt: skip
    p.add_argument("--figures", help="the calibration file to read (and write)")
    p.add_argument("--out", help="write the best layout as a recipe to this file")
    p.add_argument("--top", type=int, default=5, help="how many layouts to print")
    p.add_argument("--verbose", action="store_true", help="list every dropped layout")


def main(argv: list[str] | None = None):
    """Run the command line ``argv`` (default ``sys.argv[1:]``).

    Called with ``argv`` it returns what the command produced (``train``: the
    ``ray.train.Result``; ``plan``: the printed text); without (the console script,
    ``python -m ray_disagg``) it returns the exit status 0. A recipe error (a
    ``ValueError``, a missing file, bad YAML) prints ``ray-disagg: error: ...`` on stderr
    and raises ``SystemExit(2)``; Ctrl-C, ``SystemExit(130)``."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "plot":
            from ray_disagg.plotting import plot_run

            out = plot_run(args.run_dir, args.out)
            print("\n".join(out))
        elif args.command == "export":
            out = export(args.source, args.out, adapter=args.adapter, base=args.base)
            print(out)
        elif args.command == "recipes":
            from ray_disagg.recipes.recipe import bundled_recipes

            out = "\n".join(f"{k}  {v}" for k, v in sorted(bundled_recipes().items()))
            print(out)
        elif args.command == "plan" and args.auto:
            out = auto_plan(args.recipe, args.overrides, cluster=args.cluster,
                            calibrate=args.calibrate, figures=args.figures, out=args.out,
                            top=args.top, verbose=args.verbose)  # fmt: skip
            print(out)
        elif args.command == "plan":
            out = plan(args.recipe, args.overrides)
            print(out)
        else:
            out = train(args.recipe, args.overrides)
    except (ValueError, OSError, ImportError) as e:
        print(f"ray-disagg: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:  # Ctrl-C: the run was aborted, nothing left behind
        print("ray-disagg: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    return out if argv is not None else 0


if __name__ == "__main__":
    raise SystemExit(main())
