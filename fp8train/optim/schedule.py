"""Learning-rate schedules: a linear warmup to the peak, then one of

- cosine: a half cosine down to min_lr_ratio x peak at the last step (GPT-2, nanoGPT);
- wsd (warmup-stable-decay, or trapezoid): the peak held, then the last lr_decay_fraction of
  the steps after warmup decay to min_lr (modded-nanogpt and nanochat decay linearly; Hägele et
  al. 2024, "Scaling Laws and Compute-Optimal Training Beyond Fixed Training Durations", find the
  1-sqrt shape best, matching a cosine of the same length with a 20% decay);
- linear: a straight line from the peak to min_lr at the last step.

A pure function of the step: nothing to checkpoint but the step, so a run resumed in the middle
of its decay continues on the same curve.
"""
from __future__ import annotations

import math

SCHEDULES = ("cosine", "wsd", "linear")
DECAY_SHAPES = ("linear", "1-sqrt", "cosine")


def lr_at(step: int, *, max_lr: float, warmup_steps: int, total_steps: int,
          min_lr_ratio: float, schedule: str = "cosine", decay_fraction: float = 0.2,
          decay_shape: str = "linear") -> float:
    """LR for optimizer step `step` (0-based) of a schedule `total_steps` long.

    Warmup: step s < W gives max_lr * (s + 1) / W, so the last warmup step reaches max_lr.
    Then `schedule` takes the LR from max_lr at step W down to min_lr at step total_steps - 1
    (wsd: holds max_lr until its decay, the last ceil(decay_fraction x (total_steps - W))
    steps, whose last reaches min_lr). Steps past the end stay at min_lr.
    """
    min_lr = max_lr * min_lr_ratio
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    last = total_steps - 1
    if step >= last:
        return min_lr
    if schedule == "wsd":
        decay_steps = wsd_decay_steps(warmup_steps, total_steps, decay_fraction)
        start = total_steps - decay_steps          # the first step below the peak
        if step < start:
            return max_lr
        return min_lr + (max_lr - min_lr) * _falloff((step - start + 1) / decay_steps,
                                                     decay_shape)
    progress = (step - warmup_steps) / max(1, last - warmup_steps)
    return min_lr + (max_lr - min_lr) * _falloff(progress, "cosine" if schedule == "cosine"
                                                 else "linear")


def wsd_decay_steps(warmup_steps: int, total_steps: int, decay_fraction: float) -> int:
    """The steps of a wsd schedule's decay: the last `decay_fraction` of those after warmup
    (at least one)."""
    return max(1, math.ceil(decay_fraction * max(0, total_steps - warmup_steps) - 1e-9))


def _falloff(progress: float, shape: str) -> float:
    """1 at progress 0 down to 0 at progress 1."""
    if shape == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if shape == "1-sqrt":
        return 1.0 - math.sqrt(progress)
    return 1.0 - progress


def describe(schedule: str, min_lr_ratio: float, max_lr: float, decay_fraction: float,
             decay_shape: str) -> str:
    """The schedule after warmup in words: "cosine to 0.1 × 0.0006"."""
    to = f"to {min_lr_ratio:g} × {max_lr:g}"
    if schedule == "wsd":
        return f"wsd (the last {decay_fraction:.0%} decaying, {decay_shape}) {to}"
    return f"{schedule} {to}"


def fp8_until_step(until, lr_steps: int):
    """The optimizer step from which fp8_until trains in the base precision: `until` below 1
    is a fraction of the LR schedule's `lr_steps`, from 1 on a step; None: FP8 throughout."""
    if until is None:
        return None
    return max(1, round(until * lr_steps)) if until < 1 else int(until)


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
