"""Checkpoints under <output_dir>/checkpoints/: step_NNNNNNN/ directories and a `latest` pointer.

A checkpoint (format 2) holds Accelerate's save_state files (model.safetensors, the model with
its FP8 state, or FSDP's pytorch_model_fsdp_0/; optimizer.bin or optimizer_0/; each rank's
random_states_N.pkl), train_state.json (the counters), config.yaml and manifest.json (format,
step, tokens, config hash, each file's size and SHA-256). Nothing is registered with Accelerate:
no object of ours is pickled, everything loads with safetensors, torch.load(weights_only=True)
(the RNG files with NumPy's generator array), json or yaml.

Writing is atomic, in four phases: the files go into .tmp-step_NNNNNNN/ (`_write_state`), are
fsynced and the manifest is written (`_write_manifest`), the directory is renamed into place
(`_move_into_place`), `latest` is replaced (`_point_latest`). A crash at any point leaves the
complete new checkpoint or none. A background save (`save_in_background`, checkpoint_async)
writes the same files through the same phases: at the step every rank writes its RNG states and
rank 0 copies the model and optimizer states into host memory; a thread of rank 0 then writes
those (`_write_model_copy`, `_write_optimizer_copy`) and publishes. Loading verifies the
manifest; a corrupt or partial checkpoint (any damage, a missing manifest included) is
reported, moved aside and the previous one used, while an intact one this version cannot
continue (another checkpoint format) is refused. Verification also checks what loading would
unpickle (`safe_load.unsafe_content`): a checkpoint from elsewhere cannot run code.
`path_problem` says, from directory listings alone, why a path given to resume or export holds
no checkpoint. Every file written gets the umask's mode.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from ..config.load import RESUME_FREE
from ..config.schema import upgrade_saved
from ..errors import BadInput, close_matches, one_line
from ..io import atomic_write
from ..ranks import first_error
from .safe_load import unsafe_content
from .train_state import TrainState

_STEP_DIR = re.compile(r"^step_(\d{7,})$")
LATEST = "latest"
CONFIG_NAME = "config.yaml"
MANIFEST = "manifest.json"
TRAIN_STATE = "train_state.json"
RUN_FILES = ("config.yaml", "train.log", "metrics.jsonl")   # a run directory has them first
MANIFEST_FORMAT = 2   # 1: the counters were Accelerate's custom_checkpoint_0.pkl, a pickle


class CheckpointWriteError(Exception):
    """A checkpoint could not be written (disk full, read-only, ...). The previous checkpoint is
    untouched."""


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
        from .write_stall import StallWatch
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


def step_dir_name(step: int) -> str:
    return f"step_{step:07d}"


def step_of(path: str) -> int:
    """The step of checkpoint directory `path` (…/step_NNNNNNN), the inverse of step_dir_name."""
    return int(_STEP_DIR.match(os.path.basename(os.path.normpath(path))).group(1))


def read_train_state(path: str) -> TrainState:
    """The counters of checkpoint `path`. BadInput, in one line, for a checkpoint this version
    cannot resume (`resume_refusal`) or an unreadable train_state.json."""
    refusal = resume_refusal(path)
    if refusal:
        raise BadInput(f"cannot resume from '{path}': {refusal}")
    try:
        with open(os.path.join(path, TRAIN_STATE), encoding="utf-8") as fh:
            return TrainState.from_dict(json.load(fh))
    except (OSError, ValueError) as e:   # json's errors are ValueErrors
        raise BadInput(f"cannot resume from '{path}': {TRAIN_STATE} cannot be read "
                          f"({one_line(e, with_type=True)})") from None


def resume_refusal(path: str) -> str | None:
    """Why checkpoint `path`, intact, cannot be resumed by this version: it was written by an
    older or a newer fp8train (its format). None when its format is this version's, and when
    it has no manifest but is not an older fp8train's (then it is damaged: `verify` says so)."""
    manifest = read_manifest(path)
    found = manifest.get("format")
    if not manifest:
        names = _names(path)
        if TRAIN_STATE in names or not any(n.startswith("custom_checkpoint_") for n in names):
            return None
        found = None
    elif found == MANIFEST_FORMAT:
        return None
    if isinstance(found, int) and found > MANIFEST_FORMAT:
        return (f"it was written by a newer fp8train (checkpoint format {found}; this version "
                f"resumes format {MANIFEST_FORMAT}); continue it with the fp8train that wrote it")
    what = f"checkpoint format {found}" if found else \
        "no manifest" if not manifest else "a manifest without a format"
    return (f"it was written by another version of fp8train ({what}; this version resumes "
            f"checkpoint format {MANIFEST_FORMAT}, whose training state is JSON); finish that "
            f"run with the fp8train that wrote it, or start a new run (export, sampling and "
            f"evaluation still read its model)")


def config_hash(values: dict) -> str:
    """What the run trains: every key a resume may not change (not in RESUME_FREE), canonically
    serialised."""
    kept = {k: v for k, v in sorted(values.items()) if k not in RESUME_FREE}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:16]


class CheckpointManager:
    def __init__(self, output_dir: str, keep: int):
        self.dir = os.path.join(output_dir, "checkpoints")
        self.keep = keep

    def complete(self) -> list[tuple[int, str]]:
        """(step, path) of every complete checkpoint, oldest first."""
        if not os.path.isdir(self.dir):
            return []
        found = []
        for name in os.listdir(self.dir):
            m = _STEP_DIR.match(name)
            if m and os.path.isdir(os.path.join(self.dir, name)):
                found.append((int(m.group(1)), os.path.join(self.dir, name)))
        return sorted(found)

    def latest(self) -> str | None:
        """The checkpoint `latest` points at; the newest complete one if the pointer is missing,
        unreadable or points at something that is gone."""
        name = self.pointer()
        if name and _STEP_DIR.match(name) and os.path.isdir(os.path.join(self.dir, name)):
            return os.path.join(self.dir, name)
        done = self.complete()
        return done[-1][1] if done else None

    def pointer(self) -> str | None:
        """What `latest` says, stripped; None when it is missing or cannot be read as text."""
        try:
            with open(os.path.join(self.dir, LATEST), encoding="utf-8") as fh:
                return fh.read(4096).strip()
        except (OSError, ValueError):   # a directory, unreadable, not UTF-8
            return None

    def candidates(self) -> list[str]:
        """Checkpoints to try on resume, newest first. A step directory exists only once its
        write completed (and its manifest says what complete means), so the newest one that
        verifies is the right one even when a crash came before `latest` was updated."""
        return [p for _, p in reversed(self.complete())]

    def set_aside(self, path: str) -> str | None:
        """Rename an unusable checkpoint out of the way (kept for inspection, never loaded or
        counted again). Returns the new path, or None if it could not be moved."""
        target = f"{path}.corrupt"
        if os.path.exists(target):
            target = f"{path}.corrupt-{int(time.time())}"
        try:
            os.replace(path, target)
        except OSError:
            return None
        return target

    def remove_partial_writes(self) -> list[str]:
        """Delete .tmp-* directories: checkpoint writes a crash interrupted."""
        if not os.path.isdir(self.dir):
            return []
        gone = [n for n in os.listdir(self.dir) if n.startswith(".tmp-")]
        for name in gone:
            shutil.rmtree(os.path.join(self.dir, name), ignore_errors=True)
        return gone

    def save(self, accelerator, state: TrainState, config_text: str, meta: dict,
             started: float | None = None) -> str:
        """Checkpoint of step `state.step`, with `state` and the run's resolved config (so that a
        resume can tell what changed), `meta` in the manifest. Collective: every rank calls it
        (each saves its own RNG state). Raises CheckpointWriteError on every rank when any
        rank's write failed; the previous checkpoint is left as it was. `started`: when the save
        began (time.perf_counter), for the manifest's `save_s`."""
        started = time.perf_counter() if started is None else started
        step, main = state.step, accelerator.is_main_process
        final = os.path.join(self.dir, step_dir_name(step))
        tmp = os.path.join(self.dir, f".tmp-{step_dir_name(step)}")
        error = first_error(_attempt(lambda: self._clear(tmp)) if main else None)
        # Any failure while the state is written is a failed write (torch.save reports ENOSPC
        # as a RuntimeError, safetensors as its own error type).
        if error is None:
            error = first_error(_attempt(
                lambda: self._write_state(accelerator, tmp, state, config_text), Exception))
        if error is None:
            error = first_error(_attempt(lambda: self._publish(tmp, final, step, meta, started))
                                if main else None)
        if error is not None:
            if main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise self.write_error(step, error)
        return final

    def save_in_background(self, accelerator, state: TrainState, config_text: str, meta: dict,
                           copier, started: float, model, optimizer) -> "BackgroundSave":
        """The same checkpoint as `save`, written by a background thread of rank 0 while
        training goes on. Here, at the step, every rank writes its small files (RNG states,
        through Accelerate's own function, as of this step) into .tmp-step_N/ and rank 0 the
        counters and the config, and copies the model and optimizer states into host memory
        (`copier`, a HostCopy; `model` and `optimizer`: the run's, as Accelerate prepared them,
        the only objects it was given); the thread then writes those two with Accelerate's own save
        helper and file names and publishes the checkpoint in the usual phases (manifest,
        rename, `latest`, pruning). Collective, like `save`: CheckpointWriteError on every rank
        when the part done here failed on any. The thread does no collective: its outcome is
        agreed when the caller waits for it (`BackgroundSave.wait`). The caller waits for the
        previous one before it calls this (the copies' buffers are reused)."""
        step, main = state.step, accelerator.is_main_process
        final = os.path.join(self.dir, step_dir_name(step))
        tmp = os.path.join(self.dir, f".tmp-{step_dir_name(step)}")
        error = first_error(_attempt(lambda: self._clear(tmp)) if main else None)
        copies = {}
        if error is None:
            error = first_error(_attempt(lambda: copies.update(self._write_small_state(
                accelerator, tmp, state, config_text, copier, model, optimizer)), Exception))
        if error is not None:
            if main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise self.write_error(step, error)
        job = BackgroundSave(step, final, started)
        if main:
            job.start(lambda: self._write_in_background(tmp, final, step, meta, started,
                                                        copies["models"], copies["optimizers"]))
        return job

    def write_error(self, step: int, error: str) -> CheckpointWriteError:
        return CheckpointWriteError(f"checkpoint of step {step:,} could not be written to "
                                    f"'{self.dir}' ({error}; {_free_space(self.dir)})")

    def restore(self, accelerator, path: str, state: TrainState) -> None:
        """Load checkpoint `path` (verified) into the prepared model and optimizer and every
        rank's RNG (Accelerate's load_state), and its counters into `state`. BadInput for a
        checkpoint of another format, before anything is loaded; what load_state raises (a
        checkpoint of another model) passes through."""
        saved = read_train_state(path)
        accelerator.load_state(path)
        vars(state).update(vars(saved))

    def _clear(self, tmp: str) -> None:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(self.dir, exist_ok=True)

    def _write_state(self, accelerator, tmp: str, state: TrainState, config_text: str) -> None:
        """Phase 1, every rank: Accelerate's files (rank 0: model, optimizer; each rank its RNG
        states), then rank 0 the counters and the config."""
        accelerator.save_state(tmp)
        if accelerator.is_main_process:
            self._write_counters(tmp, state, config_text)

    @staticmethod
    def _write_counters(tmp: str, state: TrainState, config_text: str) -> None:
        with open(os.path.join(tmp, TRAIN_STATE), "w", encoding="utf-8") as fh:
            json.dump(state.to_dict(), fh, indent=1, sort_keys=True)
            fh.write("\n")
        with open(os.path.join(tmp, CONFIG_NAME), "w", encoding="utf-8") as fh:
            fh.write(config_text)

    def _write_small_state(self, accelerator, tmp: str, state: TrainState, config_text: str,
                           copier, model, optimizer) -> dict:
        """Phase 1, at the step, for a background save: Accelerator.save_state's work split in
        two. Here, what it writes besides the model and optimizer files, with the same function
        (save_accelerator_state given no model and no optimizer: each rank's RNG states as of
        this step, and the GradScaler's), and rank 0's counters and config. Rank 0 returns host copies of what save_state would
        write as model.safetensors and optimizer.bin (the same state dicts, taken the same way),
        for `_write_in_background`; the other ranks write neither file, as with save_state."""
        from accelerate.checkpointing import save_accelerator_state
        acc = accelerator
        os.makedirs(tmp, exist_ok=True)   # as save_state makes it
        # The run prepares one model and one optimizer and registers nothing else with
        # Accelerate (no scheduler, dataloader, custom object or save hook): save_state would
        # write exactly these, and a test compares the files byte for byte.
        weights = [acc.get_state_dict(model, unwrap=False)]
        save_accelerator_state(tmp, [], [], [], [], acc.process_index, acc.step, acc.scaler,
                               save_on_each_node=acc.project_configuration.save_on_each_node,
                               safe_serialization=True)
        acc.project_configuration.iteration += 1   # as save_state counts its saves
        if not acc.is_main_process:
            return {}
        self._write_counters(tmp, state, config_text)
        models, optimizers = copier.copy((weights, [optimizer.state_dict()]))
        return dict(models=models, optimizers=optimizers)

    def _write_in_background(self, tmp: str, final: str, step: int, meta: dict,
                             started: float, models: list, optimizers: list) -> None:
        """The background thread of a background save (rank 0): the model and optimizer files
        from their host copies, then phases 2 to 4. A failure removes the partial write and is
        raised to BackgroundSave, which reports it when the run waits for it."""
        try:
            self._write_model_copy(tmp, step, models)
            self._write_optimizer_copy(tmp, step, optimizers)
            self._publish(tmp, final, step, meta, started)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _write_model_copy(self, tmp: str, step: int, models: list) -> None:
        """model.safetensors (model_N.safetensors for more models), as save_accelerator_state
        names and writes them."""
        from accelerate.utils import SAFE_WEIGHTS_NAME, save
        for i, weights in enumerate(models):
            name = SAFE_WEIGHTS_NAME if i == 0 else SAFE_WEIGHTS_NAME.replace(".", f"_{i}.")
            save(weights, os.path.join(tmp, name), safe_serialization=True)

    def _write_optimizer_copy(self, tmp: str, step: int, optimizers: list) -> None:
        """optimizer.bin (optimizer_N.bin for more), as save_accelerator_state writes them."""
        from accelerate.utils import OPTIMIZER_NAME, save
        for i, opt_state in enumerate(optimizers):
            name = f"{OPTIMIZER_NAME}.bin" if i == 0 else f"{OPTIMIZER_NAME}_{i}.bin"
            save(opt_state, os.path.join(tmp, name), safe_serialization=False)

    def _publish(self, tmp: str, final: str, step: int, meta: dict,
                 started: float | None = None) -> None:
        """Phases 2 to 4, rank 0."""
        self._write_manifest(tmp, step, meta, started)
        old = self._move_into_place(tmp, final, step)
        self._point_latest(final, old)

    def _write_manifest(self, tmp: str, step: int, meta: dict,
                        started: float | None = None) -> None:
        """Phase 2: every file fsynced, then the manifest (each file's size and SHA-256, and
        `save_s`: the seconds from the save's start to here, nearly all of its time, so that a
        resumed run knows how long its checkpoint took)."""
        give_normal_mode([tmp])
        files = _checksums(tmp)
        _fsync_tree(tmp)
        timing = {} if started is None else \
            dict(save_s=round(time.perf_counter() - started, 3))
        manifest = dict(format=MANIFEST_FORMAT, step=step, **meta, **timing, files=files,
                        written=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        atomic_write(os.path.join(tmp, MANIFEST), json.dumps(manifest, indent=1) + "\n",
                     fsync=True)

    def _move_into_place(self, tmp: str, final: str, step: int) -> str | None:
        """Phase 3: the directory renamed to step_N. A step saved again (after a rollback) keeps
        its old directory, returned, until `latest` no longer needs it."""
        old = None
        if os.path.isdir(final):
            old = f"{final}.old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync(self.dir)
        return old

    def _point_latest(self, final: str, old: str | None) -> None:
        """Phase 4: `latest` names the new checkpoint; the one it replaced and those beyond
        keep_checkpoints go."""
        atomic_write(os.path.join(self.dir, LATEST), os.path.basename(final) + "\n", fsync=True)
        _fsync(self.dir)
        if old:
            shutil.rmtree(old, ignore_errors=True)
        self._prune()

    def _prune(self) -> None:
        if self.keep <= 0:
            return
        for _, path in self.complete()[:-self.keep]:
            shutil.rmtree(path, ignore_errors=True)


# Read errors that say for certain what is on disk; any other (EIO, ESTALE, EACCES) does not.
_CERTAIN = (FileNotFoundError, IsADirectoryError, NotADirectoryError)


def verify(path: str, resume: bool = False) -> tuple[str | None, str]:
    """(problem, note): problem is None when the checkpoint is complete, every file matches its
    manifest and nothing in it could run code when loaded (`unsafe_content`: a checksum does not
    tell a crafted checkpoint, whose author writes the manifest too); note: what was checked.
    A checkpoint without a manifest is read unverified for its model (an older fp8train wrote
    none), but never resumed (`resume`): this version writes the manifest before the directory
    gets its name, so a step directory without one is damaged or a partial copy.

    A read that fails for any reason but a missing file (EIO, ESTALE, EACCES: a network
    filesystem's hiccup, a permission) proves nothing about the checkpoint: that is a
    BadInput, so that an intact checkpoint is never moved aside for it."""
    try:
        return _verify(path, resume)
    except OSError as e:
        if isinstance(e, _CERTAIN):   # vanished, or not what was written, while checked
            return f"cannot be read ({one_line(e, with_type=True)})", ""
        raise BadInput(f"checkpoint '{path}' cannot be read ({one_line(e, with_type=True)}); nothing was "
                          f"moved aside: check the filesystem and try again") from None


def _verify(path: str, resume: bool) -> tuple[str | None, str]:
    names = os.listdir(path)
    if MANIFEST not in names:
        if not any(f.startswith(("model", "pytorch_model")) for f in names):
            return ("empty" if not names else "no manifest and no model files"), ""
        if resume:
            return (f"no {MANIFEST}: every checkpoint this version writes has one, so it is "
                    f"damaged or an incomplete copy"), ""
        unsafe = unsafe_content(path)
        if unsafe:
            return unsafe, ""
        return None, "no manifest (written by an older fp8train): not verified"
    try:
        with open(os.path.join(path, MANIFEST), encoding="utf-8") as fh:
            files = json.load(fh)["files"]
        if not isinstance(files, dict) or not all(
                isinstance(w, dict) and isinstance(w.get("size"), int)
                and isinstance(w.get("sha256"), str) for w in files.values()):
            raise ValueError("its file list is not {name: {size, sha256}}")
    except (*_CERTAIN, ValueError, KeyError, TypeError) as e:
        return f"unreadable manifest ({one_line(e, with_type=True)})", ""
    t0, total = time.time(), 0
    for rel, want in files.items():
        full = os.path.join(path, rel)
        try:
            size = os.stat(full).st_size
        except _CERTAIN:
            return f"file '{rel}' is missing", ""
        if not os.path.isfile(full):
            return f"file '{rel}' is missing", ""
        if size != want["size"]:
            return f"file '{rel}' has {size:,} bytes, the manifest says {want['size']:,}", ""
        total += size
    actual = _checksums(path, only=list(files))
    for rel, want in files.items():
        if actual[rel]["sha256"] != want["sha256"]:
            return f"file '{rel}' does not match its checksum", ""
    unsafe = unsafe_content(path)   # after the checksums: a torn write reads as corrupt
    if unsafe:
        return unsafe, ""
    return None, (f"verified {len(files)} files, {total / 2**20:,.1f} MiB, in "
                  f"{time.time() - t0:.1f} s")


def read_manifest(path: str) -> dict:
    """The manifest of checkpoint `path`; {} when it has none that can be read."""
    try:
        with open(os.path.join(path, MANIFEST), encoding="utf-8") as fh:
            manifest = json.load(fh)
    except (OSError, ValueError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def resolve_resume(resume: str, manager: CheckpointManager, warn=None, info=None,
                   announce: bool = True) -> str | None:
    """The checkpoint to load (verified), or None to start fresh. `warn(msg)` hears about every
    checkpoint skipped as unusable and, with `announce` (auto was asked for, not implied by a
    sweep trial's first start), about an `auto` that finds nothing: a mistyped output_dir must
    not pass for a new run unnoticed. `info(msg)`: what was verified. Starting fresh on top of
    an earlier run's checkpoints is refused: that would mix two runs in one directory."""
    warn = warn or (lambda msg: None)
    info = info or (lambda msg: None)
    if os.path.exists(manager.dir) and not os.path.isdir(manager.dir):
        raise BadInput(f"'{manager.dir}' is a file: a run keeps its checkpoints in a "
                          f"directory of that name; move the file away")
    if resume == "never":
        existing = manager.latest()
        if existing is not None:
            raise BadInput(
                f"output_dir already holds checkpoints (latest: '{existing}'); pass --resume to "
                f"continue that run, or a new --output_dir to start another")
        return None
    if resume == "auto":
        manager.remove_partial_writes()
        pointer = _pointer_problem(manager)   # before anything unusable is moved aside
        found = _first_usable(manager, warn, info, own=True)
        if found is None and announce:
            warn(f"resume auto: no checkpoint in '{manager.dir}' "
                 f"({'empty' if os.path.isdir(manager.dir) else 'it does not exist'})"
                 f"{_did_you_mean(os.path.dirname(manager.dir), sibling=True)}; starting a "
                 f"new run")
        elif pointer:
            warn(f"{pointer}; resuming from the newest checkpoint that verifies, '{found}'")
        return found
    return find_checkpoint(resume, "key 'resume'", warn, info, resume=True,
                           hint=" (--resume auto picks the newest good checkpoint of a run)")


def find_checkpoint(path: str, what: str = "", warn=None, info=None,
                    hint: str = " (pass the run directory to use its newest good checkpoint)",
                    resume: bool = False) -> str:
    """`path` verified, when it is a checkpoint directory; the newest checkpoint that verifies,
    when it is a run directory. BadInput (prefixed with `what`, the key or argument)
    otherwise. `resume`: the checkpoint is to be resumed, not only read (`verify`,
    `resume_refusal`)."""
    warn = warn or (lambda msg: None)
    info = info or (lambda msg: None)
    pre = f"{what}: " if what else ""
    wrong = path_problem(path)
    if wrong:
        raise BadInput(pre + wrong)
    if _is_run_dir(path):   # its newest good checkpoint
        found = _first_usable(CheckpointManager(path, 0), warn, info, own=False, resume=resume)
        if found is None:
            raise BadInput(f"{pre}run directory '{path}' holds no checkpoint")
        return found
    if resume:
        refusal = resume_refusal(path)
        if refusal:
            raise BadInput(f"{pre}cannot resume from '{path}': {refusal}")
    problem, note = verify(path, resume=resume)
    if problem and resume and MANIFEST not in _names(path):
        raise BadInput(f"{pre}cannot resume from '{path}': {problem}")
    if problem:
        raise BadInput(f"{pre}checkpoint '{path}' is unusable: {problem}{hint}")
    info(f"checkpoint {path}: {note}")
    return path


def is_checkpoint_dir(path: str) -> bool:
    """model.safetensors (DDP, one process) or pytorch_model_fsdp_0/ (FSDP's sharded state)."""
    return os.path.isdir(path) and any(f.startswith(("model", "pytorch_model"))
                                       for f in _names(path))


def path_problem(path: str) -> str | None:
    """Why `path` is neither a checkpoint directory nor a run directory with a checkpoint, in
    words that say what was looked for and, when a neighbour is one, which. Reads directory
    listings only (no checksums, no torch): the config check runs it before anything loads."""
    if not os.path.exists(path):
        return f"checkpoint '{path}' not found{_did_you_mean(path, sibling=True)}"
    if os.path.isfile(path):
        parent = os.path.dirname(path) or "."
        mean = f" (did you mean its directory '{parent}'?)" if is_checkpoint_dir(parent) else ""
        return (f"'{path}' is not a checkpoint directory: it is a file; name a checkpoint "
                f"directory (checkpoints/step_N) or a run directory{mean}")
    looked = os.path.join(path, "checkpoints")
    if _is_run_dir(path):
        if any(_STEP_DIR.match(n) for n in _names(looked)):
            return None
        return (f"run directory '{path}' holds no checkpoint ('{looked}' has no step_N "
                f"directory){_did_you_mean(path, sibling=True)}")
    if is_checkpoint_dir(path):
        return None
    steps = sorted(n for n in _names(path) if _STEP_DIR.match(n))
    if steps:
        run = os.path.dirname(os.path.normpath(path)) or "."
        return (f"'{path}' is not a checkpoint directory: it holds checkpoints (did you mean the "
                f"run directory '{run}', or '{os.path.join(path, steps[-1])}'?)")
    names = _names(path)
    if MANIFEST in names or TRAIN_STATE in names:
        return (f"checkpoint '{path}' has no model state (model.safetensors or "
                f"pytorch_model_fsdp_0/): it is incomplete")
    if any(n in RUN_FILES for n in names):
        return (f"run directory '{path}' holds no checkpoint (no checkpoints/ in it: the run "
                f"saved none)")
    empty = "it is empty" if not names else \
        "it has no model.safetensors and no checkpoints/"
    return (f"'{path}' is not a checkpoint directory (nor a run directory with checkpoints/): "
            f"{empty}{_did_you_mean(path)}")


def _did_you_mean(path: str, sibling: bool = False) -> str:
    """' (did you mean ...?)' naming run directories that hold checkpoints: inside `path`, and
    with `sibling`, beside it under a similar name (a typo); '' when there is none."""
    path = os.path.normpath(path)
    parent = os.path.dirname(path) or "."
    near = []
    if sibling:
        names = [n for n in _names(parent) if _holds_checkpoints(os.path.join(parent, n))
                 or is_checkpoint_dir(os.path.join(parent, n))]
        near = [os.path.join(parent, n) if parent != "." else n for n in
                close_matches(os.path.basename(path), names, n=3)]
    near += [os.path.join(path, n) for n in sorted(_names(path))
             if _holds_checkpoints(os.path.join(path, n))][:3]
    return f" (did you mean {' or '.join(repr(n) for n in near[:3])}?)" if near else ""


def _is_run_dir(path: str) -> bool:
    return os.path.isdir(os.path.join(path, "checkpoints"))


def _holds_checkpoints(run: str) -> bool:
    return any(_STEP_DIR.match(n) for n in _names(os.path.join(run, "checkpoints")))


def _names(path: str) -> list:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _pointer_problem(manager: CheckpointManager) -> str | None:
    """What is wrong with `latest`, when it names no checkpoint directory at all (garbage, or
    one that is gone). The newest checkpoint that verifies is used whatever it says; a pointer
    one checkpoint behind is a crash before its update, normal, and one naming a damaged
    checkpoint is reported as that checkpoint."""
    pointer = os.path.join(manager.dir, LATEST)
    if not os.path.lexists(pointer):
        return None
    name = manager.pointer()
    if name and _STEP_DIR.match(name) and os.path.isdir(os.path.join(manager.dir, name)):
        return None
    shown = "nothing readable" if not name else f"'{name[:60]}'"
    return f"'{pointer}' names {shown}, which is not a checkpoint there"


def _first_usable(manager: CheckpointManager, warn, info, own: bool,
                  resume: bool = True) -> str | None:
    """The newest checkpoint that verifies. Newer, unusable ones are reported and, in the run's
    own directory, moved aside so that they are never tried (or counted) again; when none is
    usable, nothing is moved and the run stops. One that is intact but cannot be resumed by
    this version (`resume_refusal`) stops the run: it is not damaged, nothing to fall back
    from."""
    tried, bad = manager.candidates(), []
    for path in tried:
        refusal = resume_refusal(path) if resume else None
        if refusal:
            for old, why in bad:
                warn(f"checkpoint '{old}' is unusable ({why})")
            raise BadInput(f"cannot resume from '{path}': {refusal}")
        problem, note = verify(path, resume=resume)
        if problem is not None:
            bad.append((path, problem))
            continue
        for old, why in bad:
            moved = manager.set_aside(old) if own else None
            warn(f"checkpoint '{old}' is unusable ({why})"
                 + (f"; moved aside to '{moved}'" if moved else "") + "; using an older one")
        info(f"checkpoint {path}: {note}")
        return path
    for old, why in bad:
        warn(f"checkpoint '{old}' is unusable ({why})")
    if tried:
        raise BadInput(f"no usable checkpoint in '{manager.dir}' ({len(tried)} tried, all "
                          f"corrupt or incomplete); start over with a new --output_dir")
    return None


def file_mode() -> int:
    """The mode open() gives a new file here: 0o666 less the process's umask."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:   # Linux: read, not set
            for line in fh:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def give_normal_mode(paths) -> None:
    """Every file in `paths` (files, or directories: the files under them) gets the mode of a
    newly opened file. safetensors writes through a private temporary file (mode 0600) that it
    renames into place: left so, a checkpoint or an export on a shared filesystem would be
    unreadable to the rest of the team while every other file of the run is not. A file that
    cannot be changed (another user's) is left as it is."""
    mode = file_mode()
    for top in paths:
        files = [top] if not os.path.isdir(top) else \
            [os.path.join(d, f) for d, _, names in os.walk(top) for f in names]
        for f in files:
            try:
                if not os.path.islink(f) and (os.stat(f).st_mode & 0o777) != mode:
                    os.chmod(f, mode)
            except OSError:
                pass


def _attempt(action, catch=OSError) -> str | None:
    """None when `action()` succeeds, else what went wrong, in one line."""
    try:
        action()
    except catch as e:
        return one_line(e, with_type=True)
    return None


def directory_bytes(path: str) -> int:
    """Bytes of every file under `path` (a checkpoint's size on disk, as its files count it)."""
    total = 0
    for d, _, names in os.walk(path):
        for name in names:
            try:
                total += os.path.getsize(os.path.join(d, name))
            except OSError:
                pass
    return total


def _free_space(path: str) -> str:
    try:
        return f"{shutil.disk_usage(path).free / 2**30:,.1f} GiB free there"
    except OSError:
        return "free space unknown"


def _checksums(root: str, only: list[str] | None = None) -> dict:
    """{relative path: {size, sha256}} for every file under root (or the listed ones), hashed in
    parallel: hashlib releases the GIL, and checkpoints of 1B+ models are many GB."""
    if only is None:
        only = sorted(os.path.relpath(os.path.join(d, f), root)
                      for d, _, names in os.walk(root) for f in names)

    def one(rel):
        h = hashlib.sha256()
        with open(os.path.join(root, rel), "rb") as fh:
            while chunk := fh.read(8 << 20):
                h.update(chunk)
        return rel, {"size": os.path.getsize(os.path.join(root, rel)), "sha256": h.hexdigest()}

    with ThreadPoolExecutor(max_workers=min(8, max(1, len(only)))) as pool:
        return dict(pool.map(one, only))


def _fsync_tree(path: str) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            _fsync(os.path.join(root, name), strict=True)
        _fsync(root)


def _fsync(path: str, strict: bool = False) -> None:
    """fsync a file, or a directory: that makes a rename inside it durable (on a power cut, not
    only a process crash); a directory that cannot be synced is passed over."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        if strict:
            raise


def changed_on_resume(checkpoint: str, current: dict, derived: dict | None = None) -> list[str]:
    """'key old -> new' for every key that differs from the config stored in `checkpoint` and
    changes training (not in config.RESUME_FREE), and for each entry of `derived` (the training
    data's size, the effective batch) that differs from the checkpoint's derived values."""
    import yaml
    path = os.path.join(checkpoint, CONFIG_NAME)
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as fh:
        saved = upgrade_saved(yaml.safe_load(fh) or {})
    before = saved.pop("derived", None) or {}
    changes = [f"{k} {saved[k]!r} -> {v!r}" for k, v in current.items()
               if k in saved and k not in RESUME_FREE and saved[k] != v]
    for k, v in (derived or {}).items():
        if k in before and before[k] != v:
            old, new = (_brief(before[k]), _brief(v)) if k == "data" else (before[k], v)
            changes.append(f"{k} {old} -> {new}")
    return changes


def _brief(d: dict) -> str:
    return f"({d.get('train_tokens')} train / {d.get('val_tokens')} val tokens)"


def saved_derived(checkpoint: str) -> dict:
    """The `derived` section of the config stored with a checkpoint (batch plan, ...)."""
    import yaml
    try:
        with open(os.path.join(checkpoint, CONFIG_NAME), encoding="utf-8") as fh:
            return (yaml.safe_load(fh) or {}).get("derived") or {}
    except (OSError, yaml.YAMLError):
        return {}
