"""Finding the checkpoint to use: the one a resume continues (`resolve_resume`: auto, never or a
path), the one a path names for export, sampling or evaluation (`find_checkpoint`: a checkpoint
directory, or a run directory's newest good one), each verified, the unusable ones reported and,
in the run's own directory, moved aside. `path_problem` says, from directory listings alone (no
checksums, no torch: the config check runs it), why a path holds no checkpoint, and which
neighbour does (the did-you-mean of paths).
"""
from __future__ import annotations

import os

from ..errors import BadInput, close_matches
from .files import LATEST, MANIFEST, RUN_FILES, STEP_DIR, TRAIN_STATE, list_names
from .manager import CheckpointManager
from .verify import resume_refusal, verify


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
    if problem and resume and MANIFEST not in list_names(path):
        raise BadInput(f"{pre}cannot resume from '{path}': {problem}")
    if problem:
        raise BadInput(f"{pre}checkpoint '{path}' is unusable: {problem}{hint}")
    info(f"checkpoint {path}: {note}")
    return path


def is_checkpoint_dir(path: str) -> bool:
    """model.safetensors (DDP, one process) or pytorch_model_fsdp_0/ (FSDP's sharded state)."""
    return os.path.isdir(path) and any(f.startswith(("model", "pytorch_model"))
                                       for f in list_names(path))


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
        if any(STEP_DIR.match(n) for n in list_names(looked)):
            return None
        return (f"run directory '{path}' holds no checkpoint ('{looked}' has no step_N "
                f"directory){_did_you_mean(path, sibling=True)}")
    if is_checkpoint_dir(path):
        return None
    steps = sorted(n for n in list_names(path) if STEP_DIR.match(n))
    if steps:
        run = os.path.dirname(os.path.normpath(path)) or "."
        return (f"'{path}' is not a checkpoint directory: it holds checkpoints (did you mean the "
                f"run directory '{run}', or '{os.path.join(path, steps[-1])}'?)")
    names = list_names(path)
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
        names = [n for n in list_names(parent) if _holds_checkpoints(os.path.join(parent, n))
                 or is_checkpoint_dir(os.path.join(parent, n))]
        near = [os.path.join(parent, n) if parent != "." else n for n in
                close_matches(os.path.basename(path), names, n=3)]
    near += [os.path.join(path, n) for n in sorted(list_names(path))
             if _holds_checkpoints(os.path.join(path, n))][:3]
    return f" (did you mean {' or '.join(repr(n) for n in near[:3])}?)" if near else ""


def _is_run_dir(path: str) -> bool:
    return os.path.isdir(os.path.join(path, "checkpoints"))


def _holds_checkpoints(run: str) -> bool:
    return any(STEP_DIR.match(n) for n in list_names(os.path.join(run, "checkpoints")))


def _pointer_problem(manager: CheckpointManager) -> str | None:
    """What is wrong with `latest`, when it names no checkpoint directory at all (garbage, or
    one that is gone). The newest checkpoint that verifies is used whatever it says; a pointer
    one checkpoint behind is a crash before its update, normal, and one naming a damaged
    checkpoint is reported as that checkpoint."""
    pointer = os.path.join(manager.dir, LATEST)
    if not os.path.lexists(pointer):
        return None
    name = manager.pointer()
    if name and STEP_DIR.match(name) and os.path.isdir(os.path.join(manager.dir, name)):
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
