"""The LLM loss without full logits: logits only where the next token is a label, and
chunked under activation checkpointing (``loss_chunk_tokens``). Equal to the plain
cross-entropy over every position, loss and gradients (fp32, 1e-5), on one process and
vocab-parallel over a tp=2 gloo group; the saved activation bytes drop."""

import functools

import pytest
import torch
import torch.nn.functional as F

from ray_disagg import TrainLoopConfig
from ray_disagg.models.base import IGNORE_INDEX
from ray_disagg.models.loss import lm_loss
from ray_disagg.worker.memory import saved_activation_bytes
from tests.dist_utils import run_distributed

B, S, D, V = 2, 40, 16, 1024


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, S, D, generator=g)
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[torch.rand(B, S, generator=g) < 0.6] = IGNORE_INDEX  # e.g. image tokens
    head = torch.nn.Linear(D, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, D, generator=g) * 0.1)
    return hidden, labels, head


def _plain(hidden, labels, head, n):
    logits = head(hidden[:, :-1]).flatten(0, 1)
    return F.cross_entropy(logits, labels[:, 1:].flatten(), reduction="sum") / n


def _chunked(hidden, labels, head, n, chunk):
    return lm_loss(hidden, head, labels, n, chunk_tokens=chunk)


def _run(fn, hidden, labels, head):
    hidden = hidden.clone().requires_grad_()
    head.zero_grad()
    with saved_activation_bytes(head) as saved:
        loss = fn(hidden, labels, head)
    loss.backward()
    return loss.detach(), hidden.grad, head.weight.grad.clone(), saved[0]


def test_label_positions_and_chunks_give_the_plain_loss_and_gradients():
    hidden, labels, head = _inputs()
    n = float((labels[:, 1:] != IGNORE_INDEX).sum())
    ref = _run(lambda h, y, m: _plain(h, y, m, n), hidden, labels, head)
    for chunk in (None, 7, 1000):
        fn = functools.partial(_chunked, n=n, chunk=chunk)
        got = _run(fn, hidden, labels, head)
        for a, b in zip(got[:3], ref[:3]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    whole = _run(lambda h, y, m: lm_loss(h, m, y, n), hidden, labels, head)[3]
    chunked = _run(lambda h, y, m: lm_loss(h, m, y, n, chunk_tokens=7), hidden, labels, head)[3]
    # every position's logits (plain) > label positions' logits > one chunk's inputs
    assert ref[3] > 2 * whole and whole > 10 * chunked, (ref[3], whole, chunked)
    with pytest.raises(ValueError, match="loss_chunk_tokens"):
        TrainLoopConfig(max_steps=1, global_batch_size=1, loss_chunk_tokens=0)


def _vocab_parallel(rank, world):
    import torch.distributed as dist

    hidden, labels, head = _inputs(seed=3)
    n = float((labels[:, 1:] != IGNORE_INDEX).sum())
    ref = _run(lambda h, y, m: _plain(h, y, m, n), hidden, labels, head)
    shard = V // world
    local = torch.nn.Linear(D, shard, bias=False)
    with torch.no_grad():
        local.weight.copy_(head.weight[rank * shard : (rank + 1) * shard])

    def loss(h, y, m):
        return lm_loss(h, m, y, n, dist.group.WORLD, rank * shard, chunk_tokens=5)

    got = _run(loss, hidden, labels, local)
    dist.all_reduce(got[1])  # each rank's hidden gradient is its vocab slice's part
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-7)
    want = ref[2][rank * shard : (rank + 1) * shard]
    torch.testing.assert_close(got[2], want, rtol=1e-5, atol=1e-7)
    return True


def test_chunked_vocab_parallel_loss_equals_the_plain_one_over_tp2():
    assert run_distributed(_vocab_parallel, 2) == [True, True]
