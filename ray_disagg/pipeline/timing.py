"""How long one step's cross-group pipeline takes: the action lists the workers run
(:mod:`ray_disagg.pipeline.schedule`) replayed with a duration per action.

The encoder side and the LLM side each run their actions in order. A receive waits until
the peer has posted the matching send, plus ``transfer`` seconds; sends, reading the
inputs and releasing posted sends take no time. So the replay shows what the lists
imply, beyond the textbook 1F1B bound ``k max(v, l) + min(v, l)``: with more
microbatches than ``max_in_flight``, the LLM receives microbatch ``j + max_in_flight``'s
crossings right after sending ``j``'s gradients, and waits there for the encoder's
backward of ``j`` and forward of ``j + max_in_flight``.

The planner's cost model (``ray_disagg.planner.cost``) times its layouts with it.

Example:
    >>> pipeline_seconds(k=1, max_in_flight=1, forward=1.0, backward=2.0, train=3.0)
    6.0
    >>> pipeline_seconds(k=2, max_in_flight=2, forward=1.0, backward=2.0, train=3.0)
    10.0
    >>> round(pipeline_seconds(k=4, max_in_flight=2, forward=0.1, backward=0.2, train=0.5), 6)
    3.0
"""

from __future__ import annotations

from ray_disagg.pipeline.schedule import Op, encoder_actions, llm_actions

__all__ = ["pipeline_seconds"]


def pipeline_seconds(
    *,
    k: int,
    max_in_flight: int,
    forward: float,
    backward: float,
    train: float,
    transfer: float = 0.0,
    encoder_trains: bool = True,
) -> float:
    """Seconds from the step's start until both sides finished their lists: ``k``
    microbatches with the encoder's ``forward`` and ``backward`` seconds and the LLM's
    ``train`` seconds (forward and backward) per microbatch, ``transfer`` seconds per
    crossing (each way). ``encoder_trains=False``: forwards only, no gradients back."""
    sides = {
        "encoder": encoder_actions(k, max_in_flight, encoder_trains),
        "llm": llm_actions(k, max_in_flight, sends_grads=encoder_trains),
    }
    cost = {Op.FORWARD: forward, Op.BACKWARD: backward, Op.TRAIN: train}
    posts = {Op.FORWARD: "crossings", Op.SEND_GRADS: "grads"}
    waits = {Op.RECV_CROSSINGS: "crossings", Op.RECV_GRADS: "grads"}
    posted: dict[tuple[str, int], float] = {}
    clock, at = {"encoder": 0.0, "llm": 0.0}, {"encoder": 0, "llm": 0}
    while any(at[s] < len(sides[s]) for s in sides):
        moved = False
        for side, actions in sides.items():
            while at[side] < len(actions):
                a = actions[at[side]]
                if a.op in waits:
                    sent = posted.get((waits[a.op], a.mb))
                    if sent is None:
                        break  # the peer has not posted it yet: run the peer
                    clock[side] = max(clock[side], sent + transfer)
                clock[side] += cost.get(a.op, 0.0)
                if a.op in posts:
                    posted[(posts[a.op], a.mb)] = clock[side]
                at[side] += 1
                moved = True
        if not moved:  # the lists mirror each other (tested); this would be a bug
            raise RuntimeError(f"the action lists of k={k} wait on each other")
    return max(clock.values())
