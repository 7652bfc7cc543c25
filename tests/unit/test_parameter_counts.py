"""Tier 1: a worker's start line counts each parameter once, trainable or not, and says
what the rank holds only where that is less (the sharded layouts: the gloo tier's
``test_tensor_parallel`` and ``test_generation``)."""

from torch import nn

from ray_disagg.worker.part_worker import ParameterCounts


def test_counts_trainable_of_all_parameters_once():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 3), nn.Linear(4, 10, bias=False))
    model[2].weight = model[0].weight  # tied: one parameter of 40 elements
    model[1].requires_grad_(False)
    counts = ParameterCounts.of(model)
    assert counts == ParameterCounts(trainable=40, total=55, local_trainable=40, local_total=55)
    assert str(counts) == "40 of 55 parameter elements trainable"
