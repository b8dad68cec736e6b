"""Rollback: after max_bad_steps non-finite steps in a row, restore the last checkpoint, apply
the remedy (FP8: a larger margin, or bf16), and skip the training sequences drawn since that
checkpoint (the data that led here is not replayed). A second time before a new checkpoint is
passed, the run stops: it diverges."""
from __future__ import annotations

from ..checkpoint.files import step_of
from ..errors import RunFailed


class Recovery:
    def __init__(self, rel, checkpointer, accelerator, prec, health, log):
        """`rel`: the config's reliability section."""
        self.rel, self.ckpt, self.acc, self.prec, self.health, self.log = \
            rel, checkpointer, accelerator, prec, health, log
        self.since = None          # the step of the last rollback, until a checkpoint passes it
        self.restored_step = None
        self.detected = None       # the step at which the last rollback was decided
        self.last_remedy = ""

    def due(self, worst_streak: float) -> bool:
        return bool(self.rel.max_bad_steps) and worst_streak >= self.rel.max_bad_steps

    def in_streak(self) -> bool:
        """In a streak of non-finite steps that may end in a rollback (a host sync)."""
        return bool(self.rel.max_bad_steps) and self.health.in_streak()

    def saved(self, step: int) -> None:
        """A checkpoint was written at `step`: past the trouble, the remedy carried the run."""
        if self.since is not None and step > self.since:
            self.since = None

    def roll_back(self, st) -> None:
        """Restore the latest checkpoint into the model, optimizer, FP8 state, RNG and `st`."""
        what = (f"{self.rel.max_bad_steps} or more consecutive steps with non-finite gradients "
                f"(their updates were skipped), up to step {st.step:,}")
        self.ckpt.wait(st)   # a checkpoint written in the background: published or failed
        found = self.ckpt.latest()
        hint = "lower learning_rate, raise warmup_steps" + (
            ", raise fp8_margin or train without FP8" if self.prec.fp8 else "")
        if self.since is None and self.restored_step is not None and found is not None and \
                step_of(found) <= self.restored_step:
            self.since = self.detected   # the checkpoint that passed it failed in the background
        if self.since is not None:
            raise RunFailed(f"{what}, again after restoring a checkpoint at step "
                            f"{self.restored_step:,} (the rollback at step {self.since:,}) and "
                            f"{self.last_remedy}: training diverges; {hint}")
        if found is None:
            raise RunFailed(f"{what}, before the first checkpoint: nothing to restore; {hint}")
        keep = dict(skipped_steps=st.skipped_steps, rollbacks=st.rollbacks + 1,
                    data_position=st.data_position)
        detected = st.step
        self.ckpt.restore(found, st)   # model, optimizer, RNG, counters, precision's remedies
        skipped_data = keep["data_position"] - st.data_position
        for k, v in keep.items():        # counted over the whole run, not reset by the restore
            setattr(st, k, v)
        remedy = self.prec.recover(self.rel.fp8_recovery)
        self.last_remedy = remedy or "skipping the data"
        self.health.reset()
        self.log.truncate_after(st.step)
        self.since, self.restored_step, self.detected = detected, st.step, detected
        self.log.warn(f"ROLLBACK: {what}; restored {found} (step {st.step:,}); "
                      f"{remedy + '; ' if remedy else ''}skipping the {skipped_data:,} training "
                      f"sequences drawn since that checkpoint")
        row = {"step": st.step, "tokens": st.tokens, "recovery/rollbacks": st.rollbacks,
               "recovery/detected_at_step": detected, "recovery/skipped_sequences": skipped_data}
        row.update({f"recovery/{k}": v for k, v in self.prec.status().items()})
        self.log.log(row)
