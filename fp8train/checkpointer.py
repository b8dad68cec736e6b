"""When the run saves, and what a failed save means (checkpoint.py: the format on disk, atomic
writes, verification).

A checkpoint is taken at the interval, at a stop and at the end. A periodic one is not taken in
the middle of a streak of non-finite steps (FP8 scale state may be poisoned: a rollback must
never land there). A write that fails leaves the previous checkpoint as it was; the run warns
and goes on, unless it was its last chance or checkpoint_required is set.
"""
from __future__ import annotations

import time

from .checkpoint import CheckpointManager, CheckpointWriteError
from .errors import RunFailed


class Checkpointer:
    def __init__(self, ck, manager: CheckpointManager, accelerator, log, config_text: str,
                 run_hash: str):
        """`ck`: the config's checkpoint section."""
        self.ck, self.manager, self.acc, self.log = ck, manager, accelerator, log
        self.config_text, self.run_hash = config_text, run_hash

    def due(self, step: int, last: bool, stopping: bool) -> bool:
        return step % self.ck.checkpoint_interval == 0 or last or stopping

    def latest(self):
        return self.manager.latest()

    def save(self, st, final: bool, wall_seconds: float, in_streak) -> bool:
        """Save the run at st.step; False when it was skipped or failed (and may be).
        `in_streak()`: whether the latest steps were non-finite (a host sync: asked only for a
        periodic checkpoint)."""
        if not final and in_streak():
            self.log.warn(f"no checkpoint at step {st.step:,}: the latest steps had non-finite "
                          "gradients; the next interval will try again")
            return False
        st.checkpoints_written += 1      # counted inside the checkpoint it describes
        st.wall_seconds = wall_seconds
        t0 = time.perf_counter()
        try:
            path = self.manager.save(self.acc, st, self.config_text,
                                     dict(tokens=st.tokens, config_hash=self.run_hash))
        except CheckpointWriteError as e:
            st.checkpoints_written -= 1
            prev = self.manager.latest()
            intact = f"the previous checkpoint '{prev}' is intact" if prev else \
                "there is no earlier checkpoint"
            if final or self.ck.checkpoint_required:
                why = "checkpoint_required is true" if not final else \
                    "it was the run's last checkpoint: the steps after the previous one are lost"
                raise RunFailed(f"{e}; {intact}; stopping because {why}") from None
            self.log.warn(f"{e}; {intact}; training goes on (checkpoint_required: true stops "
                          "instead)")
            return False
        self.log.msg(f"checkpoint step {st.step:,} saved ({time.perf_counter() - t0:.1f} s)")
        self.log.file_only(f"checkpoint: {path}")
        return True

