"""Weighted mixtures of map-style datasets: ``datasets={"train": ray_disagg.mix({...},
weights={...})}``.

Draw ``k`` of a mixture picks a source at random with the sources' weights (blocks of
:data:`BLOCK` draws, each seeded by ``(seed, block)``, so any draw is found without the
ones before it) and takes that source's next sample: source ``s``'s ``j``-th draw is
sample ``j mod n_s`` of a permutation of the source seeded by ``(seed, s, j div n_s)``.
So each source is read without repeats through its own epochs (``j div n_s``): a small
source that runs out starts its next epoch, reshuffled, while the others go on; its
weight, not its size, sets its share of every step. The training plan takes draws
``0, 1, 2, ...`` in order (a step's draws are as random as the weights make them), so a
run's position is its step: a resumed run continues with the next draw, and refuses a
changed mixture (:meth:`Mixture.fingerprint`). Every sample carries its source's name
under :data:`SOURCE_KEY`, from which the ``loss/<source>`` and ``label_tokens/<source>``
metrics are summed.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping

import numpy as np

__all__ = ["BLOCK", "SOURCE_KEY", "Mixture", "mix"]

BLOCK = 4096
"""Draws per seeded block."""
SOURCE_KEY = "source"
"""The sample field naming its source in a mixture."""


class Mixture:
    """A weighted mixture of map-style datasets (see the module docstring); use
    :func:`mix`.

    Example:
        >>> m = mix({"a": [{"x": 1}] * 3, "b": [{"x": 2}] * 5}, weights={"a": 0.7, "b": 0.3})
        >>> m.names, round(m.probs["a"], 2), m[0][SOURCE_KEY] in m.names
        (('a', 'b'), 0.7, True)
    """

    def __init__(self, sources: Mapping, weights: Mapping | None = None, seed: int = 0):
        if not isinstance(sources, Mapping) or not sources:
            raise ValueError(
                "ray_disagg.mix(sources, ...): sources must be a non-empty dict of name -> "
                "map-style dataset, e.g. mix({'captions': a, 'docs': b})."
            )
        if not all(isinstance(k, str) and k for k in sources):
            raise ValueError(f"ray_disagg.mix: name the sources with strings, got {list(sources)}.")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"ray_disagg.mix(seed={seed!r}): must be an int >= 0.")
        self.sources = {k: _check_source(k, v) for k, v in sources.items()}
        self.names = tuple(self.sources)
        self.probs = _probabilities(self.names, weights)
        self.seed = seed
        self._p = np.array([self.probs[n] for n in self.names])
        self._sizes = np.array([len(self.sources[n]) for n in self.names], np.int64)
        self._prefix = [np.zeros(len(self.names), np.int64)]  # counts before each block

    def __len__(self) -> int:
        """The samples of all sources: a pass over the mixture (the draws never end)."""
        return int(self._sizes.sum())

    def __getitem__(self, k: int) -> dict:
        s, i = self.locate(np.asarray([k]))
        name = self.names[int(s[0])]
        sample = dict(self.sources[name][int(i[0])])
        sample[SOURCE_KEY] = name
        return sample

    def fingerprint(self) -> dict:
        """What a resumed run must find unchanged for its draws to continue: the sources
        (their order and sizes; not their contents), the weights and the seed."""
        sizes = [[n, int(v)] for n, v in zip(self.names, self._sizes)]
        return {"sources": sizes, "weights": dict(self.probs), "seed": self.seed}

    @functools.lru_cache(maxsize=8)  # noqa: B019 - one mixture per run
    def _block(self, b: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, b])
        return rng.choice(len(self.names), size=BLOCK, p=self._p).astype(np.int64)

    def _counts_before(self, b: int) -> np.ndarray:
        """Draws of each source in blocks ``0 .. b-1``."""
        while len(self._prefix) <= b:
            blk = self._block(len(self._prefix) - 1)
            counts = np.bincount(blk, minlength=len(self.names))
            self._prefix.append(self._prefix[-1] + counts)
        return self._prefix[b]

    def draws_of(self, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per draw ``k``: its source (index into :attr:`names`) and that source's draw
        number ``j`` (its ``j``-th draw)."""
        k = np.asarray(k, np.int64)
        src, nth = np.empty_like(k), np.empty_like(k)
        for b in np.unique(k // BLOCK):
            at = k // BLOCK == b
            blk, off = self._block(int(b)), k[at] % BLOCK
            src[at] = blk[off]
            before = self._counts_before(int(b))
            for s in range(len(self.names)):  # earlier draws of the same source in the block
                mine = np.cumsum(blk == s) - (blk == s)
                sel = src[at] == s
                nth[np.flatnonzero(at)[sel]] = before[s] + mine[off[sel]]
        return src, nth

    def locate(self, k) -> tuple[np.ndarray, np.ndarray]:
        """Per draw ``k``: its source (index into :attr:`names`) and sample index in it."""
        src, nth = self.draws_of(k)
        index = np.empty_like(nth)
        for s, n in enumerate(self._sizes):
            sel = src == s
            epochs, pos = np.divmod(nth[sel], n)
            index[sel] = [self._order(s, int(e))[int(p)] for e, p in zip(epochs, pos)]
        return src, index

    @functools.lru_cache(maxsize=16)  # noqa: B019
    def _order(self, s: int, epoch: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, 1 + s, epoch])
        return rng.permutation(int(self._sizes[s])).astype(
            np.int32 if self._sizes[s] < 2**31 else np.int64
        )

    def epochs(self, draws: int) -> dict[str, int]:
        """Each source's epoch (from 0) after the first ``draws`` draws."""
        if draws <= 0:
            return dict.fromkeys(self.names, 0)
        b, off = divmod(draws, BLOCK)
        counts = self._counts_before(b) + np.bincount(
            self._block(b)[:off], minlength=len(self.names)
        )
        return {n: int(c // size) for n, c, size in zip(self.names, counts, self._sizes)}


def _check_source(name: str, data):
    from ray_disagg.data.stream import ConversationStream

    streamed = isinstance(data, ConversationStream) or type(data).__module__.startswith("ray.")
    if streamed or not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
        raise ValueError(
            f"ray_disagg.mix: source {name!r} is a {type(data).__name__}; a mixture takes "
            "map-style datasets (a list of samples, a datasets.Dataset; a stream: "
            "list(stream.samples()))."
        )
    if len(data) == 0:
        raise ValueError(f"ray_disagg.mix: source {name!r} is empty; drop it from the mixture.")
    if SOURCE_KEY in data[0]:
        raise ValueError(
            f"ray_disagg.mix: the samples of source {name!r} have a {SOURCE_KEY!r} field, "
            "which a mixture sets to each sample's source name; rename the field."
        )
    return data


def _probabilities(names: tuple[str, ...], weights) -> dict[str, float]:
    """The normalized weights (equal without ``weights``); ``ValueError`` naming the fix."""
    if weights is None:
        return dict.fromkeys(names, 1.0 / len(names))
    if not isinstance(weights, Mapping) or set(weights) != set(names):
        got = sorted(weights) if isinstance(weights, Mapping) else weights
        raise ValueError(
            f"ray_disagg.mix(weights={got!r}): give one weight per source, keyed by the "
            f"sources' names {list(names)}."
        )
    for n in names:
        w = weights[n]
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
            raise ValueError(f"ray_disagg.mix: weight of {n!r} is {w!r}; must be a number > 0.")
        if w <= 0:
            raise ValueError(
                f"ray_disagg.mix: weight of {n!r} is {w!r}; must be > 0 (drop a source to "
                "leave it out)."
            )
    total = float(sum(weights[n] for n in names))
    return {n: float(weights[n]) / total for n in names}


def mix(sources: Mapping, weights: Mapping | None = None, *, seed: int = 0) -> Mixture:
    """A weighted mixture of map-style datasets for ``datasets={"train": ...}``: each
    sample comes from a source chosen with probability ``weights[name] / sum(weights)``
    (equal without ``weights``), deterministic for ``seed``; the metrics gain
    ``loss/<name>``, ``label_tokens/<name>`` and ``epoch/<name>`` per step.

    Example:
        >>> train = mix({"captions": [{"x": 0}] * 10, "docs": [{"x": 1}] * 4},
        ...             weights={"captions": 0.7, "docs": 0.3})
        >>> train.fingerprint()["sources"]
        [['captions', 10], ['docs', 4]]
    """
    return Mixture(sources, weights, seed=seed)
