"""TRL's DPO losses written from their definitions (``trl.DPOTrainer._compute_loss``,
v1.9), independently of :mod:`ray_disagg.objectives`, for the preference tests."""

import torch
import torch.nn.functional as F


def trl_pair_loss(loss_type: str, beta: float, eps: float = 0.0):
    """``loss(policy, ref, tokens, pairs)`` -> per-pair losses, each input ``(B, 2)``
    (chosen, rejected): ``delta`` the chosen minus rejected log-ratio; IPO on
    log-ratios averaged over each answer's label tokens; Robust DPO with flip
    probability ``eps``."""

    def loss(policy, ref, tokens, _pairs=None):
        ratio = policy - ref
        delta = ratio[:, 0] - ratio[:, 1]
        if loss_type == "sigmoid":
            return -F.logsigmoid(beta * delta)
        if loss_type == "hinge":
            return torch.relu(1 - beta * delta)
        if loss_type == "ipo":
            avg = ratio / tokens.clamp(min=1)
            return (avg[:, 0] - avg[:, 1] - 1 / (2 * beta)) ** 2
        assert loss_type == "robust"
        clean = -(1 - eps) * F.logsigmoid(beta * delta)
        flipped = -eps * F.logsigmoid(-beta * delta)
        return (clean - flipped) / (1 - 2 * eps)

    return loss
