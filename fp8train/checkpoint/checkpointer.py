"""When the run saves, how (synchronously, or in the background with checkpoint_async), what a
failed save means, and whether saves fit the preemption window (manager.py: the format on
disk, atomic writes; verify.py: verification; stop_window.py: the window).

A checkpoint is taken at the interval, at a stop and at the end. A periodic one is not taken in
the middle of a streak of non-finite steps (FP8 scale state may be poisoned: a rollback must
never land there). A write that fails leaves the previous checkpoint as it was; the run warns
and goes on, unless it was its last chance or checkpoint_required is set.

With checkpoint_async, a periodic checkpoint is copied into host memory at the step and written
by a background thread while training goes on; the run waits for that write at its wait points:
the next save (before it copies anything), a rollback (before it restores), and a final save (a
stop, the end, a target reached: it waits, then saves synchronously), and at the end of the run.
A background write that failed is reported at the next wait point, under the same policy as a
failed save. Every save logs its duration and size (checkpoint/save_s, checkpoint/size_gb,
checkpoint/blocked_s: how long training waited), a background one also what the write cost
training while it ran (checkpoint/stall_max_s, the longest the training thread could not run,
measured by write_stall.StallWatch; checkpoint/overlap_steps, the steps trained meanwhile), and
the first one that takes more than half of the window a stop signal leaves (checkpoint_window_s,
or the SLURM job's --signal) is warned about, once; so is, at start, a resumed checkpoint whose
recorded save took that long. A safetensors that holds the GIL while it writes (before 0.8)
would stop training for the whole model write: checkpoint_async is then off, with one warning.
"""
from __future__ import annotations

import time

from ..errors import RunFailed
from ..ranks import on_rank0
from .background import BackgroundSave
from .files import directory_bytes, read_manifest
from .manager import CheckpointManager, CheckpointWriteError
from .stop_window import find_window
from .write_stall import safetensors_holds_gil

# Distribution layouts whose save path writes collectively (FSDP's sharded state goes through
# torch.distributed.checkpoint inside Accelerate): no background copy of theirs.
NO_BACKGROUND = ("FSDP", "DEEPSPEED", "MEGATRON_LM", "XLA")


class Checkpointer:
    def __init__(self, ck, manager: CheckpointManager, accelerator, log, config_text: str,
                 run_hash: str, resumed: str | None = None, window=find_window, model=None,
                 optimizer=None, components: "dict | None" = None):
        """`ck`: the config's checkpoint section; `resumed`: the checkpoint the run resumed
        from; `window(configured)`: (seconds, where from) of the preemption window (asked once,
        on rank 0); `model`, `optimizer`: as Accelerate prepared them (before torch.compile),
        what a background save copies; `components`: {name: an object with state_dict and
        load_state_dict} whose states every checkpoint keeps (and `restore` loads)."""
        self.ck, self.manager, self.acc, self.log = ck, manager, accelerator, log
        self.components = dict(components or {})
        self.model, self.optimizer = model, optimizer
        self.config_text, self.run_hash = config_text, run_hash
        self.background = bool(ck.in_background)
        layout = getattr(accelerator.distributed_type, "value", accelerator.distributed_type)
        if self.background and layout in NO_BACKGROUND:
            self.background = False
            log.warn(f"checkpoint_async: not available under {layout} "
                     "(every rank writes its shards collectively, through "
                     "torch.distributed.checkpoint): each checkpoint is written before training "
                     "goes on")
        # Rank 0 writes in the background: its safetensors decides, for every rank (the save
        # paths differ in their collectives).
        old = on_rank0(safetensors_holds_gil, "checking safetensors") if self.background \
            else None
        if old:
            self.background = False
            log.warn(f"checkpoint_async: not available with safetensors {old}, which holds the "
                     "GIL while it writes model.safetensors and would stop training for the "
                     "whole write: each checkpoint is written before training goes on; "
                     "pip install 'safetensors>=0.8' (it releases the GIL) to write them in the "
                     "background")
        self.copier = None
        if self.background:
            from .host_copy import HostCopy
            self.copier = HostCopy()
        self.pending: BackgroundSave | None = None
        self._said = False        # the pending write's outcome was logged (by poll)
        self._state = None        # the run's train state, whose step poll reads
        self.window, self.window_source, self._warned = None, "", False
        if accelerator.is_main_process:
            self.window, where = window(ck.window_s)
            self.window_source = where
            log.file_only(f"preemption window: {self.window:g} s ({where})" if self.window else
                          f"preemption window unknown ({where}): checkpoint saves are timed, "
                          "not compared with it")
            saved_s = read_manifest(resumed).get("save_s") if resumed else None
            if isinstance(saved_s, (int, float)) and not isinstance(saved_s, bool):
                self._check_window(saved_s, "the checkpoint this run resumed from "
                                   f"('{resumed}') took")

    def due(self, step: int, last: bool, stopping: bool) -> bool:
        return step % self.ck.interval == 0 or last or stopping

    def latest(self):
        return self.manager.latest()

    def restore(self, path: str, st) -> None:
        """Checkpoint `path` back into the run: model, optimizer, RNG, the counters `st`, and
        the components' own states."""
        self.manager.restore(self.acc, path, st, self.components)

    def save(self, st, final: bool, wall_seconds: float, in_streak) -> bool:
        """Save the run at st.step; False when it was skipped or failed (and may be). A final
        save (a stop, the end) is always written before it returns; a periodic one with
        checkpoint_async is started and written in the background (True: started).
        `in_streak()`: whether the latest steps were non-finite (a host sync: asked only for a
        periodic checkpoint)."""
        if not final and in_streak():
            self.log.warn(f"no checkpoint at step {st.step:,}: the latest steps had non-finite "
                          "gradients; the next interval will try again")
            return False
        entered = time.perf_counter()
        self.wait(st)                    # the previous background write, published or failed
        background = self.background and not final
        st.checkpoints_written += 1      # counted inside the checkpoint it describes
        st.wall_seconds = wall_seconds
        meta = dict(tokens=st.tokens, config_hash=self.run_hash)
        if background:
            meta["async"] = True
        t0 = time.perf_counter()
        if background:
            try:
                job = self.manager.save_in_background(self.acc, st, self.config_text, meta,
                                                      self.copier, t0, self.model,
                                                      self.optimizer, self.components)
            except CheckpointWriteError as e:
                # The copy into host memory (a pinned-memory limit) or the small files failed,
                # on some rank: this checkpoint is written now, and every later one too.
                self.log.warn(f"{e}: checkpoint_async is off for the rest of the run; this "
                              "checkpoint is written before training goes on")
                self.background, self.copier, background = False, None, False
                meta.pop("async")
                t0 = time.perf_counter()
        try:
            if not background:
                path = self.manager.save(self.acc, st, self.config_text, meta, started=t0,
                                         components=self.components)
        except CheckpointWriteError as e:
            st.checkpoints_written -= 1
            self._failed(e, final)
            return False
        blocked = time.perf_counter() - entered
        if not background:
            self._saved(st.step, st.tokens, path, time.perf_counter() - t0, blocked)
            return True
        job.blocked_s, job.tokens = blocked, st.tokens
        self.pending, self._said, self._state = job, False, st
        if self.acc.is_main_process:
            self.log.file_only(f"checkpoint step {st.step:,}: copied to host memory "
                               f"({self.copier.nbytes / 1e9:,.2f} GB, kept for the next save); "
                               f"training waited {blocked:.2f} s; written in the background")
        return True

    def poll(self) -> None:
        """Called after every step. A background write that has finished is said and logged
        now, on rank 0 (no collective: whether it failed is agreed at the next wait point, and a
        failure is said there); one still in flight counts the steps trained since it started
        (every one of them ran while it was being written)."""
        job = self.pending
        if job is None or self._said or not self.acc.is_main_process:
            return
        if not job.done():
            job.overlap_steps = self._state.step - job.step
            return
        if job.error is not None:
            return
        self._said = True
        self._saved(job.step, job.tokens, job.path, job.save_s, job.blocked_s, job=job)

    def wait(self, st=None, final: bool = False) -> None:
        """A wait point: the background write in flight, if any, finished and its outcome
        agreed by every rank (collective: every rank calls it at the same point), then logged;
        a failed one is handled as a failed periodic save (a warning, or with
        checkpoint_required the end of the run). `st`: the train state, whose count of
        checkpoints a failed write takes back; `final`: the run ends here (a stop signal that
        came while the write was being started): a failed write of the run's current step is
        written again, synchronously (nothing trained since), and one that fails again ends the
        run with exit 1."""
        job, self.pending = self.pending, None
        if job is None:
            return
        if not job.done():
            self.log.msg(f"waiting for the checkpoint of step {job.step:,}, which is being "
                         "written in the background")
            if self._state is not None:   # every step up to here ran during the write
                job.overlap_steps = self._state.step - job.step
        error = job.wait()
        if error is not None:
            failure = self.manager.write_error(job.step, error)
            if st is not None:
                st.checkpoints_written -= 1
            if final and st is not None and st.step == job.step:
                self.log.warn(f"{failure}; writing it again before the run ends")
                self.save(st, True, st.wall_seconds, lambda: False)
                return
            self._failed(failure, final)
        elif not self._said:
            self._saved(job.step, job.tokens, job.path, job.save_s, job.blocked_s, job=job)

    def _saved(self, step: int, tokens: int, path: str, save_s: float, blocked_s: float,
               job: BackgroundSave | None = None) -> None:
        """A checkpoint published (`job`: written in the background): the console line, its row
        (rank 0 measures its size on disk), the window check. Rank 0 only: the other ranks know
        nothing of the write."""
        if not self.acc.is_main_process:
            return
        row = {"step": step, "tokens": tokens, "checkpoint/save_s": round(save_s, 3),
               "checkpoint/size_gb": directory_bytes(path) / 1e9,
               "checkpoint/blocked_s": round(blocked_s, 3)}
        if job is None:
            self.log.msg(f"checkpoint step {step:,} saved ({save_s:.1f} s)")
        else:
            steps = job.overlap_steps
            meanwhile = f"then trained {steps:,} step{'s' if steps != 1 else ''} during the write"
            row["checkpoint/overlap_steps"] = steps
            if job.stall_s is not None:
                meanwhile += f", stalled {job.stall_s:.2f} s at most"
                row["checkpoint/stall_max_s"] = round(job.stall_s, 3)
            self.log.msg(f"checkpoint step {step:,} saved in the background ({save_s:.1f} s; "
                         f"training waited {blocked_s:.1f} s, {meanwhile})")
        self.log.file_only(f"checkpoint: {path}")
        self.log.log(row)
        self._check_window(save_s, f"checkpoint step {step:,} took")

    def _check_window(self, save_s: float, what: str) -> None:
        """One warning per run when a save takes more than half the preemption window: a stop
        must finish its step, maybe wait for a background write, and save, inside it."""
        if self.window is None or self._warned or save_s <= self.window / 2:
            return
        self._warned = True
        more = f"sbatch --signal=B:USR1@{_suggest(save_s)}"
        remedy = (" (a stop also waits for a background write in flight: it can take two saves)"
                  if self.background else "; checkpoint_async: true with a shorter "
                  "checkpoint_interval makes a stop that runs out of time lose less")
        self.log.warn(f"{what} {save_s:.1f} s to save, over half of the {self.window:g} s a "
                      f"stop signal leaves before the kill ({self.window_source}): a stop may "
                      f"be killed before its checkpoint is complete, and the requeued job then "
                      f"resumes from the one before; give the stop more time ({more}) or write "
                      f"output_dir to faster storage{remedy}")

    def _failed(self, e, final: bool) -> None:
        """A save that failed: the previous checkpoint is intact; warn, or end the run when it
        was the last chance or checkpoint_required is set."""
        prev = self.manager.latest()
        intact = f"the previous checkpoint '{prev}' is intact" if prev else \
            "there is no earlier checkpoint"
        if final or self.ck.required:
            why = "checkpoint_required is true" if not final else \
                "it was the run's last checkpoint: the steps after the previous one are lost"
            raise RunFailed(f"{e}; {intact}; stopping because {why}") from None
        self.log.warn(f"{e}; {intact}; training goes on (checkpoint_required: true stops "
                      "instead)")


def _suggest(save_s: float) -> int:
    """A --signal time that leaves room for two saves and a step: 2.5 × the save, rounded up
    to a minute."""
    return int(-(-2.5 * save_s // 60) * 60)
