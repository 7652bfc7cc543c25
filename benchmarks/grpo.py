"""GRPO's rollouts on the training groups, side by side, in one run.

CPU/gloo figures (the groups' workers without Ray, ``ray_disagg.testing.local``, one
thread each) on a Qwen2.5-VL with a 38M-parameter LLM (``--text-hidden 1024``): every
step completes ``P`` prompts (one image each) ``G`` times. For a frozen and a trained
vision tower it prints:

- ``rollout s`` / ``reward s`` / ``train s``: mean seconds per step of the rollout pass
  (the prompts' media encoded, the completions drawn), the reward functions and the
  update (steps after the first);
- ``tok/s``: completion tokens drawn per rollout second;
- ``encodes/prompt``: the vision group's images encoded per step over the step's prompts
  (targets: 1 with a frozen tower, 2 with a trained one; encoding each completion's
  image would be ``G``);
- ``text MB``: the text group's rank-0 peak resident set size, and the same update on
  completions as long replayed (``GRPO(rollouts="recorded")``): whether the rollout
  raises the step's peak over the update's, next to its KV cache's bytes (the rollout
  uses the trained model itself, no copy: a step's peak is the larger of the rollout's
  and the update's; the resident set's noise is tens of MB).

    python benchmarks/grpo.py [--prompts 4] [--generations 8] [--new-tokens 48] [--steps 4]

Results of one run: ``benchmarks/results/grpo.txt``.
"""

import argparse
import dataclasses
import os
import statistics
import tempfile

import torch
from ray.train import RunConfig, ScalingConfig

from ray_disagg import (
    GRPO,
    DisaggregatedTrainer,
    HFModelSpec,
    ModuleGroup,
    load_metrics,
    tiny_qwen2_5_vl_config,
)
from ray_disagg.data.examples import save_word_tokenizer, synthetic_prompts
from ray_disagg.testing.local import fit_local


def length(prompts, completions, completion_ids, **kwargs):
    """A reward of the completion's length (cheap: the figures are the rollout's)."""
    return [float(len(c)) for c in completion_ids]


def group(trainable: bool = True) -> ModuleGroup:
    return ModuleGroup(
        scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": 1}),
        trainable=trainable,
    )


def fit(spec, data, loop: dict, frozen: bool, storage: str, name: str):
    trainer = DisaggregatedTrainer(
        model=spec,
        groups={"vision": group(not frozen), "text": group()},
        train_loop_config=loop,
        datasets={"train": data},
        run_config=RunConfig(name=name, storage_path=storage),
    )
    return fit_local(trainer)


def recorded(prompts: list[dict], result) -> list[dict]:
    """The prompts with recorded completions as long as the longest the generating run
    drew (the same update, without a rollout: its memory)."""
    n = int(load_metrics(result)["completions/max_length"].max())
    out = []
    for p in prompts:
        ids = [torch.full((n,), 7, dtype=torch.long).numpy() for _ in range(ARGS.generations)]
        out.append({**p, "prompt_input_ids": p["input_ids"], "completion_ids": ids,
                    "rewards": {"length": [float(n)] * len(ids)},
                    "truncated": [True] * len(ids)})  # fmt: skip
    return out


def figures(result, prompts: int) -> dict:
    frame = load_metrics(result).iloc[1:]  # every step after the first
    drawn = frame["completions/mean_length"] * prompts * ARGS.generations
    return {
        "rollout": statistics.mean(frame["rollout_s"]),
        "reward": statistics.mean(frame["reward_s"]),
        "train": statistics.mean(frame["train_s"]),
        "tok_s": statistics.mean(drawn / frame["rollout_s"]),
        "encodes": statistics.mean(frame["images"]) / prompts,
        "text_mb": float(load_metrics(result)["text_peak_memory_mb"].max()),
        "length": float(frame["completions/max_length"].max()),
    }


def kv_bytes(cfg, rows: int, tokens: int) -> float:
    """The KV cache of ``rows`` rows of ``tokens`` tokens (fp32) of the text model."""
    t = cfg.text_config
    head = t.hidden_size // t.num_attention_heads
    return rows * tokens * t.num_hidden_layers * 2 * t.num_key_value_heads * head * 4


def main():
    cfg = tiny_qwen2_5_vl_config(
        text_hidden=ARGS.text_hidden, text_layers=4, text_heads=8, text_kv_heads=4,
        vision_hidden=64, vision_depth=4, fullatt_block_indexes=(1, 3),
    )  # fmt: skip
    spec = HFModelSpec(config=cfg, seed=0)
    grid = (1, ARGS.grid, ARGS.grid)
    prompts = synthetic_prompts(cfg, ARGS.prompts, grids=[grid])
    storage = tempfile.mkdtemp()
    objective = GRPO(reward_funcs=[length], num_generations=ARGS.generations,
                     max_completion_length=ARGS.new_tokens, beta=0.0,
                     tokenizer=save_word_tokenizer(os.path.join(storage, "tok")))  # fmt: skip
    loop = {"max_steps": ARGS.steps, "global_batch_size": ARGS.prompts, "shuffle": False,
            "checkpoint_every": None, "lr": 1e-4, "objective": objective}  # fmt: skip
    rows = {}
    for frozen in (True, False):
        tag = "frozen" if frozen else "trained"
        generated = fit(spec, prompts, loop, frozen, storage, f"generate-{tag}")
        rows[tag] = figures(generated, ARGS.prompts)
        replay = {**loop, "objective": dataclasses.replace(objective, rollouts="recorded")}
        again = fit(spec, recorded(prompts, generated), replay, frozen, storage, f"replay-{tag}")
        rows[tag]["replay_mb"] = float(load_metrics(again)["text_peak_memory_mb"].max())
    prompt_tokens = max(len(p["input_ids"]) for p in prompts)
    text = spec.adapter.part_parameters(spec.meta_model("text"), "text")
    print_rows(rows, cfg, prompt_tokens, 4 * sum(p.numel() for _, p in text) / 2**20)


def print_rows(rows: dict, cfg, prompt_tokens: int, params_mb: float) -> None:
    g, p = ARGS.generations, ARGS.prompts
    print(
        f"\n{p} prompts x {g} completions per step (up to {ARGS.new_tokens} tokens), image "
        f"{ARGS.grid}x{ARGS.grid} patches, {ARGS.steps} steps\n"
    )
    head = f"{'tower':8s} {'rollout s':>9s} {'reward s':>8s} {'train s':>7s} {'tok/s':>7s}"
    print(f"{head} {'encodes/prompt':>14s} {'target':>6s} {'per-completion':>14s}")
    for tag, r in rows.items():
        target = "1" if tag == "frozen" else "2"
        print(
            f"{tag:8s} {r['rollout']:9.3f} {r['reward']:8.4f} {r['train']:7.3f} "
            f"{r['tok_s']:7.0f} {r['encodes']:14.2f} {target:>6s} {g:14d}"
        )
    for tag, r in rows.items():
        cache = kv_bytes(cfg, p * g, prompt_tokens + int(r["length"])) / 2**20
        extra = r["text_mb"] - r["replay_mb"]
        print(
            f"\n{tag} tower: text peak {r['text_mb']:.0f} MB generating, {r['replay_mb']:.0f} MB "
            f"replaying completions as long: the rollout adds {extra:.0f} MB to the step's "
            f"peak; its KV cache {cache:.0f} MB (a copy of the text part: {params_mb:.0f} MB)"
        )
    print("\n(peak memory: resident set size of rank 0 of the text group; CPU, fp32)")


if __name__ == "__main__":
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=48, help="max_completion_length")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--grid", type=int, default=16, help="image side in patches")
    parser.add_argument("--text-hidden", type=int, default=1024, help="the LLM's hidden size")
    ARGS = parser.parse_args()
    main()
