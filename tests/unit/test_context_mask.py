"""Tier 1: attention over whole rows with the mask built per query chunk
(``ray_disagg.parallel.context_mask``) equals one SDPA call with the dense mask, for
packed samples, bidirectional blocks and a sliding window together, in chunks of a few
rows recomputed in the backward (outputs and gradients, fp32, 1e-6); causal rows take no
mask."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from ray_disagg.parallel.context_mask import SequenceMask, chunk_rows, chunked_attention


def _dense(segments, blocks, window):
    s = segments.shape[1]
    q, k = torch.arange(s)[:, None], torch.arange(s)[None, :]
    same_block = (blocks[:, :, None] == blocks[:, None, :]) & (blocks[:, :, None] >= 0)
    allow = (k <= q)[None] | same_block  # HF: AND(window, OR(causal, block))
    if window is not None:
        allow = allow & (k > q - window)[None]
    return (allow & (segments[:, :, None] == segments[:, None, :]))[:, None]


@pytest.mark.parametrize("window", [None, 3])
def test_chunked_attention_equals_the_dense_mask(window):
    g = torch.Generator().manual_seed(0)
    b, h, kv, s, d = 2, 4, 2, 13, 8
    q = torch.randn(b, h, s, d, generator=g, requires_grad=True)
    k, v = (torch.randn(b, kv, s, d, generator=g, requires_grad=True) for _ in range(2))
    segments = torch.tensor([[0] * 6 + [1] * 7, [0] * 13])  # two packed samples in row 0
    blocks = torch.full((b, s), -1)
    blocks[0, 2:5], blocks[0, 8:12], blocks[1, 4:8] = 0, 1, 0  # image blocks, <= 4 long
    mask = SequenceMask(segments, blocks, lookahead=3, window=window)
    heads = SimpleNamespace(num_key_value_groups=h // kv, is_causal=True)
    elements = 2 * 2 * s  # chunks of 2 rows, recomputed in the backward
    assert chunk_rows(mask, b, s, elements) == 2  # with the window: 2 x (2 + 3 + 3) <= 26
    assert chunk_rows(mask, 1, 4096, 1 << 20) == (256 if window is None else 1021)
    got = chunked_attention(heads, q, k, v, mask, scaling=0.3, elements=elements)
    dense = _dense(segments, blocks, window)
    ref = F.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), dense, scale=0.3
    ).transpose(1, 2)
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)
    w = torch.randn(ref.shape, generator=g)
    grads = torch.autograd.grad((got * w).sum(), (q, k, v))
    for a, r in zip(grads, torch.autograd.grad((ref * w).sum(), (q, k, v))):
        torch.testing.assert_close(a, r, atol=1e-6, rtol=1e-6)
    assert mask.key_range(8, 10, s) == ((6 if window else 0), 13)  # window .. block reach

    causal = SequenceMask()
    assert causal.causal and not mask.causal
    plain = chunked_attention(heads, q, k, v, causal, scaling=0.3)
    ref = F.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True, scale=0.3
    ).transpose(1, 2)
    torch.testing.assert_close(plain, ref.detach(), atol=1e-6, rtol=1e-6)
