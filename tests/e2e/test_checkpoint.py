"""Checkpoint directory bookkeeping (the save itself is exercised end to end in test_train)."""


import os

import pytest


pytestmark = pytest.mark.usefixtures("no_accelerate_state_left")


def test_real_runs_print_each_save_keep_modes_pass_over_damage_and_refuse_a_mismatch(tmp_path):
    """A 2-step run under umask 002, started with --resume in a new directory (a warning
    says that nothing was resumed): a console line per checkpoint, every file it wrote
    group-writable like any new file; then its newest checkpoint loses its manifest and half its
    model, and --resume continues from the older one with one warning; an intact checkpoint of
    another shape is refused as a mismatch, not passed over."""
    from support.runs import DATA_DIR, run_train, tiny_args
    out = tmp_path / "run"
    args = tiny_args(out, dataset=os.path.join(DATA_DIR, "tinyshakespeare.txt"), seq_len=32,
                     batch_size=2, gradient_accumulation_steps=1, warmup_steps=0, max_steps=2,
                     lr_decay_steps=4, log_interval=1, eval_interval=100, checkpoint_interval=1,
                     eval_sequences=4, eval_samples=0)
    old = os.umask(0o002)   # the child inherits it
    try:
        r = run_train(*args, "--resume")   # asked to resume, finds nothing: says so
    finally:
        os.umask(old)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"WARNING: resume auto: no checkpoint in '{out / 'checkpoints'}' (it does not " \
           "exist); starting a new run" in r.stderr.splitlines()
    assert "checkpoint step 1 saved (" in r.stdout and "checkpoint step 2 saved (" in r.stdout
    written = [os.path.join(d, f) for d, _, names in os.walk(out) for f in names]
    assert {f: oct(os.stat(f).st_mode & 0o777) for f in written} == \
        {f: oct(0o664) for f in written}

    newest, older = out / "checkpoints" / "step_0000002", out / "checkpoints" / "step_0000001"
    os.remove(newest / "manifest.json")
    os.truncate(newest / "model.safetensors", (newest / "model.safetensors").stat().st_size // 2)
    r = run_train(*args, "--max_steps=3", "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    warnings = [line for line in r.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1 and f"checkpoint '{newest}' is unusable (no manifest.json" in \
        warnings[0], r.stderr
    assert f"resumed from {older} at step 1" in r.stdout

    r = run_train(*args, "--max_steps=3", "--resume", "--n_layer=3", "--allow_config_change")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and lines[-1].startswith(
        f"error: cannot resume from '{out / 'checkpoints' / 'step_0000003'}': it does not match "
        "this run's model"), r.stderr
    assert (out / "checkpoints" / "step_0000003").is_dir()   # intact: not moved aside
