"""Driver-side checks of ``datasets``: the training set, the validation set and its
plan, and one pass over map-style samples (validation, packing lengths, balancing costs);
Ray Data's progress bars while the driver reads them (:func:`progress_bars`)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import numpy as np

from ray_disagg.config.groups import ContextParallel
from ray_disagg.config.loop import TrainLoopConfig
from ray_disagg.data.mixture import Mixture
from ray_disagg.launch import mixtures
from ray_disagg.models.base import SampleError
from ray_disagg.models.packing import check_fits
from ray_disagg.pipeline.assignment import BatchPlan
from ray_disagg.pipeline.bins import over_budget
from ray_disagg.pipeline.budget import BudgetPlan, StreamBudgetPlan
from ray_disagg.worker.ingest import (
    is_ray_dataset,
    is_record_stream,
    is_stream,
    sample_from_row,
    sample_sequences,
)
from ray_disagg.worker.metrics import plain

logger = logging.getLogger("ray_disagg.trainer")


def batch_plan(data, adapter, cfg: TrainLoopConfig, groups, validated: bool) -> BatchPlan:
    """The plan of every training step's samples (map-style samples checked and costed
    here): fixed global batches, or under a token budget a
    :class:`~ray_disagg.pipeline.budget.BudgetPlan` (map-style) or
    :class:`~ray_disagg.pipeline.budget.StreamBudgetPlan` (a conversation stream)."""
    llm, cp_size = groups[adapter.llm_part], _cp_size(adapter, groups)
    common = dict(
        num_samples=num_samples(data, llm.dp_size),
        global_batch_size=cfg.global_batch_size,
        dp_sizes={name: g.dp_size for name, g in groups.items()},
        seed=cfg.seed,
        shuffle=cfg.shuffle,
        micro_batches=cfg.micro_batches,
        reader=adapter.llm_part,
        min_tokens=cp_size,
    )
    if isinstance(data, Mixture):  # its draws in order (they are random already)
        if cfg.objective is not None:
            raise ValueError(
                f"train_loop_config['objective']={type(cfg.objective).__name__} with a "
                "mixture: per-source metrics are token losses; train the pairs unmixed."
            )
        common.update(num_samples=mixtures.draws(cfg), shuffle=False)

        def each(source, name):
            with _naming(f"mixture source {name!r}"):
                return scan(source, adapter, cfg, validated, cp_size)

        costs, sizes = mixtures.scan_mixture(data, each, common["num_samples"])
    else:
        costs, sizes = scan(data, adapter, cfg, validated, cp_size)
    if sizes is not None:
        lengths = sizes.pop("lengths")
        plan = BudgetPlan(**common, **_budget(cfg), lengths=lengths, patches=sizes)
        if getattr(cfg.objective, "reference", None) == "precompute":
            # its pass must cover every pair: a ValueError here, before the workers start
            _ = dataclasses.replace(plan, shuffle=False, cover=True)
        return plan
    if cfg.max_tokens_per_microbatch is not None:  # a stream: each leader fills its own
        return StreamBudgetPlan(**common, **_budget(cfg), streamed_costs=True)
    streamed = cfg.assignment == "balanced" and is_stream(data)
    repeats = getattr(cfg.objective, "num_iterations", 1)
    return BatchPlan(**common, costs=costs, streamed_costs=streamed, repeats=repeats)


def _cp_size(adapter, groups) -> int:
    """The LLM group's context-parallel degree (tokens every sequence needs)."""
    p = groups[adapter.llm_part].parallelism
    return p.size if isinstance(p, ContextParallel) else 1


@contextlib.contextmanager
def _naming(where: str):
    """Errors raised inside name ``where`` first."""
    try:
        yield
    except ValueError as e:
        raise type(e)(f"{where}: {e}") from e


@contextlib.contextmanager
def progress_bars(datasets, shown: bool):
    """Ray Data's progress bars while the driver reads ``datasets`` (a Ray Dataset's
    count, a validation set): as they are when ``shown``
    (``DisaggregatedTrainer(verbose=True)``), else off in the current ``DataContext``
    (which a ``ConversationStream``'s conversions copy) and in each Ray Dataset's own,
    and restored after."""
    if shown:
        yield
        return
    from ray.data import DataContext

    contexts = [DataContext.get_current(), *(d.context for d in datasets if is_ray_dataset(d))]
    saved = [(c.enable_progress_bars, c.enable_operator_progress_bars) for c in contexts]
    for c in contexts:
        c.enable_progress_bars = c.enable_operator_progress_bars = False
    try:
        yield
    finally:
        for c, (bars, ops) in zip(contexts, saved):
            c.enable_progress_bars, c.enable_operator_progress_bars = bars, ops


def _budget(cfg: TrainLoopConfig) -> dict:
    return {
        "max_tokens": cfg.max_tokens_per_microbatch,
        "max_patches": cfg.max_patches_per_microbatch,
        "max_seq_len": cfg.max_seq_len if cfg.pack_sequences else None,
    }


def validation_set(datasets, adapter, cfg: TrainLoopConfig, groups, validate: bool = True):
    """The validation samples (map-style; a Ray Dataset is materialized) and their
    plan: global batches of ``global_batch_size`` in order, split like training (under a
    token budget one unshuffled epoch of budget steps)."""
    data = datasets.get("validation")
    if data is None:  # eval_every without one is refused by ray_disagg.config.layout.resolve
        return None, None
    if isinstance(data, Mixture):
        raise ValueError(
            "datasets['validation'] is a mixture: validation evaluates every sample once; "
            "pass each source as its own run's validation set, or one list of samples "
            "(the per-source training loss is in the metrics loss/<source>)."
        )
    if is_ray_dataset(data):
        data = [sample_from_row(r) for r in data.take_all()]
    elif is_record_stream(data):  # converted here, once
        data = list(data.samples())
    if not hasattr(data, "__len__") or not hasattr(data, "__getitem__"):
        raise ValueError(
            "datasets['validation'] must be a map-style dataset, a ray.data.Dataset or a "
            "ConversationStream, "
            f"got {type(data).__name__}."
        )
    dp_sizes = {name: g.dp_size for name, g in groups.items()}
    common = dict(num_samples=len(data), dp_sizes=dp_sizes, micro_batches=cfg.micro_batches,
                  reader=adapter.llm_part, global_batch_size=cfg.global_batch_size)  # fmt: skip
    contiguous = dataclasses.replace(cfg, assignment="contiguous")
    _, sizes = scan(data, adapter, contiguous, validate, _cp_size(adapter, groups))
    if sizes is not None:
        lengths = sizes.pop("lengths")
        plan = BudgetPlan(**common, **_budget(cfg), lengths=lengths, patches=sizes,
                          shuffle=False, what="validation")  # fmt: skip
        return data, plan
    _check_validation_size(len(data), cfg.global_batch_size)
    return data, BatchPlan(**common)


def _check_validation_size(n: int, b: int) -> None:
    if n < b:
        raise ValueError(
            f"datasets['validation'] has {n} samples, fewer than "
            f"global_batch_size={b}: validation runs in global batches of that size."
        )
    if n % b:
        logger.warning(
            "datasets['validation']: %d samples is not a multiple of global_batch_size=%d;"
            " the last %d are not used. Use a multiple to evaluate every sample.",
            n,
            b,
            n % b,
        )


def scan(data, adapter, cfg: TrainLoopConfig, validate: bool, min_tokens: int = 1):
    """One pass over a map-style dataset: validate every sample (``validate``: fields,
    the objective's pairs, each sequence's length when packing, at least ``min_tokens``
    tokens: the context-parallel degree); returns ``(costs, sizes)``: for balanced
    assignment its costs (LLM tokens of its sequences, each encoder part's estimate), and
    with ``max_tokens_per_microbatch`` its sizes (``"lengths"``: each sample's LLM sequence
    lengths, and each encoder part's patches), each checked against the budget (else
    ``None`` and ``None``)."""
    balanced = cfg.assignment == "balanced"
    budget = cfg.max_tokens_per_microbatch is not None
    if is_stream(data) or not (validate or balanced or budget):
        return None, None
    costs = {part: np.zeros(len(data), np.float32) for part in adapter.parts}
    sizes = None
    if budget:
        sizes = {"lengths": [], **{p: np.zeros(len(data), np.int64) for p in adapter.encoder_parts}}
    ids = {}  # id -> index, when the objective keeps values by record id
    keyed = getattr(cfg.objective, "reference", None) == "precompute"
    for i in range(len(data)):
        sample = data[i]
        seqs = sample_sequences(sample, i, adapter, cfg.objective, validate)
        if validate and keyed:
            _check_unique(sample, i, ids)
        if validate:
            if getattr(cfg.objective, "generates", False):
                _check_prompt(sample, i, cfg)
            for seq in seqs:
                _check_sequence(seq, i, cfg, min_tokens)
        lengths = tuple(len(s["input_ids"]) for s in seqs)
        costs[adapter.llm_part][i] = sum(lengths)
        if balanced:
            for part in adapter.encoder_parts:
                costs[part][i] = adapter.encoder_cost(part, sample)
        if budget:
            patches = {p: adapter.encoder_patches(p, sample) for p in adapter.encoder_parts}
            _check_budget(sample, i, lengths, patches, cfg)
            sizes["lengths"].append(lengths)
            for part, n in patches.items():
                sizes[part][i] = n
    return (costs if balanced else None), sizes


def _check_budget(sample: dict, i: int, lengths, patches: dict, cfg: TrainLoopConfig) -> None:
    why = over_budget(lengths, patches, **_budget(cfg))  # the plan's limits, as it has them
    if why:
        raise ValueError(
            f"sample {sample.get('id', i)!r} {why}: no microbatch holds it. Raise the limit, "
            "or drop, shorten or resize (its media) the sample."
        )


def _check_prompt(sample: dict, i: int, cfg: TrainLoopConfig) -> None:
    """A prompt GRPO completes: the reward functions' columns, and room for its longest
    completion in a packed row."""
    obj = cfg.objective
    obj.check_columns(sample, i)
    n, m = len(sample["input_ids"]), obj.max_completion_length
    if cfg.pack_sequences and n + m > cfg.max_seq_len:
        raise ValueError(
            f"sample {sample.get('id', i)!r}: its prompt's {n} tokens + GRPO's "
            f"max_completion_length={m} exceed train_loop_config['max_seq_len']="
            f"{cfg.max_seq_len}; raise max_seq_len to {n + m}, lower max_completion_length, "
            "or shorten the prompt."
        )


def _check_unique(sample: dict, i: int, ids: dict) -> None:
    key = plain(sample["id"])
    if key in ids:
        raise SampleError(
            f"samples {ids[key]} and {i} have the same id {key!r}: DPO(reference='precompute') "
            "keeps each pair's reference log-probs by its id; give every pair a unique 'id'."
        )
    ids[key] = i


def _check_sequence(seq: dict, i: int, cfg: TrainLoopConfig, min_tokens: int) -> None:
    if cfg.pack_sequences:
        check_fits(seq, i, cfg.max_seq_len)
    if len(seq["input_ids"]) < min_tokens:
        raise ValueError(
            f"sample {seq.get('id', i)!r} has {len(seq['input_ids'])} tokens, fewer "
            f"than the LLM group's ContextParallel(size={min_tokens}): every rank needs "
            "a token of each sequence; drop the sample or lower the size."
        )


def train_set(datasets):
    if not datasets or "train" not in datasets:
        raise ValueError('datasets={"train": ...} is required.')
    extra = sorted(set(datasets) - {"train", "validation"})
    if extra:
        raise ValueError(
            f"datasets keys must be 'train' and optionally 'validation', got extra keys {extra}."
        )
    data = datasets["train"]
    if is_stream(data):
        return data  # streamed by the LLM group; each row is validated when read
    if not hasattr(data, "__len__") or not hasattr(data, "__getitem__"):
        raise ValueError(
            "datasets['train'] must be a ray.data.Dataset or a map-style dataset (list of "
            f"sample dicts, datasets.Dataset, ...), got {type(data).__name__}."
        )
    if len(data) == 0:
        raise ValueError("datasets['train'] is empty.")
    return data


def num_samples(data, reader_dp: int) -> int:
    if is_record_stream(data):
        return data.num_records  # at most: records may be dropped
    if not is_ray_dataset(data):
        return len(data)
    n = data.count()
    if n == 0:
        raise ValueError("datasets['train'] is empty.")
    return n - n % reader_dp  # streaming_split(equal=True) drops the remainder
