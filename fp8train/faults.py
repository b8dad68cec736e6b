"""Fault injection for the reliability tests: a test sets FP8TRAIN_FAULTS and a real training
process fails at exactly the point the test names. Unset (every normal run), nothing here
does any work: `Faults.from_env()` returns None and the loop never calls in.

    FP8TRAIN_FAULTS="nan@5,nan@9-12,kill@step:7,kill@save:6:state,fail@save:9"

    nan@S[-E]        the training loss of optimizer steps S..E is NaN, the first time each step
                     runs in this process (a step replayed after a rollback is clean)
    nan!@S[-E]       the same, every time the step runs (the remedy does not help)
    kill@step:S      SIGKILL this process in step S, after backward, before the update
    kill@save:S:P    SIGKILL it while writing the checkpoint of step S, at phase P:
                     state (files written, no manifest), manifest (before the rename),
                     pointer (renamed, `latest` not yet updated)
    fail@save:S      the checkpoint write of step S raises OSError(ENOSPC) after writing part
                     of the files
    Any entry may end in @rankR to fire on that rank only.
"""
from __future__ import annotations

import errno
import os
import signal

ENV = "FP8TRAIN_FAULTS"


class Faults:
    def __init__(self, spec: str, rank: int):
        self.nan_once: set[int] = set()
        self.nan_always: set[int] = set()
        self.kill_step: set[int] = set()
        self.kill_save: dict[int, str] = {}
        self.fail_save: set[int] = set()
        for entry in filter(None, (e.strip() for e in spec.split(","))):
            parts = entry.split("@")
            if len(parts) == 3:
                if parts[2] != f"rank{rank}":
                    continue
            elif len(parts) != 2:
                raise ValueError(f"{ENV}: bad entry '{entry}'")
            what, where = parts[0], parts[1]
            if what in ("nan", "nan!"):
                first, _, last = where.partition("-")
                steps = range(int(first), int(last or first) + 1)
                (self.nan_always if what == "nan!" else self.nan_once).update(steps)
            elif what == "kill" and where.startswith("step:"):
                self.kill_step.add(int(where[5:]))
            elif what == "kill" and where.startswith("save:"):
                step, _, phase = where[5:].partition(":")
                if phase not in ("state", "manifest", "pointer"):
                    raise ValueError(f"{ENV}: bad save phase in '{entry}'")
                self.kill_save[int(step)] = phase
            elif what == "fail" and where.startswith("save:"):
                self.fail_save.add(int(where[5:]))
            else:
                raise ValueError(f"{ENV}: bad entry '{entry}'")

    @classmethod
    def from_env(cls, rank: int) -> "Faults | None":
        spec = os.environ.get(ENV, "")
        return cls(spec, rank) if spec.strip() else None

    def nan_loss(self, step: int) -> bool:
        if step in self.nan_always:
            return True
        if step in self.nan_once:
            self.nan_once.discard(step)
            return True
        return False

    def in_step(self, step: int) -> None:
        if step in self.kill_step:
            _kill()

    def in_save(self, step: int, phase: str, directory: str) -> None:
        if self.kill_save.get(step) == phase:
            _kill()
        if phase == "state" and step in self.fail_save:
            with open(os.path.join(directory, "partial.bin"), "wb") as fh:
                fh.write(b"\0" * 1024)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), directory)


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
