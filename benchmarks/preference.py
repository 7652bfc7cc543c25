"""DPO against SFT on the same number of sequences, side by side, in one run.

CPU/gloo figures (the groups' workers without Ray, ``ray_disagg.testing.local``, one
thread each) on a Qwen2.5-VL with a 38M-parameter LLM (``--text-hidden 1024``): every
step trains ``2 P`` sequences, as SFT samples (each with its own copy of the prompt's
image) or as ``P`` DPO pairs (each image once per pair). For a frozen and a trained
vision tower it prints per mode:

- ``step s``: mean step time (steps after the first); per pair for DPO, per sequence for
  SFT, and their ratio (targets: <= 2.1 with ``reference="precompute"``, <= 2.8 online
  with ``"copy"``);
- ``vision s/item``: the vision group's compute seconds per pair (DPO) or per sample
  (SFT), and ``images/item`` (target with a frozen tower: DPO's per pair equal to SFT's
  per sample);
- ``text MB``: the text group's rank-0 peak resident set size; the ``copy`` reference's
  extra peak over ``precompute``'s next to the text part's parameter bytes (target: at
  most those bytes + 10%).

    python benchmarks/preference.py [--pairs 4] [--steps 6] [--grid 16] [--text-hidden 1024]

Results of one run: ``benchmarks/results/preference.txt``.
"""

import argparse
import os
import statistics
import tempfile

import torch
from ray.train import RunConfig, ScalingConfig

from ray_disagg import (
    DPO,
    DisaggregatedTrainer,
    HFModelSpec,
    ModuleGroup,
    load_metrics,
    tiny_qwen2_5_vl_config,
)
from ray_disagg.data.examples import synthetic_pairs
from ray_disagg.testing.local import fit_local


def group(trainable: bool = True) -> ModuleGroup:
    return ModuleGroup(
        scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": 1}),
        trainable=trainable,
    )


def sft_samples(pairs: list[dict]) -> list[dict]:
    """Each pair's two sequences as two SFT samples (each with the prompt's image)."""
    out = []
    for p in pairs:
        rest = {k: v for k, v in p.items() if not k.startswith(("chosen_", "rejected_"))}
        for a in ("chosen", "rejected"):
            out.append(
                {
                    **rest,
                    "id": len(out),
                    "input_ids": p[f"{a}_input_ids"],
                    "labels": p[f"{a}_labels"],
                }
            )
    return out


def run(spec, data, loop: dict, frozen: bool, storage: str, name: str) -> dict:
    trainer = DisaggregatedTrainer(
        model=spec,
        groups={"vision": group(not frozen), "text": group()},
        train_loop_config=loop,
        datasets={"train": data},
        run_config=RunConfig(name=name, storage_path=storage),
    )
    frame = load_metrics(fit_local(trainer)).iloc[1:]  # every step after the first
    return {
        "step": statistics.mean(frame["step_time_s"]),
        "vision": statistics.mean(frame["vision_compute_s"]),
        "images": statistics.mean(frame["images"]),
        "text_mb": float(frame["text_peak_memory_mb"].max()),
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--pairs", type=int, default=4, help="DPO pairs per step (SFT: 2x samples)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--grid", type=int, default=16, help="image side in patches")
    p.add_argument("--text-hidden", type=int, default=1024, help="the LLM's hidden size")
    args = p.parse_args()

    cfg = tiny_qwen2_5_vl_config(
        text_hidden=args.text_hidden,
        text_layers=4,
        text_heads=8,
        text_kv_heads=4,
        vision_hidden=64,
        vision_depth=4,
        fullatt_block_indexes=(1, 3),
    )
    spec = HFModelSpec(config=cfg, seed=0)
    pairs = synthetic_pairs(cfg, 2 * args.pairs, grids=[(1, args.grid, args.grid)])
    sft = sft_samples(pairs)
    text_params = sum(
        p.numel() for _, p in spec.adapter.part_parameters(spec.meta_model("text"), "text")
    )
    base = {"max_steps": args.steps, "shuffle": False, "checkpoint_every": None}
    modes = {
        "SFT": (sft, base | {"global_batch_size": 2 * args.pairs}),
        "DPO precompute": (
            pairs,
            base | {"global_batch_size": args.pairs, "objective": DPO(reference="precompute")},
        ),
        "DPO copy (online)": (
            pairs,
            base | {"global_batch_size": args.pairs, "objective": DPO(reference="copy")},
        ),
    }
    storage, rows = tempfile.mkdtemp(), {}
    for frozen in (True, False):
        for name, (data, loop) in modes.items():
            tag = f"{name}-{'frozen' if frozen else 'trained'}".replace(" ", "_")
            rows[(frozen, name)] = run(spec, data, loop, frozen, storage, tag.replace("(", ""))
    print_rows(rows, args, text_params)


def print_rows(rows: dict, args, text_params: int) -> None:
    n = 2 * args.pairs
    print(
        f"\n{n} sequences per step ({args.pairs} pairs), image {args.grid}x{args.grid} "
        f"patches, {args.steps} steps; text part {text_params / 1e6:.1f}M parameters\n"
    )
    head = f"{'tower':8s} {'mode':20s} {'step s':>7s} {'s/item':>7s} {'x SFT/seq':>9s}"
    print(f"{head} {'target':>7s} {'vision s/item':>13s} {'images/item':>11s} {'text MB':>8s}")
    for (frozen, name), r in rows.items():
        sft = rows[(frozen, "SFT")]
        items = n if name == "SFT" else args.pairs
        per, sft_per = r["step"] / items, sft["step"] / n
        target = {"SFT": "", "DPO precompute": "<= 2.1", "DPO copy (online)": "<= 2.8"}[name]
        print(
            f"{'frozen' if frozen else 'trained':8s} {name:20s} {r['step']:7.3f} {per:7.4f} "
            f"{per / sft_per:9.2f} {target:>7s} {r['vision'] / items:13.4f} "
            f"{r['images'] / items:11.2f} {r['text_mb']:8.0f}"
        )
    for frozen in (True, False):
        extra = rows[(frozen, "DPO copy (online)")]["text_mb"]
        extra -= rows[(frozen, "DPO precompute")]["text_mb"]
        budget = text_params * 4 / 2**20
        print(
            f"\n{'frozen' if frozen else 'trained'} tower: the copy reference's extra text peak "
            f"{extra:.0f} MB vs the text part's fp32 parameters {budget:.0f} MB (target <= "
            f"{1.1 * budget:.0f} MB)"
        )
    print("\n(peak memory: resident set size of rank 0 of each group; vision compute on CPU)")


if __name__ == "__main__":
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
