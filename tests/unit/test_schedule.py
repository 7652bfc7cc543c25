"""Tier 1: the step schedules are data (pure action lists) and the messages are typed."""

import pickle

import pytest

from ray_disagg.pipeline.messages import Crossings, Grads, Inputs, StepKey, expect
from ray_disagg.pipeline.schedule import (
    Action,
    Op,
    encoder_actions,
    llm_actions,
    peak_in_flight,
)


def _ops(actions, op):
    return [a.mb for a in actions if a.op is op]


@pytest.mark.parametrize("k", range(1, 9))
def test_encoder_1f1b_forwards_and_backwards_every_microbatch_in_order(k):
    for limit in range(1, k + 2):
        actions = encoder_actions(k, limit)
        assert actions[0] == Action(Op.RECV_INPUTS) and actions[-1] == Action(Op.WAIT_SENDS)
        assert _ops(actions, Op.FORWARD) == list(range(k))
        assert _ops(actions, Op.BACKWARD) == list(range(k))
        assert _ops(actions, Op.RECV_GRADS) == list(range(k))
        assert peak_in_flight(actions) == min(limit, k)
        for j in range(k):  # gradients come in right before their backward, after forward
            f = actions.index(Action(Op.FORWARD, j))
            r = actions.index(Action(Op.RECV_GRADS, j))
            assert f < r and actions[r + 1] == Action(Op.BACKWARD, j)


def test_sequential_alternates_and_1f1b_runs_ahead():
    seq = [str(a) for a in encoder_actions(2, 1)]
    assert seq == [
        "recv_inputs",
        "forward(0)",
        "recv_grads(0)",
        "backward(0)",
        "forward(1)",
        "recv_grads(1)",
        "backward(1)",
        "wait_sends",
    ]
    ahead = [str(a) for a in encoder_actions(4, 2)]
    assert ahead[1:4] == ["forward(0)", "forward(1)", "recv_grads(0)"]
    assert ahead.index("forward(2)") == ahead.index("backward(0)") + 1
    llm = [str(a) for a in llm_actions(4, 2)]
    assert llm[1:6] == [
        "recv_crossings(0)",
        "wait_sends",
        "recv_crossings(1)",
        "wait_sends",
        "train(0)",
    ]


def test_forward_only_schedules():
    enc = encoder_actions(3, 2, trains=False)
    assert [a.op for a in enc] == [Op.RECV_INPUTS] + [Op.FORWARD] * 3 + [Op.WAIT_SENDS]
    assert peak_in_flight(enc) == 1
    llm = llm_actions(3, 2, sends_grads=False)
    assert not _ops(llm, Op.SEND_GRADS) and _ops(llm, Op.TRAIN) == [0, 1, 2]


def _messages(actions, side: str) -> list[str]:
    """The order in which one side sends and receives with a peer: c<j> crossings, g<j>
    gradients."""
    names = {
        "encoder": {Op.FORWARD: "c", Op.RECV_GRADS: "g"},
        "llm": {Op.RECV_CROSSINGS: "c", Op.SEND_GRADS: "g"},
    }[side]
    return [f"{names[a.op]}{a.mb}" for a in actions if a.op in names]


@pytest.mark.parametrize("k", range(1, 9))
def test_llm_mirrors_the_encoders_message_order(k):
    for limit in range(1, k + 2):
        llm = llm_actions(k, limit)
        assert llm[0] == Action(Op.SEND_INPUTS) and llm[-1] == Action(Op.WAIT_SENDS)
        assert _messages(llm, "llm") == _messages(encoder_actions(k, limit), "encoder")
        for j in range(k):  # received before trained, answered right after
            i = llm.index(Action(Op.TRAIN, j))
            assert llm.index(Action(Op.RECV_CROSSINGS, j)) < i
            assert llm[i + 1] == Action(Op.SEND_GRADS, j)
            r = llm.index(Action(Op.RECV_CROSSINGS, j))
            assert llm[r + 1] == Action(Op.WAIT_SENDS)
    frozen = llm_actions(k, 2, sends_grads=False)
    assert _messages(frozen, "llm") == _messages(encoder_actions(k, trains=False), "encoder")


def test_bad_schedule_arguments():
    with pytest.raises(ValueError, match="at least one microbatch"):
        encoder_actions(0)
    with pytest.raises(ValueError, match="max_in_flight=0"):
        encoder_actions(2, 0)


def test_messages_are_typed_checked_and_picklable():
    key = StepKey(step=2)
    msg = pickle.loads(pickle.dumps(Inputs(key=key, microbatches=[[{"id": 1}]])))
    assert expect(msg, Inputs, key, receiver="vision group").microbatches == [[{"id": 1}]]
    assert expect(Grads(key=key, mb=0), Grads, key, 0, receiver="vision group")
    with pytest.raises(RuntimeError, match="Crossings of step 3 microbatch 1 but got"):
        expect(Crossings(key=key, mb=0), Crossings, key, 1, receiver="text group")
    with pytest.raises(RuntimeError, match="validation batch 0 at step 3"):
        expect(Grads(key=key, mb=0), Grads, StepKey(2, val_batch=0), 0, receiver="vision")
    with pytest.raises(RuntimeError, match="expected Grads"):
        expect(Crossings(key=key, mb=0), Grads, key, 0, receiver="vision group")


def test_pipeline_seconds_replays_the_lists():
    from ray_disagg.pipeline.timing import pipeline_seconds

    f, b, t = 0.1, 0.2, 0.5
    for k in (1, 3):  # sequential: each microbatch crosses and comes back before the next
        got = pipeline_seconds(k=k, max_in_flight=1, forward=f, backward=b, train=t)
        assert got == pytest.approx(k * (f + b + t))
    # every crossing received up front, then the LLM trains while the encoder backwards
    got = pipeline_seconds(k=2, max_in_flight=2, forward=f, backward=b, train=t, transfer=0.01)
    assert got == pytest.approx(2 * f + 0.01 + 2 * t + 0.01 + b)
    # more microbatches than in flight: the LLM waits for the encoder's backward and
    # forward after each of the first k - max_in_flight gradients
    got = pipeline_seconds(k=4, max_in_flight=2, forward=f, backward=b, train=t)
    assert got == pytest.approx(2 * f + 4 * t + 2 * (b + f) + b)
    ahead = pipeline_seconds(k=4, max_in_flight=4, forward=f, backward=b, train=t)
    assert ahead == pytest.approx(4 * f + 4 * t + b) and ahead < got
    frozen = pipeline_seconds(
        k=2, max_in_flight=2, forward=f, backward=0.0, train=t, encoder_trains=False
    )
    assert frozen == pytest.approx(f + 2 * t)  # no gradients: each crossing just before
