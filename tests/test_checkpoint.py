"""Checkpoint directory bookkeeping (the save itself is exercised end to end in test_train)."""

import os

import pytest

from fp8train.checkpoint import CheckpointManager, resolve_resume
from fp8train.config import ConfigError


def make(root, *steps):
    for s in steps:
        d = root / "checkpoints" / f"step_{s:07d}"
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"x")


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
    make(tmp_path, 5)
    m = CheckpointManager(str(tmp_path), keep=3)
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        resolve_resume("never", m)
    assert resolve_resume("auto", m).endswith("step_0000005")
    assert resolve_resume(str(tmp_path), m).endswith("step_0000005")  # a run directory
    with pytest.raises(ConfigError, match="not a checkpoint directory"):
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
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "model.safetensors"), "wb") as fh:
            fh.write(b"weights")

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
