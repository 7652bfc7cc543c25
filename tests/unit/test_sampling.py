"""Tier 1: seeded sampling (``ray_disagg.rollout.sampling``) equals a sampler written here
from Hugging Face's own warpers (``TemperatureLogitsWarper``, ``TopKLogitsWarper``,
``TopPLogitsWarper``, in ``generate``'s order) plus the same per-completion Gumbel noise;
its draws follow ``softmax(scores)``; the noise of a vocabulary id does not depend on how
the vocabulary is split; completion keys are stable and distinct."""

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from ray_disagg.rollout.sampling import completion_keys, gumbel_noise, next_tokens


def hf_sample(logits, keys, positions, temperature, top_k, top_p):
    """The draw written independently: HF's warpers on the whole row, then Gumbel-max."""
    scores = TemperatureLogitsWarper(temperature)(None, logits.float())
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    noise = gumbel_noise(keys, positions, 0, logits.shape[-1])
    return torch.argmax(scores + noise, dim=-1)


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8), (0.9, 7, 0.6), (1.0, 1, 1.0)],
)
def test_draws_equal_hf_warpers_plus_the_same_noise(temperature, top_k, top_p):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=g) * 3
    logits[:8, 10:20] = 2.5  # ties inside the top-k and the nucleus
    keys = completion_keys(5, 2, list(range(16)), 4)
    positions = torch.arange(64) % 9
    got = next_tokens(logits, keys, positions, temperature=temperature, top_k=top_k, top_p=top_p)
    want = hf_sample(logits, keys, positions, temperature, top_k, top_p)
    assert torch.equal(got, want)


def test_greedy_takes_the_lowest_id_of_the_best():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0]])
    keys = completion_keys(0, 0, [0], 2)
    assert next_tokens(logits, keys, torch.zeros(2), greedy=True).tolist() == [1, 0]


def test_draws_follow_the_softmax_of_the_filtered_scores():
    n = 40_000
    logits = torch.tensor([[0.5, 1.0, 2.0, -1.0, 1.5]]).repeat(n, 1)
    keys = completion_keys(11, 0, list(range(n)), 1)
    cases = [((1.0, 0, 1.0), torch.softmax(logits[0], -1))]
    scores = logits[0] / 0.5
    top3 = torch.full_like(scores, float("-inf")).scatter(
        0, torch.tensor([1, 2, 4]), scores[[1, 2, 4]]
    )
    cases.append(((0.5, 3, 1.0), torch.softmax(top3, -1)))
    for (t, k, p), probs in cases:
        drawn = next_tokens(logits, keys, torch.zeros(n), temperature=t, top_k=k, top_p=p)
        freq = torch.bincount(drawn, minlength=5).float() / n
        assert torch.allclose(freq, probs, atol=0.01), (freq, probs)


def test_the_noise_does_not_depend_on_the_split_or_the_device_order():
    keys = completion_keys(1, 7, ["prompt-a", "prompt-b"], 3)
    positions = torch.tensor([0, 1, 2, 3, 4, 5])
    whole = gumbel_noise(keys, positions, 0, 96)
    for parts in (2, 3, 4):
        w = 96 // parts
        split = [gumbel_noise(keys, positions, r * w, (r + 1) * w) for r in range(parts)]
        assert torch.equal(torch.cat(split, 1), whole)
    assert torch.equal(gumbel_noise(keys[3:], positions[3:], 0, 96), whole[3:])  # row-wise
    assert whole.isfinite().all()


def test_completion_keys_are_stable_and_distinct():
    a = completion_keys(3, 10, [0, 1, "x"], 4)
    assert torch.equal(a, completion_keys(3, 10, [0, 1, "x"], 4))  # a resumed run's
    assert len(set(a.tolist())) == 12
    for other in (completion_keys(4, 10, [0, 1, "x"], 4), completion_keys(3, 11, [0, 1, "x"], 4)):
        assert not set(a.tolist()) & set(other.tolist())
    assert completion_keys(3, 10, ["x"], 4).tolist() == a[8:].tolist()  # per prompt
    assert completion_keys(0, 0, [7], 1).tolist() == [7925361777952063350]  # fixed forever


def test_every_family_generates_or_says_why():
    from ray_disagg import ADAPTERS
    from ray_disagg.models.generation import GenerationHooks

    for name, cls in ADAPTERS.items():
        if cls.generation_refusal is None:  # it writes both steps
            assert cls.prefill is not GenerationHooks.prefill, name
            assert cls.decode_step is not GenerationHooks.decode_step, name
        else:
            assert isinstance(cls.generation_refusal, str) and cls.generation_refusal, name
    assert ADAPTERS["qwen2_5_vl"].generation_refusal is None


def _splitmix(x: int) -> int:
    """splitmix64's finalizer on Python ints (modulo 2**64), written from its definition."""
    m = (1 << 64) - 1
    x = (x + 0x9E3779B97F4A7C15) & m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def test_the_noise_is_the_hash_written_in_plain_python():
    """Pinned against an independent computation, so that a change of the hash (which
    would change every seeded run's draws) cannot pass unnoticed."""
    import math

    keys = completion_keys(3, 1, [5, "p"], 2)
    noise = gumbel_noise(keys, torch.tensor([0, 4, 9, 2]), 7, 12)
    m = (1 << 64) - 1
    for i, key in enumerate(keys.tolist()):
        row = _splitmix((key & m) ^ _splitmix([0, 4, 9, 2][i]))
        for j, v in enumerate(range(7, 12)):
            h = _splitmix(row ^ ((v * 0x632BE59BD9B4E019) & m))
            u = ((h >> 12) + 0.5) * 2.0**-52
            assert noise[i, j].item() == pytest.approx(-math.log(-math.log(u)), rel=1e-6)
    assert torch.equal(completion_keys(3, 1, [np.int64(5), np.str_("p")], 2), keys)
