"""Align a tiny Qwen2.5-VL with DPO on preference pairs in TRL's format, on Ray Train.

CPU only, no download. A local model directory stands in for a real one (a word-level
tokenizer trained here with Qwen2-VL's chat template and the family's image processor,
as ``Qwen/Qwen2.5-VL-7B-Instruct``'s would be used); the images are scikit-learn's
handwritten sevens and twos saved as PNG files; each record asks which digit an image
shows, ``chosen`` names it and ``rejected`` names the other. The records are streamed
through the chat template and the image processor while training runs
(``PreferenceProcessor`` in a ``ConversationStream``); the vision tower and the LLM train
in their own Ray Train worker groups against a frozen copy of the initial model.

    python examples/dpo_tiny_vlm.py [--steps 30] [--pairs 64] [--reference copy]

It prints TRL's metrics every few steps and fails unless the mean reward margin of the
last quarter of the steps is above the first quarter's.
"""

import argparse
import json
import os
import tempfile

os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # Ray on 127.0.0.1


def write_records(root: str, n: int) -> str:
    """``n`` TRL preference records over sevens and twos from scikit-learn; returns the
    JSON Lines file (images under ``root/images``)."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    os.makedirs(os.path.join(root, "images"), exist_ok=True)
    words = {7: "seven.", 2: "two."}
    picks = [i for i, y in enumerate(digits.target) if y in words][:n]
    lines = []
    for k, i in enumerate(picks):
        pixels = (digits.images[i] / 16 * 255).astype(np.uint8)
        path = f"images/{k}.png"
        Image.fromarray(pixels).resize((32, 32)).convert("RGB").save(os.path.join(root, path))
        right = words[int(digits.target[i])]
        wrong = words[9 - int(digits.target[i])]  # 7 <-> 2
        prompt = [{"type": "image"}, {"type": "text", "text": "which digit is this?"}]
        lines.append({
            "id": k,
            "prompt": [{"role": "user", "content": prompt}],
            "chosen": [{"role": "assistant", "content": right}],
            "rejected": [{"role": "assistant", "content": wrong}],
            "images": [path],
        })  # fmt: skip
    out = os.path.join(root, "pairs.jsonl")
    with open(out, "w") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--pairs", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--reference", default="auto", choices=["auto", "copy"])
    p.add_argument("--skip-check", action="store_true", help="do not fail on the margin")
    args = p.parse_args()

    import ray
    from ray.train import RunConfig, ScalingConfig
    from transformers import AutoImageProcessor, AutoTokenizer

    from ray_disagg import (
        DPO,
        DisaggregatedTrainer,
        HFModelSpec,
        ModuleGroup,
        load_metrics,
        tiny_qwen2_5_vl_config,
    )
    from ray_disagg.data.conversations import ConversationProcessor
    from ray_disagg.data.preference import PreferenceProcessor
    from ray_disagg.data.stream import ConversationStream
    from ray_disagg.data.tiny_model import save_tiny_model

    root = tempfile.mkdtemp(prefix="dpo_tiny_vlm_")
    cfg = tiny_qwen2_5_vl_config()
    # a complete local model directory: the tokenizer (chat template) and image processor
    model_dir = save_tiny_model(os.path.join(root, "model"), cfg, examples=0, validation=0)
    records = write_records(root, args.pairs)
    processor = PreferenceProcessor(
        ConversationProcessor(
            tokenizer=AutoTokenizer.from_pretrained(model_dir, local_files_only=True),
            image_processor=AutoImageProcessor.from_pretrained(model_dir, local_files_only=True),
            config=cfg,
            media_root=root,
        )
    )
    ray.init(num_cpus=3, _node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False)

    def group():
        return ModuleGroup(scaling_config=ScalingConfig(num_workers=1))

    trainer = DisaggregatedTrainer(
        model=HFModelSpec(config=cfg, seed=0),
        groups={"vision": group(), "text": group()},
        train_loop_config={
            "max_steps": args.steps,
            "global_batch_size": args.batch_size,  # pairs
            "lr": args.lr,
            "objective": DPO(beta=0.1, reference=args.reference),
        },
        datasets={"train": ConversationStream(paths=records, processor=processor)},
        run_config=RunConfig(name="dpo", storage_path=os.path.join(root, "runs")),
    )
    result = trainer.fit()
    frame = load_metrics(result)  # every reported step
    names = ["loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins"]
    print(frame[["step", *names]].iloc[:: max(1, len(frame) // 6)].to_string(index=False))
    margins, k = frame["rewards/margins"], max(1, len(frame) // 4)
    first, last = margins.iloc[:k].mean(), margins.iloc[-k:].mean()
    print(f"mean reward margin: first {k} steps {first:.4f} -> last {k} steps {last:.4f}")
    if not last > first and not args.skip_check:
        raise SystemExit("the reward margin did not grow")


if __name__ == "__main__":
    main()
