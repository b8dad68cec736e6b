"""Checkpoint directory bookkeeping (the save itself is exercised end to end in test_train)."""

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
