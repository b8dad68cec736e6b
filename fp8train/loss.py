"""Training loss: cross-entropy plus an optional penalty on the logits.

Penalties (scaled by penalty_weight, default 0):
  z_loss    mean over tokens of logsumexp(logits)^2 (PaLM, Chowdhery et al. 2022): keeps the
            softmax normaliser near 1, which stabilises bf16/FP8 training of the output layer.
  logit_l2  mean over tokens and vocabulary of logits^2: a plain magnitude penalty that keeps
            every logit small, not just the normaliser.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, penalty_type: str = "none",
            penalty_weight: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (total, cross_entropy, weighted penalty), all scalars. Computed in fp32: the
    log-softmax over a 50k vocabulary loses too much in bf16."""
    logits = logits.float()
    ce = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
    if penalty_type == "none" or penalty_weight == 0.0:
        return ce, ce, torch.zeros((), device=ce.device)
    if penalty_type == "z_loss":
        penalty = torch.logsumexp(logits, dim=-1).pow(2).mean()
    elif penalty_type == "logit_l2":
        penalty = logits.pow(2).mean()
    else:
        raise ValueError(f"unknown penalty_type {penalty_type!r}")
    weighted = penalty_weight * penalty
    return ce + weighted, ce, weighted
