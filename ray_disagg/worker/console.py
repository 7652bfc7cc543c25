"""A worker's lines on stdout (Ray forwards them to the driver once)."""

from __future__ import annotations

import sys

__all__ = ["log_line", "log_step"]


def log_line(message: str) -> None:
    """One line on the worker's stdout, which Ray forwards to the driver once. (Ray
    Train's patched ``print`` in workers both tees to stdout and logs the message, so a
    ``print`` shows up twice.)"""
    sys.stdout.write(f"[ray_disagg] {message}\n")
    sys.stdout.flush()


def log_step(metrics: dict, max_steps: int) -> None:
    """One line per reported step, from the LLM group's rank 0 only."""
    val = f" val_loss {metrics['val_loss']:.4f}" if "val_loss" in metrics else ""
    log_line(
        f"step {metrics['step']}/{max_steps} loss {metrics['loss']:.4f}{val} "
        f"lr {metrics['lr']:.3g} grad_norm {metrics['grad_norm']:.3f} "
        f"step_time {metrics['step_time_s']:.3f}s tokens/s {metrics['tokens_per_s']:.0f}"
    )
