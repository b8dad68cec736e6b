"""Resuming a run: which checkpoint, whether the config may continue it, and what changes when
it does (the LR schedule's length)."""
from __future__ import annotations

from typing import Callable

from .. import ranks
from ..errors import BadInput
from ..optim.schedule import lr_at
from .files import read_manifest
from .locate import resolve_resume
from .manager import CheckpointManager
from .saved_config import changed_on_resume


def choose_checkpoint(resume: str, manager: CheckpointManager, log,
                      asked: str = "auto") -> "tuple[str | None, list]":
    """The verified checkpoint to resume from (None: start fresh), chosen by rank 0, which reads
    and checksums the files once, and the notes of what verification found: (log.warn or
    log.msg, text) to say once train.log is open. When no checkpoint will do, the reasons each
    was refused are said before the refusal's own error. `asked`: the config's resume, when
    `resume` was decided for the run (a sweep trial resumes its own directory unasked)."""
    notes: list = []
    try:
        found = ranks.on_rank0(lambda: resolve_resume(
            resume, manager, warn=lambda m: notes.append((log.warn, m)),
            info=lambda m: notes.append((log.msg, m)), announce=asked == resume))
    except BadInput:
        for say, msg in notes:
            if say == log.warn:
                say(msg)
        raise
    return found, notes


# The config keys behind each derived value a resume compares.
DERIVED_FROM = {"data": ("dataset", "data_dir", "tokenizer", "val_fraction"),
                "effective_batch_size": ("target_effective_batch_size", "batch_size",
                                         "gradient_accumulation_steps")}


def check_config_change(checkpoint: str, run_hash: str, values: dict, derived: dict,
                        allow: bool, where, log) -> None:
    """Refuse to continue `checkpoint` with keys that change training (unless allow), warn when
    allowed. `values`: the run's config keys; `derived`: the data's size, the effective batch;
    `where(*keys)`: where those keys' values came from (Config.where), which the refusal
    names: the option typed on the command line, or the config file."""
    if read_manifest(checkpoint).get("config_hash") == run_hash:
        return
    changed = changed_on_resume(checkpoint, values, derived)
    keys = [k for change in changed for k in DERIVED_FROM.get(change.split()[0],
                                                               (change.split()[0],))]
    if changed and not allow:
        raise BadInput(
            f"{where(*keys)}: resuming '{checkpoint}' with settings that change training: "
            f"{', '.join(changed)}; put them back, pass --allow_config_change to continue "
            f"with the new values, or start a new run with another --output_dir")
    if changed:
        log.warn("resuming with settings that differ from the checkpoint's "
                 "(--allow_config_change; training continues with the new values): "
                 + ", ".join(changed))


def warn_schedule_change(saved: dict, lr_args: dict, step: int,
                         warn: Callable[[str], None]) -> None:
    """The schedule follows the run's length (unless lr_decay_steps is set), and the run's length
    may change on resume: say so, with the jump in LR it causes, rather than let it pass.
    `saved`: the checkpoint's derived values; `lr_args`: this run's lr_at arguments."""
    before = saved.get("lr_schedule_steps")
    now = lr_args["total_steps"]
    if not isinstance(before, int) or before == now:
        return
    old = lr_at(step, **dict(lr_args, total_steps=before,
                             max_lr=saved.get("peak_learning_rate", lr_args["max_lr"]),
                             warmup_steps=saved.get("warmup_steps", lr_args["warmup_steps"])))
    new = lr_at(step, **lr_args)
    warn(f"the LR schedule is now {now:,} steps long, the checkpoint's run had {before:,} (the "
         f"schedule follows the run's length, which changed): the LR at step {step + 1:,} is "
         f"{new:.3g} instead of {old:.3g}; set lr_decay_steps to keep a schedule fixed across "
         f"changes of length")

