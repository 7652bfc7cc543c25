"""The DPO rows of ``benchmarks/memory.py --dpo``: the ~300M LLM (bf16 weights loaded into
fp32, AdamW) under text TP2 and under text FSDP2 over 2, vision 1, trained with
``DPO(reference="precompute")`` (no reference model held) and ``DPO(reference="copy")``
(a frozen copy of the trained parts with the same sharding) in the same run. Per layout,
the text group's rank 0: the peak RSS of the last step of each, the copy's extra peak,
and that rank's shard of the LLM's fp32 parameters (TP: every tensor but the norms
halved; FSDP2: every tensor halved), against the target extra <= those bytes + 10%.
"""

from __future__ import annotations

from ray.train import RunConfig

from ray_disagg import DPO, DataParallel, DisaggregatedTrainer, TensorParallel, load_metrics
from ray_disagg.data.examples import synthetic_pairs

MB = 2**20
LAYOUTS = {  # name: (text parallelism, tp, fsdp of one text shard)
    "text TP2": (TensorParallel(size=2), 2, 1),
    "text FSDP2 (2)": (DataParallel(fsdp=True), 1, 2),
}


def dpo_rows(spec, cfg, loop: dict, storage: str, group, fit, shard_params) -> None:
    """Train both references per layout and print the rows (see the module docstring)."""
    pairs = synthetic_pairs(cfg, 2 * loop["max_steps"], grids=[(1, 8, 8)])
    rows = []
    for name, (parallelism, tp, fsdp) in LAYOUTS.items():
        peaks = {}
        for reference in ("precompute", "copy"):
            result, _ = fit(
                DisaggregatedTrainer(
                    model=spec,
                    groups={"vision": group(1), "text": group(2, parallelism)},
                    train_loop_config={**loop, "objective": DPO(reference=reference)},
                    datasets={"train": pairs},
                    run_config=RunConfig(name=f"dpo-{reference}-{tp}{fsdp}", storage_path=storage),
                )
            )
            peaks[reference] = float(load_metrics(result)["text_peak_memory_mb"].iloc[-1])
        params = 4 * shard_params(spec, "text", tp, fsdp) / MB
        rows.append((name, peaks["precompute"], peaks["copy"], params))
    print("\nDPO reference (rank 0 of the text group; fp32 + AdamW; MB = 2^20 B)")
    print(f"{'layout':16s} {'precompute':>10s} {'copy':>7s} {'extra':>6s} {'params':>7s} "
          f"{'extra/params':>12s} {'target':>7s}")  # fmt: skip
    for name, pre, copy, params in rows:
        extra = copy - pre
        print(f"{name:16s} {pre:10.0f} {copy:7.0f} {extra:6.0f} {params:7.0f} "
              f"{extra / params:12.2f} {'<= 1.10':>7s}")  # fmt: skip
