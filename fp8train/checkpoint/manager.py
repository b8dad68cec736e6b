"""Checkpoints under <output_dir>/checkpoints/: step_NNNNNNN/ directories and a `latest` pointer,
written, restored and rotated by `CheckpointManager`.

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
rank 0 copies the model and optimizer states into host memory; a thread of rank 0
(background.BackgroundSave) then writes those (`_write_model_copy`, `_write_optimizer_copy`) and
publishes. Loading verifies the manifest first (verify.py); which checkpoint to load is
locate.py's; the names and files on disk are files.py's. Every file written gets the umask's
mode.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from typing import Optional

from ..errors import BadInput, one_line
from ..io import atomic_write
from ..ranks import first_error
from .background import BackgroundSave
from .files import (CONFIG_NAME, LATEST, MANIFEST, MANIFEST_FORMAT, STEP_DIR, TRAIN_STATE,
                    checksums, fsync_path, fsync_tree, give_normal_mode, step_dir_name)
from .train_state import COMPONENTS, TrainState
from .verify import read_train_state


class CheckpointWriteError(Exception):
    """A checkpoint could not be written (disk full, read-only, ...). The previous checkpoint is
    untouched."""


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
            m = STEP_DIR.match(name)
            if m and os.path.isdir(os.path.join(self.dir, name)):
                found.append((int(m.group(1)), os.path.join(self.dir, name)))
        return sorted(found)

    def latest(self) -> str | None:
        """The checkpoint `latest` points at; the newest complete one if the pointer is missing,
        unreadable or points at something that is gone."""
        name = self.pointer()
        if name and STEP_DIR.match(name) and os.path.isdir(os.path.join(self.dir, name)):
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
             started: float | None = None, components: Optional[dict] = None) -> str:
        """Checkpoint of step `state.step`, with `state` and the run's resolved config (so that a
        resume can tell what changed), `meta` in the manifest. Collective: every rank calls it
        (each saves its own RNG state). Raises CheckpointWriteError on every rank when any
        rank's write failed; the previous checkpoint is left as it was. `started`: when the save
        began (time.perf_counter), for the manifest's `save_s`. `components`: {name: an object
        with state_dict}, whose states train_state.json keeps beside the counters."""
        started = time.perf_counter() if started is None else started
        step, main = state.step, accelerator.is_main_process
        final = os.path.join(self.dir, step_dir_name(step))
        tmp = os.path.join(self.dir, f".tmp-{step_dir_name(step)}")
        error = first_error(_attempt(lambda: self._clear(tmp)) if main else None)
        # Any failure while the state is written is a failed write (torch.save reports ENOSPC
        # as a RuntimeError, safetensors as its own error type).
        if error is None:
            error = first_error(_attempt(
                lambda: self._write_state(accelerator, tmp, state, config_text, components),
                Exception))
        if error is None:
            error = first_error(_attempt(lambda: self._publish(tmp, final, step, meta, started))
                                if main else None)
        if error is not None:
            if main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise self.write_error(step, error)
        return final

    def save_in_background(self, accelerator, state: TrainState, config_text: str, meta: dict,
                           copier, started: float, model, optimizer,
                           components: Optional[dict] = None) -> "BackgroundSave":
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
                accelerator, tmp, state, config_text, copier, model, optimizer, components)),
                Exception))
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

    def restore(self, accelerator, path: str, state: TrainState,
                components: Optional[dict] = None) -> None:
        """Load checkpoint `path` (verified) into the prepared model and optimizer and every
        rank's RNG (Accelerate's load_state), its counters into `state`, and each of
        `components` ({name: an object with load_state_dict}) its own saved state. BadInput for
        a checkpoint of another format, before anything is loaded; what load_state raises (a
        checkpoint of another model) passes through."""
        saved, states = read_train_state(path)
        accelerator.load_state(path)
        vars(state).update(vars(saved))
        for name, component in (components or {}).items():
            try:
                component.load_state_dict(states.get(name, {}))
            except ValueError as e:   # a value of the wrong kind: a damaged or edited file
                raise BadInput(f"cannot resume from '{path}': {TRAIN_STATE} cannot be read "
                               f"(its {name} state: {one_line(e)})") from None

    def _clear(self, tmp: str) -> None:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(self.dir, exist_ok=True)

    def _write_state(self, accelerator, tmp: str, state: TrainState, config_text: str,
                     components: Optional[dict]) -> None:
        """Phase 1, every rank: Accelerate's files (rank 0: model, optimizer; each rank its RNG
        states), then rank 0 the counters and the config."""
        accelerator.save_state(tmp)
        if accelerator.is_main_process:
            self._write_counters(tmp, state, config_text, components)

    @staticmethod
    def _write_counters(tmp: str, state: TrainState, config_text: str,
                        components: Optional[dict]) -> None:
        saved = state.to_dict()
        if components:
            saved[COMPONENTS] = {name: c.state_dict() for name, c in components.items()}
        with open(os.path.join(tmp, TRAIN_STATE), "w", encoding="utf-8") as fh:
            json.dump(saved, fh, indent=1, sort_keys=True)
            fh.write("\n")
        with open(os.path.join(tmp, CONFIG_NAME), "w", encoding="utf-8") as fh:
            fh.write(config_text)

    def _write_small_state(self, accelerator, tmp: str, state: TrainState, config_text: str,
                           copier, model, optimizer, components: Optional[dict]) -> dict:
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
        self._write_counters(tmp, state, config_text, components)
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
        files = checksums(tmp)
        fsync_tree(tmp)
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
        fsync_path(self.dir)
        return old

    def _point_latest(self, final: str, old: str | None) -> None:
        """Phase 4: `latest` names the new checkpoint; the one it replaced and those beyond
        keep_checkpoints go."""
        atomic_write(os.path.join(self.dir, LATEST), os.path.basename(final) + "\n", fsync=True)
        fsync_path(self.dir)
        if old:
            shutil.rmtree(old, ignore_errors=True)
        self._prune()

    def _prune(self) -> None:
        if self.keep <= 0:
            return
        for _, path in self.complete()[:-self.keep]:
            shutil.rmtree(path, ignore_errors=True)


def _attempt(action, catch=OSError) -> str | None:
    """None when `action()` succeeds, else what went wrong, in one line."""
    try:
        action()
    except catch as e:
        return one_line(e, with_type=True)
    return None


def _free_space(path: str) -> str:
    try:
        return f"{shutil.disk_usage(path).free / 2**30:,.1f} GiB free there"
    except OSError:
        return "free space unknown"
