"""The LoRA rows of ``benchmarks/memory.py --lora``: the ~300M LLM with text TP2 trained in
full and with LoRA r=16 on every linear of the LLM (``peft.LoraConfig``; the vision tower
trained in full in both), fp32 parameters and AdamW, in the same run. Per row, the text
group's rank 0:

- ``state``: what ``ray-disagg plan`` counts for the worker's parameters + gradients +
  AdamW state (``planner.memory.estimate``), next to the bound ``base parameter bytes +
  16 B per LoRA parameter`` (LoRA) or ``16 B per parameter`` (full);
- ``peak - base``: the measured peak RSS of the last step over the runtime's baseline,
  and its ratio to the plan's whole estimate for the worker (target <= 1.3);
- the step time (mean of the steps after the first) and the text checkpoint's size.

The ratios LoRA / full (peak over baseline, step time, checkpoint size) are printed, not
gated.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import statistics

from peft import LoraConfig
from ray.train import RunConfig

from ray_disagg import DisaggregatedTrainer, TensorParallel, load_metrics
from ray_disagg.lora.layers import is_factor
from ray_disagg.planner.memory import estimate, part_model
from ray_disagg.recipes.recipe import load_recipe

LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = {"r": 16, "alpha": 32, "target_modules": LINEARS}
MB = 2**20


def _recipe(spec, loop: dict, lora: bool, tokens: int):
    text = {"num_workers": 2, "parallelism": {"type": "tensor", "size": 2}}
    if lora:
        text["lora"] = LORA
    return load_recipe({
        "model": {"pretrained_path": spec.pretrained_path},
        "data": {"train": {"type": "digits", "num_samples": 8, "image_size": 32}},
        "groups": {"vision": {"num_workers": 1}, "text": text},
        "train_loop_config": loop,
        "plan": {"image_size": [32, 32], "images_per_sample": 1, "seq_len": tokens},
    })  # fmt: skip


def _bound(r, tp: int = 2) -> float:
    """Base parameter bytes + 16 B per LoRA parameter (full: 16 B per parameter) of one
    text worker: the factors counted here (TP splits a column-parallel module's ``lora_B``
    and a row-parallel one's ``lora_A``), the base as the plan counts it."""
    local = estimate(r)["text"]
    factors = 0.0
    for name, p in part_model(r, "text").named_parameters():
        if is_factor(name):
            rowwise = ".o_proj." in name or ".down_proj." in name
            split = (".lora_A." in name) == rowwise
            factors += p.numel() / (tp if split else 1)
    if not factors:
        return 16 * local.num_params
    return 4 * (local.num_params - factors) + 16 * factors


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def lora_rows(spec, data, loop: dict, storage: str, base_mb: float, group, fit) -> None:
    """Train both rows and print them (see the module docstring)."""
    tokens = len(data[0]["input_ids"])
    rows = {}
    for name, lora in (
        ("full", None),
        ("LoRA r=16", LoraConfig(r=16, lora_alpha=32, target_modules=LINEARS)),
    ):
        text = dataclasses.replace(group(2, TensorParallel(size=2)), peft_config=lora)
        result, _ = fit(
            DisaggregatedTrainer(
                model=spec,
                groups={"vision": group(1), "text": text},
                train_loop_config=loop,
                datasets={"train": data},
                run_config=RunConfig(name=f"lora-{name[:4]}", storage_path=storage),
            )
        )
        m = load_metrics(result)
        step = statistics.mean(m["step_time_s"].tolist()[1:])
        ckpt = _dir_bytes(os.path.join(result.checkpoint.path, "text"))
        shutil.rmtree(result.path, ignore_errors=True)
        r = _recipe(spec, {**loop, "checkpoint_every": None}, lora is not None, tokens)
        plan = estimate(r)["text"]
        state = plan.params + plan.grads + plan.optimizer
        peak = float(m["text_peak_memory_mb"].iloc[-1]) - base_mb
        rows[name] = (state, _bound(r), plan.total, peak, step, ckpt)
    print("\nLoRA (text TP2, rank 0 of the text group; fp32 + AdamW; MB = 2^20 B)")
    print(f"{'row':10s} {'state(plan)':>11s} {'bound':>8s} {'plan':>8s} {'peak-base':>9s} "
          f"{'ratio':>6s} {'step s':>7s} {'ckpt MB':>8s}")  # fmt: skip
    for name, (state, bound, plan, peak, step, ckpt) in rows.items():
        print(f"{name:10s} {state / MB:11.0f} {bound / MB:8.0f} {plan / MB:8.0f} {peak:9.0f} "
              f"{peak * MB / plan:6.2f} {step:7.3f} {ckpt / MB:8.1f}")  # fmt: skip
    full, lora_row = rows["full"], rows["LoRA r=16"]
    print(
        f"LoRA / full: peak over baseline {lora_row[3] / full[3]:.2f}x, step time "
        f"{lora_row[4] / full[4]:.2f}x, checkpoint {lora_row[5] / full[5]:.3f}x; state <= bound: "
        f"{lora_row[0] <= lora_row[1] * 1.0001}; peak-base <= 1.3 x plan: "
        f"{lora_row[3] * MB <= 1.3 * lora_row[2]}"
    )
