"""A checkpoint written by a background thread of rank 0 while training goes on
(checkpoint_async): `BackgroundSave`, the thread and its outcome, agreed by every rank when the
run waits for it. CheckpointManager.save_in_background starts one; write_stall.StallWatch
measures what it costs training; host_copy.HostCopy holds the state it writes.
"""
from __future__ import annotations

import threading
import time

from ..errors import one_line
from ..ranks import first_error
from .write_stall import StallWatch


class BackgroundSave:
    """A checkpoint being written by a thread of rank 0 (`save_in_background`); on the other
    ranks, where nothing is written in the background, an empty one. Every rank knows the step
    and when the save started; only rank 0 knows how it went, until `wait` agrees it."""

    def __init__(self, step: int, path: str, started: float):
        self.step, self.path, self.started = step, path, started
        self.blocked_s = 0.0              # how long training waited for it (set by the caller)
        self.tokens = 0                   # the run's tokens at its step (set by the caller)
        self.save_s: float | None = None  # its duration, start to published (rank 0)
        self.error: str | None = None     # what failed in the thread (rank 0)
        self.stall_s: float | None = None  # training's longest stall during the write (rank 0)
        self.overlap_steps = 0            # steps trained while it was written (set by the caller)
        self._thread = None

    def start(self, write) -> None:
        watch = StallWatch().start()      # before the writer: it sees the write's first hold

        def run():
            try:
                write()
            except BaseException as e:   # reported at the next wait, not by the thread
                self.error = one_line(e, with_type=True)
            self.save_s = time.perf_counter() - self.started
            self.stall_s = watch.stop()
        # Not a daemon: a process that exits otherwise than by a kill finishes the write first.
        self._thread = threading.Thread(target=run, name=f"checkpoint-step-{self.step}")
        try:
            self._thread.start()
        except RuntimeError:   # "can't start new thread": written here and now instead
            self._thread = None
            run()
            self.stall_s = None   # training waited for all of it (blocked_s)

    def done(self) -> bool:
        """Whether the thread has finished (always true on the ranks without one)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> str | None:
        """Wait for the thread; every rank gets the first rank's error, or None (collective:
        every rank calls it at the same point)."""
        if self._thread is not None:
            self._thread.join()
        return first_error(self.error)
