"""Bounded cross-group peers: every plan keeps each encoder replica to at most
``ceil(L/E) + 1`` LLM replicas and each LLM replica to at most ``ceil(E/L) + 1`` encoder
replicas, and balances inside those neighbourhoods."""

import math

import numpy as np
import pytest

from ray_disagg.pipeline.assignment import BatchPlan
from ray_disagg.pipeline.bins import BinFiller, fill_steps
from ray_disagg.pipeline.budget import BudgetPlan, StreamBudgetPlan
from ray_disagg.pipeline.neighbours import Neighbourhoods, band_split, spread


def test_the_ring_is_the_overlap_of_arcs_and_bounded_at_every_size():
    for e in range(1, 41):
        for n in range(1, 41):
            band = Neighbourhoods(e, n)
            overlap = [(a, d) for a in range(e) for d in range(n)]
            arcs = {(a, d) for a, d in overlap if d * e <= (a + 1) * n and (d + 1) * e > a * n}
            arcs.add((e - 1, 0))  # the ring closes
            assert band.pairs() == arcs
            assert arcs == {(a, d) for a in range(e) for d in band.of_encoder(a)}
            assert band.max_llm_peers <= math.ceil(n / e) + 1
            assert band.max_encoder_peers <= math.ceil(e / n) + 1
    assert len(Neighbourhoods(64, 32).pairs()) == 96  # not 2,048


def _costs(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Skewed costs: a fifth text-only, large images, a few videos (as benchmarks/scale.py)."""
    rng = np.random.default_rng(seed)
    rows = rng.integers(144, 2304, n) * (rng.random(n) > 0.2)
    rows = np.where(rng.random(n) > 0.9, 256 * rng.integers(4, 17, n), rows)
    return {"text": rng.integers(30, 2000, n) + rows, "vision": rows + rows**2 / 1024}


def _exchanges(mbs, group="vision", reader="text") -> set[tuple[int, int]]:
    out = set()
    for mb in mbs:
        owner = {p: d for d, share in enumerate(mb[reader]) for p in share}
        out |= {(e, owner[p]) for e, share in enumerate(mb[group]) for p in share}
    return out


SIZES = [(1, 1), (2, 1), (1, 2), (3, 2), (2, 3), (8, 4), (4, 8), (5, 3)]


def _plans(nv: int, nt: int):
    """Every kind of plan at ``nv`` vision x ``nt`` text replicas, with a step's costs
    for the streamed ones."""
    b, k = 2 * nv * nt * 2, 2
    common = dict(num_samples=4 * b, global_batch_size=b, micro_batches=k, reader="text",
                  dp_sizes={"vision": nv, "text": nt}, shuffle=True)  # fmt: skip
    costs = _costs(4 * b)
    lengths = [(int(t) // 16 + 1,) for t in costs["text"]]
    step = {"text": costs["text"][:b], "vision": costs["vision"][:b]}
    per = b // nt // k
    layout = {"counts": [[per] * k for _ in range(nt)], "costs": step}
    cap = StreamBudgetPlan(**common, max_tokens=10**6, max_patches=10**7, streamed_costs=True)
    return [
        (BatchPlan(**common), None),
        (BatchPlan(**common, costs=costs), None),
        (BatchPlan(**common, streamed_costs=True), step),
        (
            BudgetPlan(
                **common, max_tokens=512, lengths=lengths, patches={"vision": costs["vision"]}
            ),
            None,
        ),  # fmt: skip
        (StreamBudgetPlan(**common, max_tokens=10**6, streamed_costs=True), layout),
        (cap, layout),
    ]


@pytest.mark.parametrize("nv,nt", SIZES)
def test_every_plan_exchanges_only_between_neighbours(nv, nt):
    band = Neighbourhoods(nv, nt)
    for plan, step_costs in _plans(nv, nt):
        pairs = plan.exchange_pairs("vision", "text")
        assert pairs <= band.pairs(), type(plan).__name__
        assert {(d, e) for e, d in pairs} == plan.exchange_pairs("text", "vision")
        for step in range(2):
            mbs = plan.assign(step, step_costs)
            assert _exchanges(mbs) <= pairs, type(plan).__name__
            for e in range(nv):  # both sides agree on who exchanges, inside the band
                mine = plan.peers("vision", e, "text", step, mbs)
                assert set(mine) <= set(band.of_encoder(e))
                assert all(e in plan.peers("text", d, "vision", step, mbs) for d in mine)


def test_balancing_inside_the_neighbourhoods_is_close_to_balancing_over_all():
    """64 x 32 replicas, skewed costs: the slowest encoder replica within 5% of the mean
    (the ideal of balancing over every replica), the LLM's tokens within 2%."""
    plan = BatchPlan(num_samples=8192, global_batch_size=2048, micro_batches=4, reader="text",
                     dp_sizes={"vision": 64, "text": 32}, costs=_costs(8192))  # fmt: skip
    for step in range(2):
        idx = plan.global_indices(step)
        load, tokens = np.zeros(64), np.zeros(32)
        for mb in plan.assign(step):
            for e, share in enumerate(mb["vision"]):
                load[e] += sum(plan.costs["vision"][idx[p]] for p in share)
            for d, share in enumerate(mb["text"]):
                tokens[d] += sum(plan.costs["text"][idx[p]] for p in share)
        assert load.max() / load.mean() < 1.05
        assert tokens.max() / tokens.mean() < 1.02


def test_spread_balances_every_cost_with_equal_counts():
    rng = np.random.default_rng(1)
    tokens, patches = rng.integers(1, 100, 64), rng.integers(0, 1000, 64) * (rng.random(64) > 0.5)
    bins = spread(list(range(64)), [tokens, patches], 8)
    assert sorted(p for b in bins for p in b) == list(range(64)) and {len(b) for b in bins} == {8}
    for cost in (tokens, patches):
        sums = [cost[b].sum() for b in bins]
        assert max(sums) / np.mean(sums) < 1.15
    assert spread([0, 1, 2, 3], [[0.0] * 4], 2) == [[0, 2], [1, 3]]  # zero costs: even counts


def test_band_split_fills_quotas_and_spreads_zero_costs():
    # one LLM replica, two encoders: the large sample alone, as longest-processing-time
    assert band_split([list(range(8))], [7.0] + [1.0] * 7, 2) == [[0], [1, 2, 3, 4, 5, 6, 7]]
    assert band_split([[0, 1, 2, 3]], [0.0] * 4, 2) == [[0, 2], [1, 3]]


def test_a_patch_cap_with_fewer_encoder_replicas_keeps_every_llm_bin_served():
    """4 vision x 5 text replicas, room for one or two images per encoder replica and
    microbatch: LLM replica 4's only neighbour is vision replica 3, which the other bins
    leave room on, so the steps fill (every pair allowed left out 3 of 120 here)."""
    rng = np.random.default_rng(1)
    patches = rng.integers(200, 1001, 120).astype(float) * (rng.random(120) > 0.05)
    lengths = [(int(n),) for n in rng.integers(20, 200, 120)]
    filler = BinFiller(lengths, {"vision": patches}, 10**6, 1000, 40, (1, 5, {"vision": 4}))
    steps = fill_steps(filler, range(120))
    assert 120 - len({i for s in steps for i in s.indices()}) <= 3
    for s in steps:  # the cap holds, each sample on a neighbour of its LLM replica
        for e, share in enumerate(s.encoders["vision"][0]):
            assert sum(patches[i] for i in share) <= 1000
            llm = {d for d, b in enumerate(s.llm[0]) for i in b if i in share}
            assert llm <= set(Neighbourhoods(4, 5).of_encoder(e))
