"""Evaluation during training: when (its own cadence), the validation loss over a fixed set, the
target (val/time_to_target_s), and the text samples shown with it."""
from __future__ import annotations

import math

import torch

from ..checkpoint.train_state import Counters
from ..errors import one_line
from ..observe.logger import hms
from .evaluation import token_loss_sums
from .hellaswag import NORMALISED_BY, describe, metrics_row


class EvalRecord(Counters):
    """The evaluations so far, carried across resumes (a checkpoint's component "evaluator"):
    the best val/loss and its step, and where target_val_loss was first reached."""

    def __init__(self):
        self.best_val_loss = None
        self.best_val_step = None
        self.target = None           # target_val_loss when it was reached, and where
        self.target_step = None
        self.time_to_target_s = None
        self.tokens_to_target = None


class Evaluator:
    def __init__(self, ev, eval_set, accelerator, prec, log, samples=None, hellaswag=None,
                 record: "EvalRecord | None" = None):
        """`ev`: the config's eval section; `samples`: a samples.TextSampler, or None (no text);
        `hellaswag`: a hellaswag.HellaSwag, or None (off); `record`: the evaluations so far (a
        resumed checkpoint's)."""
        self.ev, self.eval_set, self.acc, self.prec, self.log = ev, eval_set, accelerator, \
            prec, log
        self.samples, self.hellaswag = samples, hellaswag
        self.record = record if record is not None else EvalRecord()
        self.final = None      # (step, val/loss) of the latest evaluation
        self.hellaswag_final = None   # the latest HellaSwag accuracies, with their step

    def due(self, step: int, last: bool, stopping: bool) -> bool:
        """At the interval, at the end, and at a stop that is not a deadline (max_hours): a
        signal (SLURM's warning, a preemption) leaves its time to the checkpoint."""
        return step % self.ev.interval == 0 or last or stopping

    def target_done(self) -> bool:
        """This run reached its target before and stops there (stop_at_target)."""
        rec = self.record
        return self.ev.target_val_loss is not None and self.ev.stop_at_target and \
            rec.target == self.ev.target_val_loss and rec.target_step is not None

    @torch.no_grad()
    def run(self, model, st, train_seconds: float, wall, stopper=None,
            last: bool = False) -> "bool | None":
        """Evaluate and log; True when this evaluation reached target_val_loss for the first
        time (`train_seconds`: the training time so far, for val/time_to_target_s; `wall()`:
        the run's wall time, read once the evaluation is done). With `stopper` (a
        signals.Stopper) a stop signal abandons it between batches, on every rank at the same
        batch: None, nothing logged."""
        model.eval()
        total = token_loss_sums(model, self.eval_set, self.acc.device,
                                lambda: self.prec.forward_context(training=False),
                                self.acc.process_index, self.acc.num_processes,
                                stop=stopper.interrupts if stopper is not None else None)
        if total is None:
            model.train()
            return None
        total = self.acc.reduce(total, "sum")
        val_loss = (total[0] / total[1]).item()
        model.train()
        # Time stamps for plots of loss against time (scripts/compare_runs.py): training time
        # (evaluation and checkpoints excluded) and wall time, resumes included.
        row = {"step": st.step, "tokens": st.tokens, "val/loss": val_loss,
               "val/ppl": math.exp(min(val_loss, 50.0)), "time/train_s": train_seconds,
               "time/wall_s": wall()}
        hella = ""
        if self.hellaswag is not None and self.hellaswag.due(st.step, last):
            acc = self.hellaswag.accuracy(model)
            row.update(metrics_row(acc))
            self.hellaswag_final = dict(acc, acc_norm_by=NORMALISED_BY, step=st.step)
            hella = f"; {describe(acc)}"
        self.final = (st.step, val_loss)
        rec = self.record
        if rec.best_val_loss is None or val_loss < rec.best_val_loss:
            rec.best_val_loss, rec.best_val_step = val_loss, st.step
        reached = self._reached_target(st, val_loss, train_seconds)
        if reached:   # in the same row: one evaluation, one row
            row.update({"val/time_to_target_s": train_seconds, "val/tokens_to_target": st.tokens})
        self.log.log(row)
        self.log.msg(f"eval step {st.step:,}: val/loss {val_loss:.4f}, "
                     f"val/ppl {row['val/ppl']:.2f}{hella}")
        if reached:
            self.log.msg(f"target val/loss {self.ev.target_val_loss:g} reached at step "
                         f"{st.step:,}: val/loss {val_loss:.4f} after {hms(train_seconds)} of "
                         f"training ({st.tokens:,} tokens)")
        # Agreed: every rank generates (under FSDP each forward is a collective), so every rank
        # must skip the samples together, whichever rank a signal reached first.
        if stopper is not None and stopper.requested():
            self.log.msg(f"text samples of step {st.step:,} skipped: a stop was requested")
        else:
            self._samples(model, st.step)
        return reached

    def _samples(self, model, step: int) -> None:
        if self.samples is None:
            return
        try:  # on rank 0 alone: an error must not leave the other ranks at a barrier
            texts = self.samples.take(model, self.eval_set, step)
        except Exception as e:
            self.log.warn(f"text samples failed ({type(e).__name__}: {one_line(e, 200)}); no "
                          "more samples this run")
            self.samples, texts = None, []
        self.log.samples(step, texts)
        for s in texts[:1]:
            self.log.msg(f"sample: {(s['prompt'] + s['sample'])[:200]!r}")

    def _reached_target(self, st, val_loss: float, train_seconds: float) -> bool:
        """Record the first evaluation at or below target_val_loss. Training time, not wall
        time: evaluations and checkpoints are left out, so runs evaluating at different
        intervals compare fairly."""
        target, rec = self.ev.target_val_loss, self.record
        if target is None or not val_loss <= target or \
                (rec.target == target and rec.target_step is not None):
            return False
        rec.target, rec.target_step = target, st.step
        rec.time_to_target_s, rec.tokens_to_target = train_seconds, st.tokens
        return True



def missed(run_dir: str, step: int, eval_interval: int, total_steps: int) -> bool:
    """Whether the evaluation due at `step` (a checkpoint's step) has no val row in
    metrics.jsonl: a stop abandoned it, or skipped it for the checkpoint, and the resumed run
    owes it."""
    from .evaluation import logged_val_loss
    due = step > 0 and (step % eval_interval == 0 or step >= total_steps)
    return due and logged_val_loss(run_dir, step) is None
