"""Conversation preprocessing, side by side in one run: samples/s of the eager loader (the
old way: every record converted in the driver before step 1), of a stream converted in one
process, and of a stream on 1 and N Ray Data CPU actors (once running, and including the
actors' start); and the driver's peak memory for
1k and 10k records, eager vs stream (a stream's driver only indexes the files). An eager
size that would take over half the machine's free memory is estimated, not run.

Data made here: JPEG images (``--image-size`` px, kept whole: ``max_pixels`` is set to
their size) and LLaVA records cycling over them, through a tokenizer trained here with
Qwen2-VL's chat template and the family's PIL image processor.

    python benchmarks/data.py [--records 400] [--actors 2] [--image-size 128]

Each memory figure is measured in a fresh process: its peak RSS (``VmHWM``, reset just
before loading) over its RSS then (interpreter, imports and processors excluded).
"""

import argparse
import json
import logging
import os
import pickle
import subprocess
import sys
import tempfile
import time

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # keep Ray on 127.0.0.1

import numpy as np  # noqa: E402

QA = [("which digit is this?", "seven."), ("and now?", "two.")]


def write_data(root: str, sizes: list[int], image_size: int, n_images: int = 32) -> None:
    from PIL import Image

    from ray_disagg.testing.conversations import build_model_dir

    rng = np.random.default_rng(0)
    os.makedirs(f"{root}/media", exist_ok=True)
    for i in range(n_images):
        pixels = (rng.random((image_size, image_size, 3)) * 255).astype(np.uint8)
        Image.fromarray(pixels).save(f"{root}/media/{i}.jpg")
    build_model_dir(f"{root}/model", max_pixels=image_size * image_size)
    for n in sizes:
        with open(f"{root}/train_{n}.jsonl", "w") as f:
            for i in range(n):
                q, a = QA[i % 2]
                conv = [{"from": "human", "value": f"<image>\n{q}"}, {"from": "gpt", "value": a}]
                record = {"id": f"r{i}", "image": f"{i % n_images}.jpg", "conversations": conv}
                f.write(json.dumps(record) + "\n")


def processor(root: str):
    from transformers import AutoImageProcessor, AutoTokenizer

    from ray_disagg import tiny_qwen2_5_vl_config
    from ray_disagg.data.conversations import ConversationProcessor

    model = f"{root}/model"
    return ConversationProcessor(
        tokenizer=AutoTokenizer.from_pretrained(model, local_files_only=True),
        image_processor=AutoImageProcessor.from_pretrained(model, local_files_only=True),
        config=tiny_qwen2_5_vl_config(),
        media_root=f"{root}/media",
    )


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(field + ":"))
    return int(line.split()[1]) / 1024


def _available_mb() -> float:
    with open("/proc/meminfo") as f:
        line = next(x for x in f if x.startswith("MemAvailable:"))
    return int(line.split()[1]) / 1024


def _reset_peak() -> None:
    """Linux: the peak RSS (VmHWM) starts again from the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _tolist(v):
    return v.tolist() if hasattr(v, "tolist") else v


def child(mode: str, n: int, root: str) -> dict:
    """In a fresh process: load ``n`` records the ``mode`` way, report time and peak."""
    import datasets  # imports are not data: loaded before the baseline
    import pyarrow.fs  # noqa: F401
    import pyarrow.parquet  # noqa: F401

    from ray_disagg.data.conversations import read_records
    from ray_disagg.data.stream import ConversationStream

    convert = processor(root)
    _reset_peak()
    base = _status_mb("VmRSS")
    t0 = time.perf_counter()
    path = f"{root}/train_{n}.jsonl"
    if mode == "eager":  # every record converted at once into a datasets.Dataset
        samples = [convert(r) for r in read_records(path)]
        keys = sorted({k for s in samples for k in s})
        columns = {k: [_tolist(s.get(k)) for s in samples] for k in keys}
        data = datasets.Dataset.from_dict(columns)
        held = len(data)
    else:  # what the trainer's driver does with a stream: index it, put it in the store
        stream = ConversationStream(paths=path, processor=convert)
        held = len(pickle.dumps(stream))
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "peak_mb": _status_mb("VmHWM") - base, "held": held}


def _run_child(mode: str, n: int, root: str) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", mode, str(n), root],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def throughput(root: str, n: int, actors: list[int]) -> dict[str, float]:
    """samples/s converting the first ``n`` records: in this process, on Ray actors."""
    import ray
    import ray.data

    from ray_disagg.data.stream import ConversationStream

    stream = ConversationStream(paths=f"{root}/train_{n}.jsonl", processor=processor(root))
    out = {}
    t0 = time.perf_counter()
    got = sum(o["status"] == "ok" for o in stream.outcomes(range(n)))
    out["stream, in process"] = got / (time.perf_counter() - t0)
    ray.init(num_cpus=max(actors), include_dashboard=False, log_to_driver=False)
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    ray.data.DataContext.get_current().enable_progress_bars = False
    try:
        for k in actors:
            stream.concurrency = k
            t0 = time.perf_counter()
            first, got = None, 0
            for o in stream._ray_outcomes(np.arange(n)):
                first = first or time.perf_counter()
                got += o["status"] == "ok"
            end = time.perf_counter()
            name = f"stream, {k} Ray Data actor(s)"
            out[name] = (got - 1) / (end - first)
            out[name + " incl. start"] = got / (end - t0)
    finally:
        ray.shutdown()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, default=400, help="records timed for samples/s")
    p.add_argument("--actors", type=int, default=2, help="N of the N-actor column")
    p.add_argument("--image-size", type=int, default=128)
    p.add_argument("--sizes", default="1000,10000", help="record counts for driver memory")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a.child[0], int(a.child[1]), a.child[2])))
        return
    sizes = [int(s) for s in a.sizes.split(",")]
    with tempfile.TemporaryDirectory() as root:
        write_data(root, sorted({a.records, *sizes}), a.image_size)
        eager = _run_child("eager", a.records, root)
        rates = {"eager loader (driver)": a.records / eager["seconds"]}
        rates.update(throughput(root, a.records, sorted({1, a.actors})))
        print(f"\npreprocessing, {a.records} records of one {a.image_size} px image each:")
        for name, rate in rates.items():
            print(f"  {name:<44} {rate:8.1f} samples/s")
        print("\ndriver peak memory over its start (MiB):")
        print(f"  {'records':>8} {'eager loader':>14} {'stream':>10}")
        per_record = None  # the eager loader's MiB per record, from the smaller sizes
        for n in sizes:
            if per_record is not None and per_record * n > 0.5 * _available_mb():
                eager = f"~{per_record * n:.0f} (est.)"  # not run: over this machine's memory
            else:
                peak = _run_child("eager", n, root)["peak_mb"]
                per_record, eager = peak / n, f"{peak:.1f}"
            stream = _run_child("stream", n, root)["peak_mb"]
            print(f"  {n:>8} {eager:>14} {stream:>10.1f}")


if __name__ == "__main__":
    main()
