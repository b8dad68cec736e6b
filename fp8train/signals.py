"""Stop requests from outside: SIGTERM (a scheduler or `kill`), SIGINT (Ctrl-C) and SIGUSR1
(SLURM's warning before the time limit or a preemption, `--signal=B:USR1@120`). The first one
asks the loop to finish its optimizer step, save a checkpoint and exit with code 3 ("stopped,
resumable"); a second one exits at once, without a checkpoint (the same signal again within
a moment is the same request, delivered twice)."""
from __future__ import annotations

import os
import signal
import threading
import time
from typing import Optional

STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGUSR1")
                     if hasattr(signal, name))
EXIT_STOPPED = 3


class StopRequests:
    """Installed around the training loop. The handler only records the signal (the loop acts on
    it at a step boundary, agreed across ranks); nothing else is safe inside a handler."""

    # A repeat of the first signal this soon is the same request delivered twice (SLURM
    # signals every process, and torchrun forwards its own copy to its workers), not a second.
    REPEAT_WINDOW_S = 2.0

    def __init__(self):
        self.received: Optional[int] = None
        self._when = 0.0
        self._previous: dict = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # Python delivers signals to the main thread only
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        now = time.monotonic()
        if self.received is None:
            self.received, self._when = signum, now
            return
        if signum == self.received and now - self._when < self.REPEAT_WINDOW_S:
            return
        # os.write and os._exit are safe here; print() and raising in the middle of a
        # collective are not.
        os.write(2, f"\n{signal.Signals(signum).name} again: exiting now, without a "
                    "checkpoint\n".encode())
        os._exit(128 + signum)

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received else ""
