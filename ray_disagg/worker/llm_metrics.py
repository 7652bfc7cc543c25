"""What the LLM group reports of a step besides the loss math: its stats slots, the
sample ids, a stream's read position."""

from __future__ import annotations

import torch.distributed as dist

from ray_disagg.worker import metrics

__all__ = ["data_position", "plain", "sample_ids", "step_stats"]


def plain(v):
    return v.item() if hasattr(v, "item") else v


def step_stats(w, run):
    stats = w.args.stats.new()
    if w.leader:
        ix = w.args.stats.index
        stats[ix["loss"]] = float(run.loss_sum)  # after the last gradients were posted
        stats[ix["label_tokens"]] = run.local_labels
        stats[ix["llm_tokens"]] = run.tokens
    return stats


def sample_ids(w, run) -> tuple[list, dict]:
    """The step's sample ids on this rank and, with ``report_sample_ids``, every
    replica's as the ``sample_ids`` metric (for audits)."""
    ids = [plain(it.get("id")) for it in run.ordered_items()]
    if not w.cfg.report_sample_ids:
        return ids, {}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, ids if w.leader else [], group=w.rt.object_group)
    return ids, {"sample_ids": [i for part in gathered for i in part]}


def data_position(w, source, step: int) -> dict:
    """A stream's metrics; at checkpoint steps its position goes to the checkpoint
    (collective over the group)."""
    if not hasattr(source, "state"):
        return {}
    if metrics.is_checkpoint_step(w.cfg, step):
        w.writer.data_state = source.state()
    return source.metrics()
