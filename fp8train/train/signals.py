"""Stop requests from outside: SIGTERM (a scheduler or `kill`), SIGINT (Ctrl-C) and SIGUSR1
(SLURM's warning before the time limit or a preemption, `--signal=B:USR1@120`).

The handlers are installed for the whole run, start-up included. Before the first training step
a stop ends the run at once (`Stopped`: nothing has been trained, so there is nothing to save).
During training the first one is acknowledged at once on rank 0 and asks the loop to finish its
optimizer step (an evaluation in progress is abandoned), save a checkpoint and exit with code 3
("stopped, resumable"); a second one exits at once, without a checkpoint (the same signal again
within a moment is the same request, delivered twice)."""
from __future__ import annotations

import os
import signal
import threading
import time
from typing import Optional

from ..errors import EXIT_STOPPED
from ..ranks import agreed_max

STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGUSR1")
                     if hasattr(signal, name))
STOP_SIGNAL_BASE = 100   # agreed stop value: 1 = max_hours, BASE + signum = a signal

STARTING, TRAINING, CLOSING = "starting", "training", "closing"


class Stopped(BaseException):
    """A stop signal before the first training step. A BaseException, as KeyboardInterrupt is,
    so that no `except Exception` on the way (a probe trial, a rank-0 download) takes it for a
    failure of its own."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)

    def describe(self) -> str:
        return (f"stopped: {self} received before the first training step; nothing was "
                f"trained or saved by this invocation: run the same command again to go on "
                f"(exit {EXIT_STOPPED})")

    def report(self, show: bool = True) -> int:
        """The line on the console (rank 0) when no train.log is open yet; the exit code."""
        if show:
            print(self.describe(), flush=True)
        return EXIT_STOPPED


class StopRequests:
    """The handlers, installed around the whole run (`with StopRequests(...)`). While training,
    the handler only records the signal and acknowledges it with os.write (the loop acts on it
    at a step boundary, agreed across ranks): print(), logging and file objects take locks that
    the interrupted code may hold, and raising in the middle of a collective would leave the
    other ranks waiting. Before training, raising is what stops the start-up promptly, as
    Ctrl-C's KeyboardInterrupt does."""

    # A repeat of the first signal this soon is the same request delivered twice (SLURM
    # signals every process, and torchrun forwards its own copy to its workers), not a second.
    REPEAT_WINDOW_S = 2.0

    def __init__(self, announce: bool = True):
        self.received: Optional[int] = None
        self.phase = STARTING
        self.announce = announce   # rank 0 acknowledges; the others stay quiet
        self._when = 0.0
        self._previous: dict = {}

    def __enter__(self) -> "StopRequests":
        if threading.current_thread() is threading.main_thread():  # Python's signals go there
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        now = time.monotonic()
        if self.received is None:
            self.received, self._when = signum, now
            if self.phase == STARTING:
                raise Stopped(signum)
            if self.announce:
                _write(1, acknowledgement(signum, self.phase))
            return
        if signum == self.received and now - self._when < self.REPEAT_WINDOW_S:
            return
        _write(2, f"{signal.Signals(signum).name} again: exiting now, without a checkpoint")
        os._exit(128 + signum)

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received else ""


def acknowledgement(signum: int, phase: str = TRAINING) -> str:
    name = signal.Signals(signum).name
    if phase == CLOSING:
        return f"{name} received: the run is already finishing"
    return (f"{name} received: stopping after this step; a checkpoint follows (a second signal "
            f"exits at once, without one)")


def _write(fd: int, text: str) -> None:
    """One line from a signal handler: os.write takes no lock. On a terminal it starts on a
    line of its own (Ctrl-C's ^C, a progress bar); a pipe or file gets whole lines anyway."""
    try:
        lead = "\n" if os.isatty(fd) else ""
        os.write(fd, f"{lead}{text}\n".encode())
    except OSError:   # a closed pipe: the stop itself must still happen
        pass


class Stopper:
    """Whether the run stops after this step, agreed by every rank: a signal on any rank, or
    max_hours. The agreement is one small all-reduce (a host sync), so it runs every few steps,
    at most 10 apart (soon enough for SLURM's warning) and at every log step, never every step
    on more than one rank. An evaluation checks as often, in batches."""

    def __init__(self, requests: StopRequests, max_hours: Optional[float], log_interval: int,
                 world: int, device):
        self.requests, self.max_hours, self.device, self.world = \
            requests, max_hours, device, world
        self.every = 1 if world == 1 else min(log_interval, 10)
        self.started = time.time()
        self.signalled = False     # the agreed reason is a signal: exit 3, resumable
        self.reason: Optional[str] = None
        self._noted = False

    def __enter__(self) -> "Stopper":
        self.started = time.time()   # max_hours counts this invocation's training
        self.requests.phase = TRAINING
        return self

    def __exit__(self, *exc) -> None:
        self.requests.phase = CLOSING  # the handlers stay until the process is done

    def note(self) -> Optional[str]:
        """The acknowledgement the handler printed, once, for train.log (a handler cannot write
        that file: its lock may be held by the code it interrupted)."""
        if self.requests.received is None or self._noted:
            return None
        self._noted = True
        return acknowledgement(self.requests.received)

    def check(self, step: int, logged: bool, last: bool) -> Optional[str]:
        """The reason to stop after `step`, or None (the last step ends the run anyway)."""
        if last or not (logged or step % self.every == 0):
            return None
        return self.check_now()

    def check_now(self) -> Optional[str]:
        """The agreed check itself: every rank must call it at the same point."""
        received = self.requests.received
        over_time = self.max_hours is not None and \
            time.time() - self.started > self.max_hours * 3600
        # The signal number itself is agreed (offset past the max_hours flag), so every rank
        # names the same signal, whichever rank it reached first.
        why = agreed_max(STOP_SIGNAL_BASE + received if received else int(over_time),
                         self.device)
        if why > STOP_SIGNAL_BASE:
            self._signalled(why, received)
        elif why == 1:
            self.reason = f"max_hours ({self.max_hours:g}) reached"
        return self.reason

    def requested(self) -> bool:
        """Whether any rank has received a stop signal: agreed (every rank calls it, one small
        all-reduce), and it changes nothing, unlike `interrupts`."""
        mine = int(self.requests.received is not None)
        return bool(mine if self.world == 1 else agreed_max(mine, self.device))

    def interrupts(self, batches: int) -> bool:
        """Whether an evaluation, `batches` batches in, is abandoned for a stop signal: agreed,
        so that every rank leaves it at the same batch (its forwards may be collectives).
        max_hours does not abandon one: the evaluation was due before the deadline passed."""
        received = self.requests.received
        mine = STOP_SIGNAL_BASE + received if received else 0
        if self.world == 1:
            why = mine                       # nobody to agree with: every batch, for free
        elif batches % self.every:
            return False
        else:
            why = agreed_max(mine, self.device)
        if why > STOP_SIGNAL_BASE:
            self._signalled(why, received)
            return True
        return False

    def _signalled(self, why: int, received: Optional[int]) -> None:
        self.signalled = True
        self.reason = f"{signal.Signals(why - STOP_SIGNAL_BASE).name} received" + \
            ("" if received else " by another rank")

