"""Shared helpers of the end-to-end tests: run a layout, run the reference, compare."""

from __future__ import annotations

import os

import torch
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig

from ray_disagg import DisaggregatedTrainer, ModuleGroup, TrainLoopConfig, load_metrics
from ray_disagg.testing.local import fit_local
from ray_disagg.testing.reference import reference_train
from ray_disagg.worker.shards import read_full


def group(n: int, parallelism="none", cpus: float = 0.5, ac: bool = False) -> ModuleGroup:
    return ModuleGroup(
        scaling_config=ScalingConfig(num_workers=n, resources_per_worker={"CPU": cpus}),
        parallelism=parallelism,
        activation_checkpointing=ac,
    )


def built_trainer(spec, data, loop: dict, groups, storage, **kwargs):
    """The trainer of this run, not fitted: its ``plan`` and ``val_plan`` (under a token
    budget their steps depend on the layout) for the reference to train on the same
    steps; ``kwargs`` as :func:`run_layout`'s."""
    return run_layout(spec, data, loop, groups, storage, "plan", build_only=True, **kwargs)


def run_layout(
    spec,
    data,
    loop: dict,
    groups,
    storage,
    name,
    *,
    failures: int = 0,
    resume=None,
    validation=None,
    callbacks=(),
    checkpoint_config=None,
    local: bool = False,
    build_only: bool = False,
    storage_filesystem=None,
    **kwargs,
):
    """Fit one layout (``groups``: name -> ModuleGroup), keeping every checkpoint (their
    metrics are the per-step history) unless ``checkpoint_config`` says otherwise;
    ``kwargs`` go to the trainer (placement, ...). ``local``: the same workers without
    Ray (``ray_disagg.testing.local``), for numerics Ray adds nothing to;
    ``build_only``: return the trainer unfitted; ``storage_filesystem``: ``storage`` is a
    path on it (e.g. the S3 test server's)."""
    datasets = {"train": data} if validation is None else {"train": data, "validation": validation}
    trainer = DisaggregatedTrainer(
        model=spec,
        groups=groups,
        train_loop_config=loop,
        datasets=datasets,
        run_config=RunConfig(
            name=name,
            storage_path=str(storage),
            storage_filesystem=storage_filesystem,
            failure_config=FailureConfig(max_failures=failures),
            checkpoint_config=checkpoint_config or CheckpointConfig(num_to_keep=None),
            callbacks=list(callbacks),
        ),
        resume_from_checkpoint=resume,
        **kwargs,
    )
    if build_only:
        return trainer
    return fit_local(trainer) if local else trainer.fit()


RESTART_LOOP = {"max_steps": 4, "global_batch_size": 4, "checkpoint_every": 1, "eps": 1e-6,
                "seed": 5}  # fmt: skip
"""The restart tests' loop: a checkpoint every step."""


PIPELINE_LOOP = {
    "max_steps": 3,
    "global_batch_size": 8,
    "micro_batches": 4,
    "checkpoint_every": 1,
    "lr": 1e-3,
    "eps": 1e-6,
    "seed": 3,
}
"""The 1F1B tests' loop: k = 4 microbatches of a global batch of 8."""

PIPELINE_GRIDS = [(1, 4, 4), (1, 8, 8), None, (1, 4, 8), (1, 8, 4), (1, 12, 8), (1, 4, 4)]
"""The 1F1B tests' images: varied sizes, one text-only sample."""


def restart_setup():
    """The restart tests' model and data: ``(config, spec, 12 samples)``."""
    from ray_disagg import HFModelSpec, tiny_qwen2_5_vl_config
    from ray_disagg.data.examples import synthetic_samples

    cfg = tiny_qwen2_5_vl_config()
    grids = [(1, 4, 4), (1, 8, 4), None, (1, 4, 8)]
    return cfg, HFModelSpec(config=cfg, seed=4), synthetic_samples(cfg, 12, grids=grids)


NONFINITE_LOOP = {"max_steps": 3, "global_batch_size": 4, "shuffle": False, "eps": 1e-6}
"""The non-finite tests' loop: the data of :func:`nonfinite_setup` in file order."""


def nonfinite_setup():
    """The non-finite tests' model and data: ``(spec, 12 samples)``; step 2 holds a NaN
    pixel (sample ``"nan-pixel"``), step 3 no label token at all."""
    import numpy as np

    from ray_disagg import HFModelSpec, tiny_qwen2_5_vl_config
    from ray_disagg.data.examples import synthetic_samples

    cfg = tiny_qwen2_5_vl_config()
    data = synthetic_samples(cfg, 12, grids=[(1, 4, 4), (1, 8, 4), None])
    data[4] = dict(data[4], id="nan-pixel", pixel_values=data[4]["pixel_values"].copy())
    data[4]["pixel_values"][0, 0] = np.nan  # step 2
    for i in range(8, 12):  # step 3: no label token at all
        data[i] = dict(data[i], labels=np.full_like(data[i]["labels"], -100))
    return HFModelSpec(config=cfg, seed=1), data


def every_cpu_free(timeout_s: float) -> float:
    """The Ray cluster's CPUs once every one is free again (workers and actors release
    theirs asynchronously), waiting up to ``timeout_s``; fails naming how many are still
    held."""
    import time

    import ray

    total, deadline = ray.cluster_resources()["CPU"], time.monotonic() + timeout_s
    while ray.available_resources().get("CPU", 0) < total and time.monotonic() < deadline:
        time.sleep(0.2)
    free = ray.available_resources().get("CPU", 0)
    assert free == total, f"{total - free:g} of {total:g} CPUs still held after {timeout_s:g}s"
    return total


def losses(result) -> list[float]:
    """The loss of every reported step (``metrics.jsonl``: with or without a checkpoint;
    after a restart, each step's last attempt)."""
    return load_metrics(result)["loss"].tolist()


def checkpoint_state(checkpoint) -> dict[str, torch.Tensor]:
    """The full model (HF names) assembled from every group's DCP shards."""
    state = {}
    for module in sorted(os.listdir(checkpoint.path)):
        if os.path.isfile(os.path.join(checkpoint.path, module, ".metadata")):
            state.update(read_full(os.path.join(checkpoint.path, module))[0])
    return state


def assert_bit_identical(result, clean) -> None:
    """``result`` (a run with a restart) equals ``clean`` (the uninterrupted run) bit for
    bit on CPU: every step's loss and every parameter of the last checkpoint."""
    assert losses(result) == losses(clean)
    got, ref = checkpoint_state(result.checkpoint), checkpoint_state(clean.checkpoint)
    assert all(torch.equal(got[k], ref[k]) for k in ref)


SMALL_RMS = 0.01
"""Below this RMS a tensor's own norm is no scale for its relative error (half a linear
layer's initial standard deviation of 0.02; every element is still within ``rtol``)."""


def assert_params_close(state: dict, ref_state: dict, rtol: float = 1e-5) -> None:
    """All parameters together within ``rtol`` relative (Frobenius) error of the reference,
    every element within ``rtol`` absolute, and each tensor within ``10 * rtol`` relative.

    (Element- or tensor-wise relative error is not meaningful for tensors whose gradient is
    ~0, such as attention key biases: AdamW turns fp32 noise in such a gradient into steps
    of up to +-lr, and a zero-initialised bias is made of nothing but those steps.)
    A tensor whose RMS is below ``SMALL_RMS`` (a zero-initialised norm weight or bias, made
    of nothing but those steps: Gemma 3's ``1 + weight`` norms, SigLIP's biases) is held
    to ``10 * rtol`` of that RMS instead of its own norm (its rounding depends on the
    CPU's kernels: AVX2 and AVX-512 differ by ~1e-4 of such a tensor's norm).
    A separate attention key bias (``k_proj.bias``, e.g. SigLIP's) has a gradient that is
    exactly zero but for rounding, since softmax ignores it: it is only checked to have
    moved by at most 0.01 (a few AdamW steps of at most ``lr``) from the reference."""
    assert set(state) == set(ref_state)
    diff_sq = ref_sq = 0.0
    for key, ref in ref_state.items():
        got = state[key].to(ref.dtype)
        if key.endswith("k_proj.bias"):
            assert float((got - ref).abs().max()) <= 0.01, key
            continue
        d, r = float((got - ref).double().pow(2).sum()), float(ref.double().pow(2).sum())
        diff_sq, ref_sq = diff_sq + d, ref_sq + r
        err = (d / max(r, SMALL_RMS**2 * ref.numel(), 1e-24)) ** 0.5
        assert err <= 10 * rtol, f"{key}: relative error {err:.2e} > {10 * rtol:.0e}"
        torch.testing.assert_close(got, ref, rtol=0.0, atol=rtol, msg=lambda m, k=key: f"{k}: {m}")
    total = (diff_sq / ref_sq) ** 0.5
    assert total <= rtol, f"relative error of all parameters {total:.2e} > {rtol:.0e}"


def assert_matches_reference(result, spec, data, loop: dict, rtol=1e-5, plan=None):
    """Losses of every step and parameters after the last step equal the single-process
    HF run on the same global batches (``plan``: the trainer's, see :func:`built_trainer`)."""
    cfg = TrainLoopConfig(**loop)
    ref_losses, _, ref_model = reference_train(spec, data, cfg, plan=plan)
    got = losses(result)
    torch.testing.assert_close(
        torch.tensor(got, dtype=torch.float64),
        torch.tensor(ref_losses, dtype=torch.float64),
        rtol=rtol,
        atol=0.0,
    )
    assert_params_close(checkpoint_state(result.checkpoint), ref_model.state_dict(), rtol)
    return got


def vt(vision, text) -> dict:
    """The two groups of a vision-language model."""
    return {"vision": vision, "text": text}
