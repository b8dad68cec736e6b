"""fp8_check_interval: what FP8 costs in loss, measured while the run trains.

Every fp8_check_interval steps the step's first micro-batch runs once more, before its FP8
forward, with the converted layers computing in the base precision (the backend's
high_precision context, the one evaluation uses): no gradients, the RNG forked (the same
dropout masks the FP8 forward then draws, and the training's own RNG left as it was). Its
cross-entropy against the FP8 forward's on the same weights and tokens is the gap:

    fp8/loss_gap      FP8 loss - high-precision loss (nats; the ranks' mean)
    fp8/loss_gap_rel  that gap / the high-precision loss

Nothing of the FP8 state moves: the native layers record amaxes only in a training pass with
gradients, TE's modules leave their amax history and scales alone outside its FP8 autocast
(init_fp8_metadata returns before touching them; only the checkpoint flag is re-marked, see
te.py), torchao's layers run nn.Linear's own forward. The checked step trains bit for bit as
an unchecked one. Every rank runs the check at the same step (its forward's collectives under
DDP/FSDP, and the mean of the gap), and the host reads the gap once per check.

A gap beyond fp8_max_loss_gap either way (a negative one: the model has adapted to FP8's
errors) for fp8_gap_window checks in a row is warned about once. With
fp8_gap_action: recover, such a window also applies fp8_recovery's remedy (a larger margin, or
FP8 off); a window that persists after a margin was raised switches FP8 off."""
from __future__ import annotations

import math

import torch


class LossGapCheck:
    def __init__(self, cfg, prec, log, device: torch.device):
        self.interval = cfg.fp8_check_interval if prec.fp8 else 0
        self.max_gap, self.window = cfg.fp8_max_loss_gap, cfg.fp8_gap_window
        self.recover, self.remedy = cfg.fp8_gap_action == "recover", cfg.fp8_recovery
        self.prec, self.log, self.device = prec, log, device
        self.high = None          # this step's high-precision cross-entropy (a device tensor)
        self.warned = False
        self.gaps: list = []      # every check's gap, for the summary
        self.streak = 0           # checks in a row above max_gap (not carried over a resume)
        self.raised = False       # a margin the gap check raised: the next window turns FP8 off

    def due(self, step: int) -> bool:
        """Whether optimizer step `step` (1-based, about to run) is checked."""
        return bool(self.interval) and step % self.interval == 0 and \
            bool(self.prec.status().get("fp8_on"))

    def high_precision(self, loss_fn, x: torch.Tensor, y: torch.Tensor) -> None:
        """The first micro-batch's cross-entropy with FP8 off: `loss_fn(x, y)` returns (loss,
        cross-entropy, penalty) as the training forward does."""
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.no_grad(), torch.random.fork_rng(devices=devices), \
                self.prec.high_precision():
            # A copy: under CUDA graphs (compile_mode reduce-overhead, max-autotune) the graph's
            # output memory is reused by the next compiled call, the FP8 forward.
            self.high = loss_fn(x, y)[1].detach().float().clone()

    def gap_tensor(self, fp8_ce: torch.Tensor) -> torch.Tensor:
        """[gap, high-precision loss] on the device, and the check's state cleared."""
        high, self.high = self.high, None
        return torch.stack([fp8_ce.detach().float() - high, high])

    def report(self, gap: float, high: float, st) -> dict:
        """The check's row; the warning and the remedy once the gap stays too large."""
        rel = gap / high if high else math.inf
        self.gaps.append(gap)
        row = {"step": st.step, "tokens": st.tokens, "fp8/loss_gap": gap,
               "fp8/loss_gap_rel": rel}
        # Either way: a model that does better in FP8 than in high precision has adapted to
        # FP8's errors, and its evaluation, export and fine-tuning in bf16 pay for it.
        above = not math.isfinite(gap) or abs(gap) > self.max_gap
        self.streak = self.streak + 1 if above else 0
        if self.streak < self.window:
            return row
        self.streak = 0
        what = (f"FP8's loss differs from the high-precision loss by more than "
                f"fp8_max_loss_gap {self.max_gap:g} at {self.window} checks in a row (step "
                f"{st.step:,}: {gap:+.4f} nats, {rel:+.2%})")
        if not self.recover:
            if not self.warned:
                self.log.warn(f"{what}: FP8 is hurting this model. fp8_gap_action: recover "
                              f"applies fp8_recovery ({self.remedy}); or raise fp8_margin, "
                              f"try another fp8_recipe, or train the tail in bf16 (fp8_until)")
            self.warned = True
            return row
        how = "bf16" if self.raised else self.remedy
        remedy = self.prec.recover(how, why="for its loss gap (fp8_gap_action: recover)")
        self.raised = self.raised or (remedy or "").startswith("fp8_margin")
        self.log.warn(f"{what}; {remedy}")
        row.update({f"recovery/{k}": v for k, v in self.prec.status().items()})
        return row

    def summary(self) -> dict:
        """For summary.json: how many checks, the last gap, their mean and the largest in size
        (signed)."""
        if not self.gaps:
            return {}
        finite = [g for g in self.gaps if math.isfinite(g)]
        return {"fp8_loss_gap": dict(
            checks=len(self.gaps), last=self.gaps[-1],
            mean=sum(finite) / len(finite) if finite else None,
            max=max(finite, key=abs) if finite else None)}
