"""Non-finite steps and loss spikes, tracked on the device so that the hot loop never waits for
the host.

A step is bad when its global gradient norm is not finite. The norm is computed from the
all-reduced gradients, so every rank reaches the same verdict without a collective of its own.
The update of a bad step is skipped inside the fused AdamW kernel (its `found_inf` input, the
mechanism GradScaler uses), which also leaves Adam's step count untouched; under FSDP2 too. The host reads the
counters, the streak included, at the log interval only."""
from __future__ import annotations

import math

import torch

from ..checkpoint.train_state import Counters


class IntervalCarry(Counters):
    """The log interval a checkpoint between log steps was taken in, carried into the next row on
    resume: its steps, skipped steps, and the ranks' mean loss sums and loss max."""

    def __init__(self):
        self.steps = 0
        self.bad = 0
        self.loss_sum = 0.0
        self.penalty_sum = 0.0
        self.loss_max = 0.0


class Health:
    def __init__(self, device: torch.device, spike_factor: float):
        self.spike_factor = spike_factor
        self.carried = IntervalCarry()   # a checkpoint's component "interval" (loop.py fills it)
        z = lambda: torch.zeros((), device=device)  # noqa: E731
        self.streak = z()         # consecutive bad steps up to now
        self.worst = z()          # the longest streak since the last reset
        self.bad = z()            # bad steps in this log interval
        self.good = z()           # good steps in this log interval
        self.loss_sum = z()       # their (rank-local) losses and penalties
        self.penalty_sum = z()
        self.loss_max = torch.full((), -math.inf, device=device)
        self.running_mean = None  # host: running mean of interval losses, for spikes

    def step(self, grad_norm: torch.Tensor, loss: torch.Tensor,
             penalty: torch.Tensor) -> torch.Tensor:
        """Record one optimizer step; returns 1.0 (skip the update) or 0.0 as a device tensor."""
        if hasattr(grad_norm, "full_tensor"):
            # FSDP2: the norm is a DTensor (partial over the shards): every rank calls this, and
            # gets the same value (one scalar all-reduce, no host sync).
            grad_norm = grad_norm.full_tensor()
        bad = ~torch.isfinite(grad_norm.detach().float())
        badf = bad.float()
        self.streak.mul_(badf).add_(badf)           # +1 when bad, back to 0 when good
        torch.maximum(self.worst, self.streak, out=self.worst)
        self.bad.add_(badf)
        self.good.add_(1.0 - badf)
        loss = loss.detach().float()
        self.loss_sum.add_(torch.where(bad, 0.0, loss))
        self.penalty_sum.add_(torch.where(bad, 0.0, penalty.detach().float()))
        torch.maximum(self.loss_max, torch.where(bad, -math.inf, loss), out=self.loss_max)
        return badf

    def interval(self) -> torch.Tensor:
        """[mean loss, mean penalty, bad steps, loss max, longest streak of bad steps since the
        last reset] of the interval (one device tensor, read with the log's host sync: the
        streak costs no sync of its own), and a fresh interval."""
        good = self.good.clamp_min(1.0)
        nan = torch.full((), math.nan, device=good.device)
        none_good = self.good == 0
        out = torch.stack([torch.where(none_good, nan, self.loss_sum / good),
                           torch.where(none_good, nan, self.penalty_sum / good),
                           self.bad.clone(), self.loss_max.clone(), self.worst.clone()])
        for t in (self.bad, self.good, self.loss_sum, self.penalty_sum):
            t.zero_()
        self.loss_max.fill_(-math.inf)
        return out

    def in_streak(self) -> bool:
        return bool(self.streak.item() > 0)

    def reset(self) -> None:
        for t in (self.streak, self.worst, self.bad, self.good, self.loss_sum, self.penalty_sum):
            t.zero_()
        self.loss_max.fill_(-math.inf)

    def spike(self, loss_mean: float, loss_max: float) -> str | None:
        """After a logged interval: a message when one of its steps' loss exceeded spike_factor
        × the running mean of earlier intervals; then folds this interval into that mean."""
        msg = None
        m = self.running_mean
        if self.spike_factor > 0 and m is not None and math.isfinite(loss_max) \
                and loss_max > self.spike_factor * m:
            msg = f"a step's loss reached {loss_max:.4f}, {loss_max / m:.1f}× the running mean {m:.4f}"
        if math.isfinite(loss_mean):
            self.running_mean = loss_mean if m is None else 0.9 * m + 0.1 * loss_mean
        return msg
