"""Checkpoint directory bookkeeping (the save itself is exercised end to end in test_train)."""

import os

import pytest

from fp8train.checkpoint import CheckpointManager, TrainState, resolve_resume
from fp8train.config import ConfigError


def make(root, *steps):
    for s in steps:
        d = root / "checkpoints" / f"step_{s:07d}"
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"x")


def saved(root, *steps, keep=0):
    """Checkpoints written by CheckpointManager.save itself (manifest, train_state.json, ...),
    each with a one-tensor model.safetensors written by safetensors."""
    m = CheckpointManager(str(root), keep=keep)
    for s in steps:
        st = TrainState()
        st.step = s
        m.save(_OneProcess(), st, "model: tiny\n", dict(tokens=s, config_hash="h"))
    return m


def test_latest_follows_the_pointer_and_ignores_partial_writes(tmp_path):
    make(tmp_path, 10, 20)
    (tmp_path / "checkpoints" / ".tmp-step_0000030").mkdir()  # a crash mid-write
    m = CheckpointManager(str(tmp_path), keep=3)
    assert m.latest().endswith("step_0000020")
    (tmp_path / "checkpoints" / "latest").write_text("step_0000010\n")
    assert m.latest().endswith("step_0000010")
    (tmp_path / "checkpoints" / "latest").write_text("step_0000099\n")  # points at nothing
    assert m.latest().endswith("step_0000020")
    assert [s for s, _ in m.complete()] == [10, 20]


def test_prune_keeps_the_newest(tmp_path):
    make(tmp_path, 1, 2, 3, 4)
    m = CheckpointManager(str(tmp_path), keep=2)
    m._prune()
    assert [s for s, _ in m.complete()] == [3, 4]
    CheckpointManager(str(tmp_path), keep=0)._prune()  # 0 = keep all
    assert len(m.complete()) == 2


def test_resolve_resume(tmp_path):
    empty = CheckpointManager(str(tmp_path / "fresh"), keep=3)
    assert resolve_resume("never", empty) is None and resolve_resume("auto", empty) is None
    m = saved(tmp_path, 5)
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        resolve_resume("never", m)
    assert resolve_resume("auto", m).endswith("step_0000005")
    assert resolve_resume(str(tmp_path), m).endswith("step_0000005")  # a run directory
    with pytest.raises(ConfigError, match="not a checkpoint directory: it holds checkpoints"):
        resolve_resume(str(tmp_path / "checkpoints"), m)


def test_changed_on_resume_reports_only_keys_that_change_training(tmp_path):
    from fp8train import config as C
    from fp8train.checkpoint import CONFIG_NAME, changed_on_resume
    cfg = C.load_config(["--max_steps=100", "--warmup_steps=10"])
    (tmp_path / CONFIG_NAME).write_text(C.dump_yaml(cfg, {"world_size": 1}))
    now = C.to_dict(cfg)
    assert changed_on_resume(str(tmp_path), now) == []
    now.update(max_steps=200, log_interval=1, learning_rate=1e-3, seed=7)
    assert changed_on_resume(str(tmp_path), now) == ["seed 1337 -> 7",
                                                     "learning_rate 0.0006 -> 0.001"]
    assert changed_on_resume(str(tmp_path / "elsewhere"), now) == []  # older checkpoints


def test_train_clock_excludes_paused_time():
    import time
    import torch
    from fp8train.metrics import TrainClock as _TrainClock
    clock = _TrainClock(torch.device("cpu"))
    time.sleep(0.05)
    clock.pause()
    time.sleep(0.3)  # an evaluation or a checkpoint
    clock.resume()
    time.sleep(0.05)
    took = clock.take()
    assert 0.09 <= took < 0.25
    assert clock.take() < 0.05  # take() starts a new interval


def test_manifest_verification_catches_every_kind_of_damage(tmp_path):
    import json
    from fp8train.checkpoint import MANIFEST, _checksums, verify
    d = tmp_path / "step_0000001"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"weights" * 100)
    (d / "optimizer.bin").write_bytes(b"moments" * 100)
    assert verify(str(d)) == (None, "no manifest (written by an older fp8train): not verified")
    (d / MANIFEST).write_text(json.dumps({"step": 1, "files": _checksums(str(d))}))
    problem, note = verify(str(d))
    assert problem is None and note.startswith("verified 2 files")
    (d / "optimizer.bin").write_bytes(b"moments" * 99 + b"momentX")   # same size, one byte off
    assert verify(str(d))[0] == "file 'optimizer.bin' does not match its checksum"
    (d / "optimizer.bin").write_bytes(b"short")
    assert verify(str(d))[0] == "file 'optimizer.bin' has 5 bytes, the manifest says 700"
    (d / "optimizer.bin").unlink()
    assert verify(str(d))[0] == "file 'optimizer.bin' is missing"
    (d / MANIFEST).write_text("{")
    assert verify(str(d))[0].startswith("unreadable manifest")


def test_candidates_newest_first_and_partial_writes_removed(tmp_path):
    make(tmp_path, 10, 20, 30)
    (tmp_path / "checkpoints" / "latest").write_text("step_0000020\n")  # a kill before the update
    (tmp_path / "checkpoints" / ".tmp-step_0000040").mkdir()
    m = CheckpointManager(str(tmp_path), keep=3)
    assert [p[-2:] for p in m.candidates()] == ["30", "20", "10"]
    assert m.remove_partial_writes() == [".tmp-step_0000040"]
    moved = m.set_aside(m.candidates()[0])
    assert moved.endswith("step_0000030.corrupt") and [s for s, _ in m.complete()] == [10, 20]


def test_config_hash_ignores_harmless_keys_only():
    from fp8train import config as C
    from fp8train.checkpoint import config_hash
    base = C.to_dict(C.load_config(["--max_steps=100", "--warmup_steps=10"]))
    h = config_hash(base)
    assert config_hash({**base, "log_interval": 1, "max_steps": 5000, "output_dir": "x"}) == h
    assert config_hash({**base, "learning_rate": 1e-3}) != h
    assert config_hash({**base, "data": {"train_tokens": 1}}) != config_hash(
        {**base, "data": {"train_tokens": 2}})


def test_changed_on_resume_compares_data_size_and_effective_batch(tmp_path):
    from fp8train import config as C
    from fp8train.checkpoint import CONFIG_NAME, changed_on_resume
    cfg = C.load_config(["--max_steps=100", "--warmup_steps=10"])
    data = {"train_tokens": 1000, "val_tokens": 100, "vocab_size": 256}
    (tmp_path / CONFIG_NAME).write_text(
        C.dump_yaml(cfg, {"data": data, "effective_batch_size": 32}))
    now = C.to_dict(cfg)
    assert changed_on_resume(str(tmp_path), now, {"data": data, "effective_batch_size": 32}) == []
    assert changed_on_resume(str(tmp_path), {**now, "batch_size": 4}) == []  # same effective
    assert changed_on_resume(str(tmp_path), now, {"data": {**data, "train_tokens": 999},
                                                  "effective_batch_size": 64}) == [
        "data (1000 train / 100 val tokens) -> (999 train / 100 val tokens)",
        "effective_batch_size 32 -> 64"]


class _OneProcess:
    """What CheckpointManager needs of an Accelerator, in one process: save_state writes a model
    file, load_state records what it loaded."""
    is_main_process, num_processes = True, 1

    def __init__(self):
        self.loaded = None

    def save_state(self, directory):
        import torch
        from safetensors.torch import save_file
        os.makedirs(directory, exist_ok=True)
        save_file({"w": torch.arange(4.0)}, os.path.join(directory, "model.safetensors"))

    def load_state(self, directory):
        self.loaded = directory


class _Phases:
    """A fault hook that records each phase of a checkpoint write and what was on disk then."""

    def __init__(self, root):
        self.root, self.seen = root, []

    def in_save(self, step, phase, where):
        ckpts = os.path.join(self.root, "checkpoints")
        latest = os.path.join(ckpts, "latest")
        self.seen.append((phase, os.path.basename(where), sorted(os.listdir(where)),
                          open(latest).read().strip() if os.path.exists(latest) else None))


def test_train_state_round_trips_through_json_exactly():
    import json
    from fp8train.checkpoint import TrainState
    st = TrainState()
    st.step, st.tokens, st.data_position, st.fp8_off = 7, 7168, 112, True
    st.train_seconds, st.best_val_loss, st.best_val_step = 0.1 + 0.2, 3.866330146789551, 6
    back = TrainState.from_dict(json.loads(json.dumps(st.to_dict())))
    assert back.to_dict() == st.to_dict() and back.train_seconds == 0.1 + 0.2
    assert TrainState.from_dict({"step": 3}).to_dict() == {**TrainState().to_dict(), "step": 3}
    for bad in ({"step": 1.5}, {"step": True}, {"fp8_off": 1}, {"best_val_loss": "x"}, [1]):
        with pytest.raises(ValueError):
            TrainState.from_dict(bad)


def test_save_writes_in_four_phases_and_restore_reads_the_json(tmp_path, monkeypatch):
    import json
    from faults import install_save_faults
    from fp8train.checkpoint import MANIFEST, TRAIN_STATE, TrainState, verify
    phases = _Phases(str(tmp_path))
    install_save_faults(phases, monkeypatch.setattr)   # observes the phases as faults would
    m = CheckpointManager(str(tmp_path), keep=3)
    acc, st = _OneProcess(), TrainState()
    st.step, st.tokens, st.train_seconds = 3, 300, 1.25
    path = m.save(acc, st, "model: tiny\n", dict(tokens=st.tokens, config_hash="h"))
    assert path.endswith("step_0000003") and verify(path)[0] is None
    state_files = ["config.yaml", "model.safetensors", TRAIN_STATE]
    assert phases.seen == [
        ("state", ".tmp-step_0000003", state_files, None),             # no manifest yet
        ("manifest", ".tmp-step_0000003", sorted(state_files + [MANIFEST]), None),
        ("pointer", "step_0000003", sorted(state_files + [MANIFEST]), None)]  # `latest` next
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_0000003"
    manifest = json.loads(open(os.path.join(path, MANIFEST)).read())
    assert manifest["format"] == 2 and manifest["step"] == 3 and manifest["tokens"] == 300
    assert json.loads(open(os.path.join(path, TRAIN_STATE)).read()) == st.to_dict()
    fresh = TrainState()
    m.restore(acc, path, fresh)
    assert acc.loaded == path and fresh.to_dict() == st.to_dict()


def test_restore_refuses_another_format_before_loading_anything(tmp_path):
    import json
    from fp8train.checkpoint import MANIFEST, TRAIN_STATE, TrainState
    m = CheckpointManager(str(tmp_path), keep=3)
    acc, st = _OneProcess(), TrainState()
    st.step = 5
    path = m.save(acc, st, "", {})
    manifest = json.loads(open(os.path.join(path, MANIFEST)).read())
    (tmp_path / "checkpoints" / "step_0000005" / MANIFEST).write_text(
        json.dumps({**manifest, "format": 1}))
    with pytest.raises(ConfigError, match=r"cannot resume from .*step_0000005': it was written "
                                          r"by another version of fp8train \(checkpoint format 1; "
                                          r"this version resumes checkpoint format 2"):
        m.restore(acc, path, TrainState())
    (tmp_path / "checkpoints" / "step_0000005" / MANIFEST).write_text(json.dumps(manifest))
    (tmp_path / "checkpoints" / "step_0000005" / TRAIN_STATE).write_text('{"step": "five"}')
    with pytest.raises(ConfigError, match=f"{TRAIN_STATE} cannot be read"):
        m.restore(acc, path, TrainState())
    assert acc.loaded is None


# --- which checkpoint a resume takes: damaged ones are passed over, incompatible ones refused ---

def _no_manifest_and(rel, keep=10):
    def damage(ck):
        os.remove(ck / "manifest.json")
        os.truncate(ck / rel, keep)
    return damage


def _write(rel, data):
    return lambda ck: (ck / rel).write_bytes(data)


DAMAGE = {
    "no-manifest-truncated-model": (_no_manifest_and("model.safetensors"), "no manifest.json"),
    "no-manifest-truncated-train-state": (_no_manifest_and("train_state.json"),
                                          "no manifest.json"),
    "no-manifest-truncated-config": (_no_manifest_and("config.yaml", 3), "no manifest.json"),
    "manifest-not-json": (_write("manifest.json", b"{not json"), "unreadable manifest"),
    "manifest-zero-bytes": (_write("manifest.json", b""), "unreadable manifest"),
    "manifest-files-not-a-mapping": (_write("manifest.json", b'{"format": 2, "files": [1]}'),
                                     "unreadable manifest"),
    "manifest-a-list": (_write("manifest.json", b"[2]"), "unreadable manifest"),
    "model-zero-bytes": (_write("model.safetensors", b""), "file 'model.safetensors' has 0 bytes"),
    "model-truncated": (lambda ck: os.truncate(ck / "model.safetensors", 30),
                        "file 'model.safetensors' has 30 bytes"),
    "train-state-missing": (lambda ck: os.remove(ck / "train_state.json"),
                            "file 'train_state.json' is missing"),
    "train-state-garbage": (_write("train_state.json", b'{"step": 2, "tok'),
                            "file 'train_state.json' has"),
    "emptied": (lambda ck: [os.remove(ck / n) for n in os.listdir(ck)], "empty"),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_auto_resume_passes_over_any_damaged_newest_checkpoint_with_one_warning(tmp_path, kind):
    damage, why = DAMAGE[kind]
    m = saved(tmp_path, 1, 2)
    newest = tmp_path / "checkpoints" / "step_0000002"
    damage(newest)
    warned = []
    assert resolve_resume("auto", m, warn=warned.append).endswith("step_0000001")
    assert len(warned) == 1 and f"checkpoint '{newest}' is unusable (" in warned[0], warned
    assert why in warned[0] and "moved aside" in warned[0], warned
    assert (tmp_path / "checkpoints" / "step_0000002.corrupt").is_dir()


@pytest.mark.parametrize("pointer", [b"step_0000009\n", b"\xff\xfe\x00 not a name", b"",
                                     b"../../etc\n"])
def test_a_latest_pointer_naming_nothing_is_said_once_and_the_newest_good_one_used(tmp_path,
                                                                                  pointer):
    m = saved(tmp_path, 1, 2)
    (tmp_path / "checkpoints" / "latest").write_bytes(pointer)
    warned = []
    assert resolve_resume("auto", m, warn=warned.append).endswith("step_0000002")
    assert len(warned) == 1 and "latest' names" in warned[0] and "step_0000002" in warned[0]
    assert m.latest().endswith("step_0000002")   # readable whatever the pointer holds
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        resolve_resume("never", m)
    (tmp_path / "checkpoints" / "latest").write_text("step_0000001\n")   # behind: a crash
    warned.clear()
    assert resolve_resume("auto", m, warn=warned.append).endswith("step_0000002")
    assert warned == []


def test_when_no_checkpoint_is_usable_the_run_stops_naming_the_directory(tmp_path):
    m = saved(tmp_path, 1, 2)
    for s in (1, 2):
        (tmp_path / "checkpoints" / f"step_{s:07d}" / "manifest.json").write_text("{")
    warned = []
    with pytest.raises(ConfigError, match=r"no usable checkpoint in '.*checkpoints' \(2 tried"):
        resolve_resume("auto", m, warn=warned.append)
    assert len(warned) == 2 and len(m.complete()) == 2   # each named; nothing moved


@pytest.mark.parametrize("fmt,expect", [(3, "written by a newer fp8train (checkpoint format 3"),
                                        (1, "written by another version of fp8train "
                                            "(checkpoint format 1")])
def test_an_intact_checkpoint_of_another_format_is_refused_not_passed_over(tmp_path, fmt,
                                                                           expect):
    import json
    m = saved(tmp_path, 1, 2)
    path = tmp_path / "checkpoints" / "step_0000002" / "manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "format": fmt}))
    for resume in ("auto", str(path.parent), str(tmp_path)):
        with pytest.raises(ConfigError, match=r"cannot resume from '.*step_0000002': it was "
                                              + expect.replace("(", r"\(")):
            resolve_resume(resume, m)
    assert [s for s, _ in m.complete()] == [1, 2]          # nothing moved aside


def test_a_checkpoint_named_explicitly_is_never_replaced_by_another(tmp_path):
    m = saved(tmp_path, 1, 2)
    newest = tmp_path / "checkpoints" / "step_0000002"
    _no_manifest_and("model.safetensors")(newest)
    with pytest.raises(ConfigError, match=f"key 'resume': cannot resume from '{newest}': no "
                                          "manifest.json: every checkpoint"):
        resolve_resume(str(newest), m)
    older = tmp_path / "checkpoints" / "step_0000001"
    (older / "model.safetensors").write_bytes(b"x")
    with pytest.raises(ConfigError, match=f"key 'resume': checkpoint '{older}' is unusable: "
                                          "file 'model.safetensors' has 1 bytes"):
        resolve_resume(str(older), m)
    assert newest.is_dir() and older.is_dir()


def test_resume_paths_that_hold_no_checkpoint_say_what_was_looked_for(tmp_path):
    from fp8train.checkpoint import path_problem
    saved(tmp_path / "runs" / "test_fp8", 1, 2)
    runs, ck = tmp_path / "runs", tmp_path / "runs" / "test_fp8" / "checkpoints"
    (runs / "empty" / "checkpoints").mkdir(parents=True)
    (runs / "crashed").mkdir()
    (runs / "crashed" / "train.log").write_text("")
    (runs / "nothing").mkdir()
    problems = {p: path_problem(str(p)) for p in (
        runs / "tst_fp8", ck, ck / "step_0000002" / "model.safetensors", ck / "step_0000003",
        runs / "empty", runs / "crashed", runs / "nothing", runs)}
    assert problems == {
        runs / "tst_fp8": f"checkpoint '{runs}/tst_fp8' not found (did you mean "
                          f"'{runs}/test_fp8'?)",
        ck: f"'{ck}' is not a checkpoint directory: it holds checkpoints (did you mean the run "
            f"directory '{ck.parent}', or '{ck}/step_0000002'?)",
        ck / "step_0000002" / "model.safetensors":
            f"'{ck}/step_0000002/model.safetensors' is not a checkpoint directory: it is a "
            f"file; name a checkpoint directory (checkpoints/step_N) or a run directory (did "
            f"you mean its directory '{ck}/step_0000002'?)",
        ck / "step_0000003": f"checkpoint '{ck}/step_0000003' not found (did you mean "
                             f"'{ck}/step_0000002' or '{ck}/step_0000001'?)",
        runs / "empty": f"run directory '{runs}/empty' holds no checkpoint ('{runs}/empty/"
                        f"checkpoints' has no step_N directory)",
        runs / "crashed": f"run directory '{runs}/crashed' holds no checkpoint (no checkpoints/ "
                          f"in it: the run saved none)",
        runs / "nothing": f"'{runs}/nothing' is not a checkpoint directory (nor a run directory "
                          f"with checkpoints/): it is empty",
        runs: f"'{runs}' is not a checkpoint directory (nor a run directory with checkpoints/): "
              f"it has no model.safetensors and no checkpoints/ (did you mean "
              f"'{runs}/test_fp8'?)"}
    assert path_problem(str(ck / "step_0000002")) is None and path_problem(str(ck.parent)) is None


def test_auto_that_finds_nothing_says_so_unless_a_sweep_trial_implied_it(tmp_path):
    saved(tmp_path / "runs" / "test_fp8", 1)
    warned = []
    typo = CheckpointManager(str(tmp_path / "runs" / "test_fp9"), keep=3)
    assert resolve_resume("auto", typo, warn=warned.append) is None
    assert warned == [f"resume auto: no checkpoint in '{typo.dir}' (it does not exist) (did you "
                      f"mean '{tmp_path}/runs/test_fp8'?); starting a new run"]
    warned.clear()
    assert resolve_resume("auto", typo, warn=warned.append, announce=False) is None
    assert warned == []


def test_a_checkpoints_path_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "checkpoints").write_text("x")
    for resume in ("auto", "never"):
        with pytest.raises(ConfigError, match="checkpoints' is a file"):
            resolve_resume(resume, CheckpointManager(str(tmp_path), keep=3))


def test_every_checkpoint_file_gets_the_mode_of_a_new_file(tmp_path):
    """safetensors writes through a 0600 temporary file; the checkpoint must not keep that."""
    old = os.umask(0o002)
    try:
        probe = tmp_path / "probe"
        probe.write_text("")
        want = probe.stat().st_mode & 0o777
        m = saved(tmp_path / "run", 1)
    finally:
        os.umask(old)
    assert want == 0o664
    files = [os.path.join(d, f) for d, _, names in os.walk(m.dir) for f in names]
    assert len(files) >= 5
    assert {f: os.stat(f).st_mode & 0o777 for f in files} == {f: want for f in files}


# --- the same, end to end: real runs of train_fp8.py ---------------------------------------------

def test_real_runs_print_each_save_keep_modes_pass_over_damage_and_refuse_a_mismatch(tmp_path):
    """A 2-step run under umask 002, started with --resume in a new directory (a warning
    says that nothing was resumed): a console line per checkpoint, every file it wrote
    group-writable like any new file; then its newest checkpoint loses its manifest and half its
    model, and --resume continues from the older one with one warning; an intact checkpoint of
    another shape is refused as a mismatch, not passed over."""
    from conftest import DATA_DIR, run_train, tiny_args
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


@pytest.mark.parametrize("where", ["listdir", "open"])
def test_a_read_error_that_proves_nothing_moves_no_checkpoint_aside(tmp_path, monkeypatch, where):
    """EIO from a network filesystem's hiccup (simulated: it cannot be produced on a local disk)
    says nothing about the checkpoint: the resume stops in one line, and nothing is moved aside,
    where a missing file would have been passed over."""
    import errno

    import fp8train.checkpoint as ckpt
    m = saved(tmp_path, 1, 2)
    newest = str(tmp_path / "checkpoints" / "step_0000002")
    real = {"listdir": os.listdir, "open": open}[where]

    def flaky(path, *a, **k):
        if str(path).startswith(newest):
            raise OSError(errno.EIO, "Input/output error", str(path))
        return real(path, *a, **k)
    if where == "open":
        monkeypatch.setattr("builtins.open", flaky)
    else:
        monkeypatch.setattr(ckpt.os, where, flaky)
    with pytest.raises(ConfigError, match=r"step_0000002' cannot be read \(.*nothing was moved"):
        resolve_resume("auto", m, warn=lambda msg: None)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["latest", "step_0000001",
                                                            "step_0000002"]
