"""Tier 1: the cross-group schedules never wait in a cycle on in-order devices
(``CUDA_DEVICE_MAX_CONNECTIONS=1``), across pairs too, for every layout shape the GPU
paths run: k = 1..8, max_in_flight 1..k, one and two encoder groups, data-parallel sizes
1 and 2 on both sides with every pair talking (balanced assignment), SP/TP and FSDP
collectives, frozen encoders."""

import itertools

import numpy as np
import pytest

from ray_disagg.pipeline.assignment import BatchPlan
from ray_disagg.pipeline.schedule import Action, Op
from ray_disagg.pipeline.simulate import Collective, Deadlock, GroupShape, Transfer, programs, run


def _layouts():
    for encoders, dp_e, dp_l, mp_e, mp_l, fsdp, audio_trains in itertools.product(
        (("vision",), ("vision", "audio")),
        (1, 2),
        (1, 2),
        (1, 2),
        (1, 2),
        (False, True),
        (True, False),
    ):
        if len(encoders) == 1 and not audio_trains:
            continue
        groups = {
            e: GroupShape(dp=dp_e, mp=mp_e, fsdp=fsdp, trains=e == "vision" or audio_trains)
            for e in encoders
        }
        groups["text"] = GroupShape(dp=dp_l, mp=mp_l, fsdp=fsdp)
        yield groups


LAYOUTS = list(_layouts())


@pytest.mark.parametrize("k", range(1, 9))
def test_no_schedule_waits_in_a_cycle(k):
    checked = 0
    for groups in LAYOUTS:
        for limit in range(1, k + 1):
            assert run(programs(groups, "text", k, limit, steps=2)) > 0
            checked += 1
    assert checked == len(LAYOUTS) * k


def test_contiguous_assignment_where_only_some_pairs_talk():
    groups = {"vision": GroupShape(dp=2), "text": GroupShape(dp=2, mp=2)}
    talks = lambda g, d, t, j: d == t or j % 2 == 1  # noqa: E731
    for k, limit in [(2, 2), (4, 2), (4, 4), (3, 1)]:
        assert run(programs(groups, "text", k, limit, talks=talks)) > 0


def test_a_frozen_encoder_gets_no_gradient():
    groups = {"vision": GroupShape(dp=1, trains=False), "text": GroupShape(dp=1)}
    queues = programs(groups, "text", k=3, max_in_flight=2, steps=1)
    ops = [op for t in queues[("text", 0, 0)] if hasattr(t, "ops") for op in t.ops]
    assert [d for d, m in ops if not m.startswith(("stats", "total"))] == ["send"] + ["recv"] * 3


def _receive_just_in_time(k, max_in_flight, sends_grads=True):
    """The order before the schedules were data: the LLM received each microbatch's
    crossings right before training on it."""
    out = [Action(Op.SEND_INPUTS)]
    for j in range(k):
        out += [Action(Op.RECV_CROSSINGS, j), Action(Op.TRAIN, j)]
        out += [Action(Op.SEND_GRADS, j)] if sends_grads else []
    return out + [Action(Op.WAIT_SENDS)]


def test_the_simulator_catches_the_old_cycle():
    """1F1B with the LLM receiving just in time: the encoder sends microbatch 1 and then
    waits for gradient 0, while the LLM sends gradient 0 before receiving microbatch 1;
    one in-order queue per device can run neither first."""
    groups = {"vision": GroupShape(dp=1), "text": GroupShape(dp=1)}
    old = programs(groups, "text", k=2, max_in_flight=2, llm_schedule=_receive_just_in_time)
    with pytest.raises(Deadlock, match=r"2 workers wait for each other") as err:
        run(old)
    assert "('text', 0, 0): Transfer" in str(err.value) and "g0" in str(err.value)
    # sequential is fine either way: the encoder waits for gradient 0 before sending 1
    seq = programs(groups, "text", k=2, max_in_flight=1, llm_schedule=_receive_just_in_time)
    assert run(seq) > 0


@pytest.mark.parametrize("nv,nt,k", [(4, 2, 2), (2, 4, 3), (3, 5, 2), (8, 4, 4)])
def test_neighbourhood_plans_never_wait_in_a_cycle(nv, nt, k):
    """The pairs a balanced plan really uses (each worker's transfers with every peer on
    one in-order queue, as one NCCL communicator per link issues them on one stream), and
    the statistics over the hub instead of a collective over every worker."""
    rng = np.random.default_rng(nv * nt)
    n = 2 * nv * nt * k
    costs = {"text": rng.integers(30, 2000, n), "vision": rng.integers(0, 2304, n) * 1.0}
    plan = BatchPlan(num_samples=n, global_batch_size=n, micro_batches=k,
                     reader="text", dp_sizes={"vision": nv, "text": nt}, costs=costs)  # fmt: skip
    mbs = plan.assign(0)

    def talks(g, d, t, j):
        return bool(set(mbs[j][g][d]) & set(mbs[j]["text"][t]))

    groups = {"vision": GroupShape(dp=nv, mp=2), "text": GroupShape(dp=nt, mp=2)}
    for limit in range(1, k + 1):
        queues = programs(groups, "text", k, limit, steps=2, talks=talks)
        assert run(queues) > 0
    # no operation spans the groups but the rank 0s' transfers
    spans = {op.name for q in queues.values() for op in q if isinstance(op, Collective)}
    assert not [n for n in spans if n.startswith("finish")]
    hub = [
        op for op in queues[("text", 0, 0)] if isinstance(op, Transfer) and "stats" in op.ops[0][1]
    ]
    assert len(hub) == 2  # one per step from the vision group's rank 0
