"""The optimizer."""
from __future__ import annotations

import torch


def build_optimizer(model: torch.nn.Module, opt) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices and embeddings only: decaying norms' gains and
    biases toward zero hurts and saves nothing. Fused (CPU and CUDA): one kernel for the whole
    update, and it can skip a non-finite step on the device (see health.py). `opt`: the
    config's optimizer section (or the whole config)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": opt.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=opt.learning_rate, betas=(opt.beta1, opt.beta2),
                             eps=opt.adam_eps, fused=True)
