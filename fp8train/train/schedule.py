"""Learning-rate schedule: linear warmup to the peak, cosine decay to min_lr_ratio x peak at the
last step (as GPT-2 / nanoGPT). A pure function of the step: nothing to checkpoint but the step.
"""
from __future__ import annotations

import math


def lr_at(step: int, *, max_lr: float, warmup_steps: int, total_steps: int,
          min_lr_ratio: float) -> float:
    """LR for optimizer step `step` (0-based) of a schedule `total_steps` long.

    Warmup: step s < W gives max_lr * (s + 1) / W, so the last warmup step reaches max_lr.
    Decay: from max_lr at step W down a half cosine to min_lr at step total_steps - 1.
    Steps past the end stay at min_lr.
    """
    min_lr = max_lr * min_lr_ratio
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    last = total_steps - 1
    if step >= last:
        return min_lr
    progress = (step - warmup_steps) / max(1, last - warmup_steps)
    return min_lr + 0.5 * (max_lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def scaled_lr(lr: float, rule: str, effective_batch: int, reference_batch) -> tuple:
    """(peak LR for this effective batch, a line saying so or ''). sqrt suits Adam-style
    optimizers (the noise scale argument); linear is Goyal et al.'s rule for SGD."""
    if rule == "none" or reference_batch is None or effective_batch == reference_batch:
        return lr, ""
    ratio = effective_batch / reference_batch
    scaled = lr * (math.sqrt(ratio) if rule == "sqrt" else ratio)
    how = f"sqrt({effective_batch}/{reference_batch})" if rule == "sqrt" else \
        f"{effective_batch}/{reference_batch}"
    return scaled, f"learning rate: {lr:g} × {how} = {scaled:.4g} (lr_scaling: {rule})"
