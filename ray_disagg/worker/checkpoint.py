"""The checkpoint lifecycle of a worker: which steps save (:func:`is_checkpoint_step`),
saving and reporting one (:func:`maybe_save`: written now, or staged and written in the
background and reported at a later step, :func:`flush`), forgetting one a group restart
leaves behind (:func:`drop`), a stream's read position saved with it
(:func:`record_data_position`), and restoring the latest (:func:`restore`). The files'
format: :mod:`ray_disagg.worker.shards`."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile

from ray_disagg.lora.files import check_resume
from ray_disagg.worker.session import get_session
from ray_disagg.worker.shards import (
    DATA_STATE,
    REFERENCE_LOGPS,
    ShardWriter,
    check_compatible,
    load_model,
    load_optimizer,
    load_sharded,
    read_full,
    trained_steps,
)

__all__ = [
    "drop",
    "flush",
    "is_checkpoint_step",
    "maybe_save",
    "record_data_position",
    "restore",
    "writing",
]


def is_checkpoint_step(cfg, step: int) -> bool:
    last = step == cfg.max_steps - 1
    return last or (cfg.checkpoint_every is not None and (step + 1) % cfg.checkpoint_every == 0)


def _report(
    metrics: dict, step: int, *, writer: ShardWriter, model=None, optimizer=None, background=None
):
    """The session's report (``ray.train.report``) on every rank; with a ``model`` (a
    checkpoint step) every rank writes its shard and uploads it into the shared directory
    ``checkpoint_<step>``. With ``background`` (``async_checkpoint``) the step's metrics
    are reported now, the shard is written in the background and reported by
    :func:`flush`, with the same metrics, at a later step (the driver's feed takes that
    second report of the step for the checkpoint only: ``launch.step_feed``)."""
    if model is None:
        get_session().report(metrics)
        return
    name = f"checkpoint_{step + 1:06d}"
    if background is not None:
        tmp = tempfile.mkdtemp(prefix="ray_disagg_ckpt_")
        future = writer.write(tmp, step, model, optimizer, background)
        writer.hold(future, tmp, name, metrics)
        get_session().report(metrics)
        return
    with tempfile.TemporaryDirectory() as tmp:
        writer.write(tmp, step, model, optimizer)
        get_session().report(metrics, tmp, name)


def maybe_save(
    args, step: int, metrics: dict, writer: ShardWriter, model, optimizer, background=None
):
    """Report ``metrics`` of a reported step; at a checkpoint step every rank first writes
    its part of ``checkpoint_<step>`` (joining the collectives that gather tensor-parallel
    and ZeRO-1 state) and reports it with them, in the background with
    ``async_checkpoint`` (``background``: the checkpoint's gloo group) but at the last
    step."""
    if not is_checkpoint_step(args.cfg, step):
        _report(metrics, step, writer=writer)
        return
    last = step + 1 == args.cfg.max_steps
    background = background if args.cfg.async_checkpoint and not last else None
    _report(metrics, step, writer=writer, model=model, optimizer=optimizer, background=background)


def writing(writer: ShardWriter) -> int:
    """1 while this rank's asynchronous checkpoint is still being written (its stats slot
    ``checkpoint_writing``)."""
    return int(writer.pending is not None and not writer.pending[0].done())


def flush(writer: ShardWriter, ready: bool = True) -> None:
    """Report the asynchronous checkpoint once its files are written (its upload runs in
    the background; Ray Train registers it when every worker of every group reported it):
    at the first step every rank's write was done (``ready``, from the exchanged stats, so
    every rank of every group decides alike), else waiting for it at the next checkpoint
    step or the last step."""
    if writer.pending is None or not ready:
        return
    future, tmp, name, metrics = writer.take_pending()
    future.result()
    get_session().report(metrics, tmp, name, async_upload=True)


def drop(writer: ShardWriter) -> None:
    """Forget an asynchronous checkpoint that will not be reported (a group restarted)."""
    pending = writer.take_pending()
    if pending is None:
        return
    future, tmp, _, _ = pending
    writer.drop_staging()
    with contextlib.suppress(Exception):  # its peers may have gone: nothing of it is kept
        future.result()  # (after its staging copy: the state may be reloaded next)
    shutil.rmtree(tmp, ignore_errors=True)


def record_data_position(cfg, writer: ShardWriter, source, step: int) -> dict:
    """A stream's metrics; at checkpoint steps its position goes to the checkpoint
    (collective over the group)."""
    if not hasattr(source, "state"):
        return {}
    if is_checkpoint_step(cfg, step):
        writer.keep_data_state(source.state())
    return source.metrics()


def _schedule_note(module_dir: str, cfg) -> str | None:
    """A message when the checkpoint was trained under another lr schedule."""
    with open(os.path.join(module_dir, "trainer_state.json")) as f:
        saved = json.load(f).get("lr_schedule")
    if not saved:
        return None
    now = {k: getattr(cfg, k) for k in saved}
    if now == saved:
        return None
    diff = ", ".join(f"{k}: {saved[k]!r} -> {now[k]!r}" for k in saved if saved[k] != now[k])
    return (
        f"resuming under a different learning-rate schedule ({diff}); from here the lr "
        "follows this run's settings (ray_disagg.lr_at), so it may jump."
    )


def _json_file(module_dir: str, name: str):
    """A JSON file of a module directory (the data position of a stream, the
    precomputed reference log-probs), ``None`` when it was not written."""
    path = os.path.join(module_dir, name)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def restore(
    model, optimizer, module: str, args, log=None, ckpt=None, writer: ShardWriter | None = None
) -> tuple[int, dict | None]:
    """Load ``ckpt``, else the latest checkpoint of this run (Ray Train hands it to
    restarted workers) or ``resume_from_checkpoint``, into the built model and optimizer
    (also in place, mid-run: a survivor of a group restart); returns the step to start
    from and the data position saved with it (``None``: none, or not written by a
    stream). ``log`` gets a note when the checkpoint's lr schedule differs from this run's.
    ``writer``: the part's ``ShardWriter``, whose ``names`` / ``lora`` say what a LoRA
    part's checkpoint holds (its adapter; the base stays as loaded)."""
    if ckpt is None:
        ckpt = get_session().restart_checkpoint() or args.resume_from_checkpoint
    if ckpt is None:
        return 0, None
    names = None if writer is None else writer.names
    lora = None if writer is None else writer.lora
    with ckpt.as_directory() as root:
        check_compatible(root, args.spec.load_config(), args.cfg.max_steps)
        module_dir = os.path.join(root, module)
        check_resume(module_dir, module, *(lora or (None, {})))
        if not load_sharded(model, optimizer, module_dir, names):
            model_state, optimizer_state = read_full(module_dir)
            load_model(model, model_state, names)
            load_optimizer(optimizer, model, optimizer_state)
        note = _schedule_note(module_dir, args.cfg)
        if note and log is not None:
            log(f"{module}: {note}")
        reference = _json_file(module_dir, REFERENCE_LOGPS)
        if writer is not None and reference is not None:  # kept, and saved again
            writer.keep_reference_logps(reference)
        return trained_steps(module_dir), _json_file(module_dir, DATA_STATE)
