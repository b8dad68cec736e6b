"""Checkpoints under <output_dir>/checkpoints/: step_NNNNNNN/ directories written by
`accelerator.save_state` (model, optimizer, RNG states of every rank, and the registered
training state), plus a `latest` pointer.

A checkpoint is written under a temporary name and renamed when complete; `latest` is
replaced atomically after that. A crash mid-write therefore never leaves something that looks
like a complete checkpoint.
"""
from __future__ import annotations

import os
import re
import shutil

from .config import ConfigError

_STEP_DIR = re.compile(r"^step_(\d{7,})$")
LATEST = "latest"
CONFIG_NAME = "config.yaml"

# Keys whose change on resume does not change what the model learns from; everything else is
# reported when a resume differs from the run that wrote the checkpoint.
HARMLESS_ON_RESUME = {"output_dir", "resume", "data_dir", "max_steps", "num_epochs", "max_hours",
                      "log_interval", "eval_interval", "eval_sequences", "checkpoint_interval",
                      "keep_checkpoints", "compile", "activation_checkpointing", "use_wandb",
                      "wandb_project", "wandb_entity", "wandb_run_name", "wandb_tags",
                      # how the run is carried out, not what it trains
                      "plan_only", "reprobe", "batch_cache_dir", "data_prefetch",
                      "fp8_log_layers", "fp8_eval", "fp8_fallback", "eval_samples", "sample_tokens"}


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

    def state_dict(self) -> dict:
        return dict(step=self.step, tokens=self.tokens, data_position=self.data_position,
                    train_seconds=self.train_seconds)

    def load_state_dict(self, d: dict) -> None:
        self.step, self.tokens = int(d["step"]), int(d["tokens"])
        self.data_position, self.train_seconds = int(d["data_position"]), float(d["train_seconds"])


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

    def save(self, accelerator, step: int, config_text: str) -> str:
        """Collective: every rank calls it (each saves its own RNG state). The run's resolved
        config goes in too, so a resume can tell what changed."""
        final = os.path.join(self.dir, step_dir_name(step))
        tmp = os.path.join(self.dir, f".tmp-{step_dir_name(step)}")
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(self.dir, exist_ok=True)
        accelerator.wait_for_everyone()
        accelerator.save_state(tmp)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            with open(os.path.join(tmp, CONFIG_NAME), "w", encoding="utf-8") as fh:
                fh.write(config_text)
            if os.path.isdir(final):   # re-saving the same step (e.g. after a resume)
                shutil.rmtree(final)
            _fsync_tree(tmp)
            os.replace(tmp, final)
            _atomic_write(os.path.join(self.dir, LATEST), step_dir_name(step) + "\n")
            self._prune()
        accelerator.wait_for_everyone()
        return final

    def _prune(self) -> None:
        if self.keep <= 0:
            return
        for _, path in self.complete()[:-self.keep]:
            shutil.rmtree(path, ignore_errors=True)


def resolve_resume(resume: str, manager: CheckpointManager) -> str | None:
    """The checkpoint to load, or None to start fresh. Starting fresh on top of an earlier
    run's checkpoints is refused: that would mix two runs in one directory."""
    if resume == "never":
        existing = manager.latest()
        if existing is not None:
            raise ConfigError(
                f"output_dir already holds checkpoints (latest: '{existing}'); pass --resume to "
                f"continue that run, or a new --output_dir to start another")
        return None
    if resume == "auto":
        return manager.latest()
    path = resume
    if os.path.isdir(os.path.join(path, "checkpoints")):  # a run directory
        path = CheckpointManager(path, 0).latest() or path
    # model.safetensors (DDP, one process) or pytorch_model_fsdp_0/ (FSDP's sharded state)
    if not os.path.isdir(path) or not any(f.startswith(("model", "pytorch_model"))
                                          for f in os.listdir(path)):
        raise ConfigError(f"key 'resume': '{resume}' is not a checkpoint directory")
    return path


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


def changed_on_resume(checkpoint: str, current: dict) -> list[str]:
    """'key old -> new' for every key that differs from the config stored in `checkpoint` and
    changes training (see HARMLESS_ON_RESUME)."""
    import yaml
    path = os.path.join(checkpoint, CONFIG_NAME)
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as fh:
        saved = yaml.safe_load(fh) or {}
    saved.pop("derived", None)
    return [f"{k} {saved[k]!r} -> {v!r}" for k, v in current.items()
            if k in saved and k not in HARMLESS_ON_RESUME and saved[k] != v]
