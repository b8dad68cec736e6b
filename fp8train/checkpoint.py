"""Checkpoints under <output_dir>/checkpoints/: step_NNNNNNN/ directories written by
`accelerator.save_state` (model, optimizer, RNG states of every rank, FP8 state and the
registered training state), a manifest, and a `latest` pointer.

Writing is atomic: every file goes into .tmp-step_NNNNNNN/, is fsynced, the manifest (step,
tokens, config hash, each file's size and SHA-256) is written last, and only then is the
directory renamed and `latest` replaced. A crash at any point leaves either the complete new
checkpoint or none. Loading verifies the manifest; a corrupt or partial checkpoint is reported,
moved aside and the previous one used. Loading also reads every pickle in the checkpoint
without running it (`unsafe_content`): one that needs more than tensors and plain data makes
the checkpoint unusable too, so that a checkpoint from elsewhere cannot run code.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

from .config import ConfigError
from .safe_load import describe_error as _describe, unsafe_content

_STEP_DIR = re.compile(r"^step_(\d{7,})$")
LATEST = "latest"
CONFIG_NAME = "config.yaml"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1

# Keys whose change on resume does not change what the model learns from (how long, how it is
# logged and carried out). Any other change is refused on resume unless allow_config_change.
HARMLESS_ON_RESUME = {"output_dir", "resume", "data_dir", "max_steps", "num_epochs", "max_hours",
                      "log_interval", "eval_interval", "eval_sequences", "checkpoint_interval",
                      "keep_checkpoints", "compile", "compile_mode", "activation_checkpointing", "use_wandb",
                      "wandb_project", "wandb_entity", "wandb_run_name", "wandb_tags",
                      # how the run is carried out, not what it trains
                      "plan_only", "reprobe", "batch_cache_dir", "data_prefetch", "tf32",
                      "max_batch_size", "memory_headroom", "probe_memory_limit_gb",
                      # the split of the batch over micro-batches, accumulation and devices;
                      # the effective batch itself is compared (from the derived values)
                      "batch_size", "gradient_accumulation_steps", "auto_batch_size",
                      "target_effective_batch_size",
                      "fp8_log_layers", "fp8_eval", "fp8_fallback", "eval_samples", "sample_tokens",
                      "allow_config_change", "checkpoint_required", "max_bad_steps",
                      "fp8_recovery", "loss_spike_factor", "target_val_loss", "stop_at_target"}


class CheckpointWriteError(Exception):
    """A checkpoint could not be written (disk full, read-only, ...). The previous checkpoint is
    untouched."""


def step_dir_name(step: int) -> str:
    return f"step_{step:07d}"


class TrainState:
    """Counters that make a run resumable; saved with every checkpoint through Accelerate's
    `register_for_checkpointing`."""

    def __init__(self):
        self.step = 0                # optimizer steps done
        self.tokens = 0              # training tokens consumed, all ranks together
        self.data_position = 0       # training sequences drawn, all ranks together
        self.train_seconds = 0.0     # wall time spent training, over all invocations
        self.skipped_steps = 0       # updates skipped for non-finite gradients
        self.rollbacks = 0           # restores of the last checkpoint after max_bad_steps
        self.fp8_margin_added = 0    # remedies of those rollbacks, re-applied on resume
        self.fp8_off = False
        # for the end-of-run report (summary.json), carried across resumes
        self.wall_seconds = 0.0      # wall time of every invocation, up to its last checkpoint
        self.steady_tokens = 0       # tokens and training seconds of the steady state (each
        self.steady_seconds = 0.0    # invocation's first log interval, with compile, left out)
        self.best_val_loss = None
        self.best_val_step = None
        self.target = None           # target_val_loss when it was reached, and where
        self.target_step = None
        self.time_to_target_s = None
        self.tokens_to_target = None
        self.checkpoints_written = 0

    def state_dict(self) -> dict:
        return dict(vars(self))

    def load_state_dict(self, d: dict) -> None:
        self.step, self.tokens = int(d["step"]), int(d["tokens"])
        self.data_position, self.train_seconds = int(d["data_position"]), float(d["train_seconds"])
        # absent from checkpoints written before these existed
        self.skipped_steps = int(d.get("skipped_steps", 0))
        self.rollbacks = int(d.get("rollbacks", 0))
        self.fp8_margin_added = int(d.get("fp8_margin_added", 0))
        self.fp8_off = bool(d.get("fp8_off", False))
        for key in ("wall_seconds", "steady_tokens", "steady_seconds", "best_val_loss",
                    "best_val_step", "target", "target_step", "time_to_target_s",
                    "tokens_to_target", "checkpoints_written"):
            if key in d:
                setattr(self, key, d[key])


def config_hash(values: dict) -> str:
    """What the run trains: every key except the harmless ones, canonically serialised."""
    kept = {k: v for k, v in sorted(values.items()) if k not in HARMLESS_ON_RESUME}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:16]


class CheckpointManager:
    def __init__(self, output_dir: str, keep: int, faults=None):
        self.dir = os.path.join(output_dir, "checkpoints")
        self.keep = keep
        self.faults = faults

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
        """The checkpoint `latest` points at; the newest complete one if the pointer is missing
        or points at something that is gone."""
        pointer = os.path.join(self.dir, LATEST)
        if os.path.isfile(pointer):
            with open(pointer, encoding="utf-8") as fh:
                name = fh.read().strip()
            if _STEP_DIR.match(name) and os.path.isdir(os.path.join(self.dir, name)):
                return os.path.join(self.dir, name)
        done = self.complete()
        return done[-1][1] if done else None

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

    def save(self, accelerator, step: int, config_text: str, meta: dict) -> str:
        """Collective: every rank calls it (each saves its own RNG state). The run's resolved
        config goes in too, so a resume can tell what changed. Raises CheckpointWriteError on
        every rank when any rank's write failed; the previous checkpoint is left as it was."""
        final = os.path.join(self.dir, step_dir_name(step))
        tmp = os.path.join(self.dir, f".tmp-{step_dir_name(step)}")
        error = None
        if accelerator.is_main_process:
            try:
                shutil.rmtree(tmp, ignore_errors=True)
                os.makedirs(self.dir, exist_ok=True)
            except OSError as e:
                error = _describe(e)
        error = _agree(accelerator, error)
        if error is None:
            try:
                accelerator.save_state(tmp)
                if self.faults:
                    self.faults.in_save(step, "state", tmp)
            except Exception as e:  # torch.save reports ENOSPC as a RuntimeError, safetensors
                error = _describe(e)  # as its own error type: any failure here is a failed write
            error = _agree(accelerator, error)
        if error is None and accelerator.is_main_process:
            try:
                self._finish(tmp, final, step, config_text, meta)
            except OSError as e:
                error = _describe(e)
        error = _agree(accelerator, error)
        if error is not None:
            if accelerator.is_main_process:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointWriteError(f"checkpoint of step {step:,} could not be written to "
                                       f"'{self.dir}' ({error}; {_free_space(self.dir)})")
        return final

    def _finish(self, tmp: str, final: str, step: int, config_text: str, meta: dict) -> None:
        with open(os.path.join(tmp, CONFIG_NAME), "w", encoding="utf-8") as fh:
            fh.write(config_text)
        files = _checksums(tmp)
        _fsync_tree(tmp)
        manifest = dict(format=MANIFEST_FORMAT, step=step, **meta, files=files,
                        written=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        _atomic_write(os.path.join(tmp, MANIFEST), json.dumps(manifest, indent=1) + "\n")
        if self.faults:
            self.faults.in_save(step, "manifest", tmp)
        old = None
        if os.path.isdir(final):   # re-saving a step (after a rollback): keep it until replaced
            old = f"{final}.old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(self.dir)
        if self.faults:
            self.faults.in_save(step, "pointer", final)
        _atomic_write(os.path.join(self.dir, LATEST), os.path.basename(final) + "\n")
        _fsync_dir(self.dir)
        if old:
            shutil.rmtree(old, ignore_errors=True)
        self._prune()

    def _prune(self) -> None:
        if self.keep <= 0:
            return
        for _, path in self.complete()[:-self.keep]:
            shutil.rmtree(path, ignore_errors=True)


def verify(path: str) -> tuple[str | None, str]:
    """(problem, note): problem is None when the checkpoint is complete, every file matches
    its manifest and no pickle in it names a global beyond the allowlist (`unsafe_content`: a
    checksum does not tell a crafted checkpoint, whose author writes the manifest too); note
    says what was checked."""
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest_path):
        if any(f.startswith(("model", "pytorch_model")) for f in os.listdir(path)):
            unsafe = unsafe_content(path)
            if unsafe:
                return unsafe, ""
            return None, "no manifest (written by an older fp8train): not verified"
        return "no manifest and no model files", ""
    try:
        with open(manifest_path, encoding="utf-8") as fh:
            manifest = json.load(fh)
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"unreadable manifest ({_describe(e)})", ""
    t0, total = time.time(), 0
    for rel, want in files.items():
        full = os.path.join(path, rel)
        if not os.path.isfile(full):
            return f"file '{rel}' is missing", ""
        size = os.path.getsize(full)
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
    try:
        with open(os.path.join(path, MANIFEST), encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return {}


def resolve_resume(resume: str, manager: CheckpointManager, warn=None, info=None) -> str | None:
    """The checkpoint to load (verified), or None to start fresh. `warn(msg)` hears about every
    checkpoint skipped as unusable, `info(msg)` what was verified. Starting fresh on top of an
    earlier run's checkpoints is refused: that would mix two runs in one directory."""
    warn = warn or (lambda msg: None)
    info = info or (lambda msg: None)
    if resume == "never":
        existing = manager.latest()
        if existing is not None:
            raise ConfigError(
                f"output_dir already holds checkpoints (latest: '{existing}'); pass --resume to "
                f"continue that run, or a new --output_dir to start another")
        return None
    if resume == "auto":
        manager.remove_partial_writes()
        return _first_usable(manager, warn, info, own=True)
    return find_checkpoint(resume, "key 'resume'", warn, info,
                           hint=" (--resume auto picks the newest good checkpoint of a run)")


def find_checkpoint(path: str, what: str = "checkpoint", warn=None, info=None,
                    hint: str = " (pass the run directory to use its newest good checkpoint)") -> str:
    """`path` verified, when it is a checkpoint directory; the newest checkpoint that verifies,
    when it is a run directory. ConfigError (naming `what`) otherwise."""
    warn = warn or (lambda msg: None)
    info = info or (lambda msg: None)
    if os.path.isdir(os.path.join(path, "checkpoints")):  # a run directory: its newest good one
        found = _first_usable(CheckpointManager(path, 0), warn, info, own=False)
        if found is None:
            raise ConfigError(f"{what}: run directory '{path}' holds no checkpoint")
        return found
    if not is_checkpoint_dir(path):
        raise ConfigError(f"{what}: '{path}' is not a checkpoint directory (nor a run directory "
                          f"with checkpoints/)")
    problem, note = verify(path)
    if problem:
        raise ConfigError(f"{what}: checkpoint '{path}' is unusable: {problem}{hint}")
    info(f"checkpoint {path}: {note}")
    return path


def is_checkpoint_dir(path: str) -> bool:
    """model.safetensors (DDP, one process) or pytorch_model_fsdp_0/ (FSDP's sharded state)."""
    return os.path.isdir(path) and any(f.startswith(("model", "pytorch_model"))
                                       for f in os.listdir(path))


def _first_usable(manager: CheckpointManager, warn, info, own: bool) -> str | None:
    """The newest checkpoint that verifies. Newer, unusable ones are reported and, in the run's
    own directory, moved aside so that they are never tried (or counted) again; when none is
    usable, nothing is moved and the run stops."""
    tried, bad = manager.candidates(), []
    for path in tried:
        problem, note = verify(path)
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
        raise ConfigError(f"no usable checkpoint in '{manager.dir}' ({len(tried)} tried, all "
                          f"corrupt or incomplete); start over with a new --output_dir")
    return None


def _agree(accelerator, error: str | None) -> str | None:
    """Every rank learns whether any rank failed (and why), so that all of them take the same
    path and none waits at a barrier the others skipped."""
    if accelerator.num_processes == 1:
        return error
    import torch.distributed as dist
    errors = [None] * accelerator.num_processes
    dist.all_gather_object(errors, error)
    for rank, e in enumerate(errors):
        if e is not None:
            return e if rank == 0 else f"rank {rank}: {e}"
    return None


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


def _atomic_write(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _fsync_tree(path: str) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(root)


def _fsync_dir(path: str) -> None:
    """Make a rename inside `path` durable (on a power cut, not only a process crash)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def changed_on_resume(checkpoint: str, current: dict, derived: dict | None = None) -> list[str]:
    """'key old -> new' for every key that differs from the config stored in `checkpoint` and
    changes training (see HARMLESS_ON_RESUME), and for each entry of `derived` (the training
    data's size, the effective batch) that differs from the checkpoint's derived values."""
    import yaml
    path = os.path.join(checkpoint, CONFIG_NAME)
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as fh:
        saved = yaml.safe_load(fh) or {}
    before = saved.pop("derived", None) or {}
    changes = [f"{k} {saved[k]!r} -> {v!r}" for k, v in current.items()
               if k in saved and k not in HARMLESS_ON_RESUME and saved[k] != v]
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
