"""Fault injection for the reliability tests: a test sets FP8TRAIN_FAULTS and runs the trainer
through tests/support/train_with_faults.py, which installs these faults from outside the package
(wrapping the loop's and the checkpoint writer's functions) before it calls the real entry
point; a real training process then fails at exactly the point the test names. fp8train itself
knows nothing of this.

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
    usr1@step:S      send this process a real SIGUSR1 in step S (where kill@step fires)
    usr1@eval:S      ... as the evaluation of step S starts
    usr1@save:S      ... while the checkpoint of step S is written (its files, no manifest)
    kill@asyncsave:S SIGKILL it from the background writer of step S (checkpoint_async), with
                     the model file written and the optimizer's not yet, once training has
                     gone on past step S+1 (the write is in flight while the run trains)
    usr1@asyncsave:S send a real SIGUSR1 from there once the loop runs step S+1 (so the stop
                     is that step's, never the save's own), then hold the write 3 s more: the
                     stop reaches its wait while the write is still in flight
    (kill@save:S:P also fires in a background write, in the writer thread: its phase `state`
    comes once the model and optimizer files are written.)
    broken_fp8@M     the native backend's FP8 deliberately broken: E5M2 in the forward too,
                     and M more bits of margin than fp8_margin (values underflow to zero)
    Any entry may end in @rankR to fire on that rank only.
"""
from __future__ import annotations

import errno
import os
import signal
import time

ENV = "FP8TRAIN_FAULTS"


class Faults:
    def __init__(self, spec: str, rank: int):
        self.nan_once: set[int] = set()
        self.nan_always: set[int] = set()
        self.kill_step: set[int] = set()
        self.kill_save: dict[int, str] = {}
        self.fail_save: set[int] = set()
        self.kill_async: set[int] = set()
        self.usr1: dict[str, set[int]] = {"step": set(), "eval": set(), "save": set(),
                                          "asyncsave": set()}
        self.broken_fp8: "int | None" = None
        self.current_step = 0   # the optimizer step the loop is running (install_step_faults)
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
            elif what == "kill" and where.startswith("asyncsave:"):
                self.kill_async.add(int(where[10:]))
            elif what == "fail" and where.startswith("save:"):
                self.fail_save.add(int(where[5:]))
            elif what == "broken_fp8":
                self.broken_fp8 = int(where)
            elif what == "usr1" and where.partition(":")[0] in self.usr1:
                place, _, step = where.partition(":")
                self.usr1[place].add(int(step))
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
        self.signal("step", step)

    def signal(self, place: str, step: int) -> None:
        if step in self.usr1[place]:
            self.usr1[place].discard(step)
            os.kill(os.getpid(), signal.SIGUSR1)

    def in_save(self, step: int, phase: str, directory: str) -> None:
        if phase == "model":   # a background write, between its model and optimizer files
            if step in self.kill_async:
                self.wait_for_step(step + 2)
                _kill()
            if step in self.usr1["asyncsave"]:
                self.usr1["asyncsave"].discard(step)
                self.wait_for_step(step + 1)
                os.kill(os.getpid(), signal.SIGUSR1)
                time.sleep(3)
            return
        if self.kill_save.get(step) == phase:
            _kill()
        if phase == "state":
            self.signal("save", step)
        if phase == "state" and step in self.fail_save:
            with open(os.path.join(directory, "partial.bin"), "wb") as fh:
                fh.write(b"\0" * 1024)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), directory)


    def wait_for_step(self, step: int, timeout: float = 120) -> None:
        """Until the loop runs optimizer step `step` (from another thread than the loop's)."""
        t0 = time.monotonic()
        while self.current_step < step and time.monotonic() - t0 < timeout:
            time.sleep(0.01)


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def install(faults: "Faults | None") -> None:
    """Wrap fp8train's functions so that `faults` fire where they name (for the whole process:
    tests/support/train_with_faults.py calls this before the trainer starts)."""
    if faults is None:
        return
    install_step_faults(faults)
    install_save_faults(faults)
    if faults.broken_fp8 is not None:
        install_broken_fp8(faults.broken_fp8)
    from fp8train.evaluate.evaluator import Evaluator
    _wrap(Evaluator, "run", before=lambda self, model, st, *_, **__: faults.signal("eval", st.step))


def _wrap(owner, name, setattr_=setattr, before=None, after=None):
    import functools
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapped(*args, **kwargs):
        if before:
            before(*args, **kwargs)
        out = original(*args, **kwargs)
        if after:
            after(*args, **kwargs)
        return out
    setattr_(owner, name, wrapped)


def install_step_faults(faults: "Faults") -> None:
    """nan@: the loop's step_loss, for the step the loop is running; kill@step: the gradient
    clipping, after backward, before the update (and before the clip's collectives)."""
    from accelerate import Accelerator

    from fp8train.train import loop
    current = {"step": 0, "nan": False}
    step_loss = loop.step_loss

    def step_starts(trainer, *_):
        current["step"] = faults.current_step = trainer.st.step + 1
        current["nan"] = faults.nan_loss(current["step"])

    def nan_loss(*args, **kwargs):
        loss, ce, penalty = step_loss(*args, **kwargs)
        if current["nan"]:
            loss, ce = loss * float("nan"), ce * float("nan")
        return loss, ce, penalty

    loop.step_loss = nan_loss
    _wrap(loop.Trainer, "train_step", before=step_starts)
    _wrap(Accelerator, "clip_grad_norm_", before=lambda *_, **__: faults.in_step(current["step"]))


def install_save_faults(faults, setattr_=setattr) -> None:
    """kill@save, fail@save, *@asyncsave: `faults.in_save(step, phase, where)` after each phase
    of the checkpoint writer: the state files written (no manifest), the manifest written
    (before the rename), renamed into place (before `latest` is updated). `setattr_`: pytest's
    monkeypatch.setattr for a test in this process."""
    from fp8train.checkpoint.manager import CheckpointManager as M
    _wrap(M, "_write_state", setattr_, after=lambda self, acc, tmp, state, *_:
          faults.in_save(state.step, "state", tmp))
    _wrap(M, "_write_manifest", setattr_, after=lambda self, tmp, step, *_:
          faults.in_save(step, "manifest", tmp))
    _wrap(M, "_move_into_place", setattr_, after=lambda self, tmp, final, step, *_:
          faults.in_save(step, "pointer", final))
    # A background save (checkpoint_async): its writer thread writes the model file, then the
    # optimizer's; `state` (every file written, no manifest) comes after the second.
    _wrap(M, "_write_model_copy", setattr_, after=lambda self, tmp, step, *_:
          faults.in_save(step, "model", tmp))
    _wrap(M, "_write_optimizer_copy", setattr_, after=lambda self, tmp, step, *_:
          faults.in_save(step, "state", tmp))


def install_broken_fp8(extra_margin: int) -> None:
    """broken_fp8@M: native FP8 with E5M2 (2 mantissa bits) for inputs and weights, and every
    scale 2^M smaller than fp8_margin makes it."""
    from fp8train.precision import native
    from fp8train.precision.scaling import E5M2
    native.FORMATS = dict(native.FORMATS, hybrid=(E5M2, E5M2))
    update = native.update_delayed_scaling
    native.update_delayed_scaling = lambda history, scale, fp8_max, margin, algo: update(
        history, scale, fp8_max, margin + extra_margin, algo)
