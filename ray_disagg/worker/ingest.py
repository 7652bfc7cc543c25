"""Where the LLM group's data-parallel leaders read their samples (the one place a sample
is read; each encoder group gets its fields from them).

- map-style data (list, ``datasets.Dataset``): the leaders index the shared dataset with
  the deterministic ``BatchPlan`` (same batches as the reference);
- a Ray Data ``Dataset``: LLM rank 0 makes ``streaming_split(llm_dp, equal=True)``
  at the start of every run attempt and each leader streams its split; each epoch every
  row is used at most once (the rows that do not fill a last local batch are dropped);
- a :class:`~ray_disagg.data.stream.ConversationStream`: each leader converts its own
  records in a fixed order (:mod:`ray_disagg.worker.record_source`), resumable mid-epoch.
"""

from __future__ import annotations

import numpy as np
import ray
import torch.distributed as dist

from ray_disagg.models.base import SampleError, sample_name
from ray_disagg.pipeline.messages import SampleRef
from ray_disagg.worker.session import get_session


def is_ray_dataset(data) -> bool:
    return isinstance(data, ray.data.Dataset)


def is_record_stream(data) -> bool:
    """Whether ``data`` is a :class:`~ray_disagg.data.stream.ConversationStream`."""
    from ray_disagg.data.stream import ConversationStream

    return isinstance(data, ConversationStream)


def is_stream(data) -> bool:
    """Whether ``data`` is read while training runs (no length or costs up front)."""
    return is_ray_dataset(data) or is_record_stream(data)


class MapStyleSource:
    """A map-style dataset (``split``: ``"train"`` or ``"validation"``) read by the
    ``BatchPlan``; every group holds it, so encoders read their own fields
    (:meth:`refs`, :meth:`Datasets.resolve`)."""

    def __init__(self, dataset, plan, group: str, split: str = "train"):
        self.dataset, self.plan, self.group, self.split = dataset, plan, group, split

    def take(self, step: int, positions: list[int]) -> list[tuple[int, dict]]:
        indices = self.plan.global_indices(step)
        return [(indices[p], self.dataset[indices[p]]) for p in positions]

    def refs(self, step: int, positions: list[int]) -> dict[int, SampleRef]:
        """A :class:`SampleRef` per batch position: what the LLM sends the encoders."""
        indices = self.plan.global_indices(step)
        return {p: SampleRef(int(indices[p]), self.split) for p in positions}


def mixture_epochs(source, step: int) -> dict[str, int]:
    """A mixture's ``epoch/<source>`` metrics after ``step`` (a leader's map-style source
    of a :class:`~ray_disagg.data.mixture.Mixture`; else none)."""
    from ray_disagg.data.mixture import Mixture

    if not isinstance(source, MapStyleSource) or not isinstance(source.dataset, Mixture):
        return {}
    drawn = max(source.plan.global_indices(step)) + 1
    return {f"epoch/{n}": e for n, e in source.dataset.epochs(drawn).items()}


class Datasets:
    """The datasets an encoder worker resolves :class:`SampleRef` s against, fetched from
    the object store when built (before the first step: a failure or a long transfer then
    happens outside the step's collectives)."""

    def __init__(self, refs: dict[str, list | None]):
        self.data = {split: get_session().fetch(r[0]) for split, r in refs.items() if r}

    def resolve(self, sample, keys: tuple[str, ...]) -> dict:
        """``sample`` itself, or the ``keys`` of the sample a :class:`SampleRef` names
        (views of the dataset's arrays: nothing is copied here)."""
        if not isinstance(sample, SampleRef):
            return sample
        row = self.data[sample.split][sample.index]
        return {k: row[k] for k in keys if k in row}


class StreamSource:
    def __init__(self, split, per_step: int):
        self.split, self.per_step, self._rows, self._seen = split, per_step, None, 0

    def take(self, step: int, positions: list[int]) -> list[tuple[int, dict]]:
        # the replica's contiguous share (streams are never balanced), in order
        assert len(positions) == self.per_step, (len(positions), self.per_step)
        out = []
        while len(out) < self.per_step:
            if self._rows is None:
                self._rows = iter(self.split.iter_rows())
            try:
                row = next(self._rows)
            except StopIteration:  # epoch over: drop the partial local batch, start again
                self._rows, out = None, []
                continue
            out.append((self._seen, sample_from_row(row)))
            self._seen += 1
        return out


def sample_from_row(row) -> dict:
    """A sample dict of a Ray Data row (lists back to numpy arrays)."""
    return {k: (np.asarray(v) if isinstance(v, list) else v) for k, v in dict(row).items()}


def make_source(
    data,
    plan,
    dp_rank: int,
    is_leader: bool,
    group: str,
    object_group=None,
    state: dict | None = None,
):
    """Collective over the reading group when ``data`` is a Ray Dataset (the splits go
    to every rank over ``object_group``, a gloo group). A conversation stream's source is
    on every rank (its reads agree over ``object_group``), positioned at ``state``."""
    if is_record_stream(data):
        from ray_disagg.worker.record_source import RecordSource

        return RecordSource(data, plan, group, dp_rank, is_leader, object_group, state)
    if not is_ray_dataset(data):
        return MapStyleSource(data, plan, group) if is_leader else None
    dp = plan.dp_sizes[group]
    box = [None]
    if dist.get_rank() == 0:
        _progress_bars_as_here(data)
        box = [data.streaming_split(dp, equal=True)]
    dist.broadcast_object_list(box, src=0, group=object_group)
    per_step = plan.global_batch_size // dp
    return StreamSource(box[0][dp_rank], per_step) if is_leader else None


def _progress_bars_as_here(data) -> None:
    """Ray Data's progress bars off for ``data`` (this worker's copy of it: its split's
    coordinator runs with its context) when they are off in this process
    (``DisaggregatedTrainer(verbose=False)``: ``ray_compat.quiet_data_progress``)."""
    here, ctx = ray.data.DataContext.get_current(), data.context
    ctx.enable_progress_bars = ctx.enable_progress_bars and here.enable_progress_bars
    ops = ctx.enable_operator_progress_bars and here.enable_operator_progress_bars
    ctx.enable_operator_progress_bars = ops


def read_samples(source, step, positions, args) -> list[dict]:
    """This step's samples at batch ``positions`` (a replica's share), validated unless
    the driver already validated the whole (map-style) dataset before the run."""
    if source is None:  # not a leader of map-style or Ray Data reading
        return []
    samples = []
    for index, sample in source.take(step, positions):
        if not args.samples_validated:
            sample_sequences(sample, index, args.adapter, args.cfg.objective)
        samples.append(sample)
    return samples


def sample_sequences(sample: dict, index, adapter, objective, validate: bool = True):
    """The sample's LLM sequences (one without an objective; a pair's two with DPO);
    ``validate``: the sample checked by the objective and each sequence against the
    model (:class:`~ray_disagg.models.base.SampleError` naming the sample)."""
    if objective is None:
        if validate and "input_ids" not in sample and "chosen_input_ids" in sample:
            raise SampleError(
                f"{sample_name(sample, index)} is a preference pair (chosen/rejected); train "
                "pairs with train_loop_config['objective']=ray_disagg.DPO(...)."
            )
        seqs = [sample]
    else:
        if validate:
            objective.check_sample(sample, index)
        seqs = objective.sequences(sample)
    if validate:
        for seq in seqs:
            adapter.validate_sample(seq, index)
    return seqs
