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

from .agreement import agreed_max

STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGUSR1")
                     if hasattr(signal, name))
STOP_SIGNAL_BASE = 100   # agreed stop value: 1 = max_hours, BASE + signum = a signal


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


class Stopper:
    """Whether the run stops after this step, agreed by every rank: a signal on any rank, or
    max_hours. The agreement is one small all-reduce (a host sync), so it runs every few steps,
    at most 10 apart (soon enough for SLURM's warning) and at every log step, never every step
    on more than one rank."""

    def __init__(self, max_hours: Optional[float], log_interval: int, world: int, device):
        self.max_hours, self.device = max_hours, device
        self.every = 1 if world == 1 else min(log_interval, 10)
        self.requests = StopRequests()
        self.started = time.time()
        self.signalled = False     # the agreed reason is a signal: exit 3, resumable

    def __enter__(self) -> "Stopper":
        self.started = time.time()   # max_hours counts this invocation's training
        self.requests.install()
        return self

    def __exit__(self, *exc) -> None:
        self.requests.restore()

    def check(self, step: int, logged: bool, last: bool) -> Optional[str]:
        """The reason to stop after `step`, or None (the last step ends the run anyway)."""
        if last or not (logged or step % self.every == 0):
            return None
        received = self.requests.received
        over_time = self.max_hours is not None and \
            time.time() - self.started > self.max_hours * 3600
        # The signal number itself is agreed (offset past the max_hours flag), so every rank
        # names the same signal, whichever rank it reached first.
        why = agreed_max(STOP_SIGNAL_BASE + received if received else int(over_time),
                         self.device)
        if why > STOP_SIGNAL_BASE:
            self.signalled = True
            return f"{signal.Signals(why - STOP_SIGNAL_BASE).name} received" + \
                ("" if received else " by another rank")
        if why == 1:
            return f"max_hours ({self.max_hours:g}) reached"
        return None
