"""One training step of each side of the cross-group pipeline as an ordered list of actions.

The encoder side and the LLM side of a step are pure functions of the number of
microbatches ``k`` and ``max_in_flight``; the workers execute the lists in order
(``ray_disagg.worker``), and tests replay them without Ray or ``torch.distributed``.

Two-stage 1F1B between an encoder group and the LLM group: the encoder forwards
microbatches (posting their crossing tensors to the LLM) while fewer than
``max_in_flight`` await their gradients, otherwise it takes the oldest one's gradients and
runs its backward. ``max_in_flight=1`` is the sequential schedule. The LLM takes the
crossings in the order the encoder sends them, runs each microbatch's forward and
backward and posts the gradients back.

Example:
    >>> [str(a) for a in encoder_actions(2, 2)]
    ['recv_inputs', 'forward(0)', 'forward(1)', 'recv_grads(0)', 'backward(0)', \
'recv_grads(1)', 'backward(1)', 'wait_sends']
    >>> [str(a) for a in llm_actions(2, 2)]
    ['send_inputs', 'recv_crossings(0)', 'wait_sends', 'recv_crossings(1)', 'wait_sends', \
'train(0)', 'send_grads(0)', 'train(1)', 'send_grads(1)', 'wait_sends']
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Op", "Action", "WAITS", "encoder_actions", "llm_actions", "peak_in_flight"]


class Op(enum.Enum):
    """What one action does. Encoder side: ``RECV_INPUTS`` (the step's samples from the
    LLM replicas), ``FORWARD`` (encode one microbatch and post its crossings),
    ``RECV_GRADS`` (that microbatch's gradients), ``BACKWARD``. LLM side:
    ``SEND_INPUTS`` (read the step's samples, post each encoder replica its fields),
    ``RECV_CROSSINGS``, ``TRAIN`` (forward and backward of one microbatch; forward only
    when nothing is trained), ``SEND_GRADS``. Both: ``WAIT_SENDS`` (the posted sends are
    delivered; their buffers may be reused)."""

    RECV_INPUTS = "recv_inputs"
    FORWARD = "forward"
    RECV_GRADS = "recv_grads"
    BACKWARD = "backward"
    SEND_INPUTS = "send_inputs"
    RECV_CROSSINGS = "recv_crossings"
    TRAIN = "train"
    SEND_GRADS = "send_grads"
    WAIT_SENDS = "wait_sends"


WAITS = frozenset({Op.RECV_INPUTS, Op.SEND_INPUTS, Op.RECV_CROSSINGS, Op.RECV_GRADS, Op.WAIT_SENDS})
"""Actions whose time is waiting on another group (reading samples counts as waiting; a
step's metrics give the time spent on its input data apart: ``<group>_data_wait_s``)."""


@dataclass(frozen=True)
class Action:
    """One action of a step; ``mb`` is the microbatch it concerns (``None``: the step)."""

    op: Op
    mb: int | None = None

    def __str__(self) -> str:
        return self.op.value if self.mb is None else f"{self.op.value}({self.mb})"


def _check(k: int, max_in_flight: int) -> None:
    if k < 1:
        raise ValueError(f"micro_batches={k}: a step needs at least one microbatch.")
    if max_in_flight < 1:  # above k it is k
        raise ValueError(f"max_in_flight={max_in_flight}: must be at least 1.")


def encoder_actions(k: int, max_in_flight: int = 1, trains: bool = True) -> list[Action]:
    """An encoder group's step: receive the inputs, then 1F1B over ``k`` microbatches with
    at most ``max_in_flight`` awaiting their gradients; ``trains=False`` (every parameter
    frozen, or validation): forwards only, no gradient comes back."""
    _check(k, max_in_flight)
    out = [Action(Op.RECV_INPUTS)]
    if not trains:
        return out + [Action(Op.FORWARD, j) for j in range(k)] + [Action(Op.WAIT_SENDS)]
    forwarded = done = 0
    while done < k:
        if forwarded < k and forwarded - done < max_in_flight:
            out.append(Action(Op.FORWARD, forwarded))
            forwarded += 1
        else:  # the oldest one's gradients (waiting for them is the bubble)
            out += [Action(Op.RECV_GRADS, done), Action(Op.BACKWARD, done)]
            done += 1
    return out + [Action(Op.WAIT_SENDS)]


def llm_actions(k: int, max_in_flight: int = 1, sends_grads: bool = True) -> list[Action]:
    """The LLM group's step, mirroring :func:`encoder_actions` message for message: read
    and send the inputs, receive the crossings of the first ``max_in_flight``
    microbatches, then per microbatch train on it, post its gradients and receive the
    crossings of the microbatch the encoder forwards next. So with every peer the LLM
    sends and receives in the order the encoder does (``c0 c1 g0 c2 g1 ...``), which is
    what in-order streams need (``ray_disagg.pipeline.simulate``). Each receive is
    followed by a release of the sends the encoders have answered (they sent what the LLM
    just received after taking every earlier message). ``sends_grads=False`` (no encoder
    trains, or validation): no gradients are sent; each crossing is received right before
    its microbatch."""
    _check(k, max_in_flight)
    ahead = min(max_in_flight, k) if sends_grads else 1

    def receive(j: int) -> list[Action]:
        return [Action(Op.RECV_CROSSINGS, j), Action(Op.WAIT_SENDS)]

    out = [Action(Op.SEND_INPUTS)]
    for j in range(ahead):
        out += receive(j)
    for j in range(k):
        out.append(Action(Op.TRAIN, j))
        if sends_grads:
            out.append(Action(Op.SEND_GRADS, j))
        if j + ahead < k:
            out += receive(j + ahead)
    return out + [Action(Op.WAIT_SENDS)]


def peak_in_flight(actions: list[Action]) -> int:
    """Most microbatches forwarded and not yet backwarded at once (forward-only lists: 1)."""
    alive = peak = 0
    has_backward = any(a.op is Op.BACKWARD for a in actions)
    for a in actions:
        if a.op is Op.FORWARD:
            alive += 1
            peak = max(peak, alive)
        elif a.op is Op.BACKWARD:
            alive -= 1
    return peak if has_backward else min(peak, 1)
