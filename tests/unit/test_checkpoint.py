"""Checkpoint directory bookkeeping (the save itself is exercised end to end in test_train)."""


import os

import pytest

from fp8train.checkpoint.locate import resolve_resume
from fp8train.checkpoint.manager import CheckpointManager
from fp8train.checkpoint.train_state import TrainState
from fp8train.errors import BadInput


pytestmark = pytest.mark.usefixtures("no_accelerate_state_left")


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
    with pytest.raises(BadInput, match="already holds checkpoints"):
        resolve_resume("never", m)
    assert resolve_resume("auto", m).endswith("step_0000005")
    assert resolve_resume(str(tmp_path), m).endswith("step_0000005")  # a run directory
    with pytest.raises(BadInput, match="not a checkpoint directory: it holds checkpoints"):
        resolve_resume(str(tmp_path / "checkpoints"), m)


def test_changed_on_resume_reports_only_keys_that_change_training(tmp_path):
    from fp8train.checkpoint.files import CONFIG_NAME
    from fp8train.checkpoint.saved_config import changed_on_resume
    from fp8train.config import load as C
    cfg = C.load_config(["--max_steps=100", "--warmup_steps=10"])
    (tmp_path / CONFIG_NAME).write_text(C.dump_yaml(cfg, {"world_size": 1}))
    now = C.to_dict(cfg)
    assert changed_on_resume(str(tmp_path), now) == []
    now.update(max_steps=200, log_interval=1, learning_rate=1e-3, seed=7)
    assert changed_on_resume(str(tmp_path), now) == ["seed 1337 -> 7",
                                                     "learning_rate 0.0006 -> 0.001"]
    assert changed_on_resume(str(tmp_path / "elsewhere"), now) == []  # older checkpoints


def test_a_key_inert_in_both_runs_is_no_change_on_resume(tmp_path):
    """A bf16 run saved when fp8_recipe's default was 'auto' resumes under today's default
    ('delayed' for native): with FP8 off in both, the recipe changes nothing. Turning FP8 on,
    or the recipe of a run that trains in FP8, is still a change."""
    import yaml

    from fp8train.checkpoint.files import CONFIG_NAME
    from fp8train.checkpoint.saved_config import changed_on_resume
    from fp8train.config import load as C
    old = C.to_dict(C.load_config(["--max_steps=100", "--no_fp8"]))
    old["fp8_recipe"] = "auto"
    (tmp_path / CONFIG_NAME).write_text(yaml.safe_dump(old))
    now = C.to_dict(C.load_config(["--max_steps=100", "--no_fp8"]))
    assert now["fp8_recipe"] == "delayed" and changed_on_resume(str(tmp_path), now) == []
    on = dict(now, use_fp8=True)
    assert changed_on_resume(str(tmp_path), on) == ["use_fp8 False -> True",
                                                    "fp8_recipe 'auto' -> 'delayed'"]


def test_train_clock_excludes_paused_time():
    import torch

    from support.runs import FakeClock

    from fp8train.observe.metrics import TrainClock
    now = FakeClock()
    clock = TrainClock(torch.device("cpu"), clock=now)
    now.advance(0.05)
    clock.pause()
    now.advance(0.3)  # an evaluation or a checkpoint
    clock.resume()
    now.advance(0.05)
    assert clock.take() == pytest.approx(0.1)
    now.advance(0.02)
    assert clock.take() == pytest.approx(0.02)  # take() starts a new interval


def test_manifest_verification_catches_every_kind_of_damage(tmp_path):
    import json

    from fp8train.checkpoint.files import MANIFEST, checksums
    from fp8train.checkpoint.verify import verify
    d = tmp_path / "step_0000001"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"weights" * 100)
    (d / "optimizer.bin").write_bytes(b"moments" * 100)
    assert verify(str(d)) == (None, "no manifest (written by an older fp8train): not verified")
    (d / MANIFEST).write_text(json.dumps({"step": 1, "files": checksums(str(d))}))
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
    from fp8train.checkpoint.saved_config import config_hash
    from fp8train.config import load as C
    base = C.to_dict(C.load_config(["--max_steps=100", "--warmup_steps=10"]))
    h = config_hash(base)
    assert config_hash({**base, "log_interval": 1, "max_steps": 5000, "output_dir": "x"}) == h
    assert config_hash({**base, "learning_rate": 1e-3}) != h
    assert config_hash({**base, "data": {"train_tokens": 1}}) != config_hash(
        {**base, "data": {"train_tokens": 2}})


def test_changed_on_resume_compares_data_size_and_effective_batch(tmp_path):
    from fp8train.checkpoint.files import CONFIG_NAME
    from fp8train.checkpoint.saved_config import changed_on_resume
    from fp8train.config import load as C
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

    from fp8train.checkpoint.train_state import TrainState
    from fp8train.evaluate.evaluator import EvalRecord
    st = TrainState()
    st.step, st.tokens, st.data_position, st.train_seconds = 7, 7168, 112, 0.1 + 0.2
    back = TrainState.from_dict(json.loads(json.dumps(st.to_dict())))
    assert back.to_dict() == st.to_dict() and back.train_seconds == 0.1 + 0.2
    assert TrainState.from_dict({"step": 3}).to_dict() == {**TrainState().to_dict(), "step": 3}
    for bad in ({"step": 1.5}, {"step": True}, {"rollbacks": 1.0}, [1]):
        with pytest.raises(ValueError):
            TrainState.from_dict(bad)
    rec = EvalRecord()
    rec.best_val_loss, rec.best_val_step = 3.866330146789551, 6
    back = EvalRecord()
    back.load_state_dict(json.loads(json.dumps(rec.state_dict())))
    assert back.state_dict() == rec.state_dict()
    with pytest.raises(ValueError):
        back.load_state_dict({"best_val_loss": "x", "best_val_step": 9})
    assert back.state_dict() == rec.state_dict()   # a bad value sets nothing


def test_the_train_state_holds_counters_only():
    """Every value of TrainState is a count, a token or data position, or a time: what a
    component decides (the evaluator's best loss and target, the precision's remedies, the log
    interval in progress) is that component's state."""
    from fp8train.checkpoint.train_state import TrainState
    assert set(TrainState().to_dict()) == {
        "step", "tokens", "data_position", "train_seconds", "skipped_steps", "rollbacks",
        "wall_seconds", "steady_tokens", "steady_seconds", "checkpoints_written"}
    assert all(type(v) in (int, float) for v in TrainState().to_dict().values())


def test_save_writes_in_four_phases_and_restore_reads_the_json(tmp_path, monkeypatch):
    import json

    from support.faults import install_save_faults

    from fp8train.checkpoint.files import MANIFEST, TRAIN_STATE
    from fp8train.checkpoint.train_state import TrainState
    from fp8train.checkpoint.verify import verify
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


class _Remedies:
    """A component with state of its own, as the precision is (its remedies)."""

    def __init__(self, **state):
        self.state = dict(state)

    def state_dict(self):
        return dict(self.state)

    def load_state_dict(self, state):
        self.state = dict(state)


def test_components_keep_their_own_state_beside_the_counters(tmp_path):
    """train_state.json: the counters, and {name: component.state_dict()} under `components`;
    restore hands each component its own."""
    import json

    from fp8train.checkpoint.files import TRAIN_STATE
    from fp8train.checkpoint.train_state import TrainState
    m = CheckpointManager(str(tmp_path), keep=3)
    acc, st = _OneProcess(), TrainState()
    st.step = 4
    saved = _Remedies(margin_added=1, off=False, off_reason="", handed_over=False)
    path = m.save(acc, st, "", {}, components={"precision": saved})
    on_disk = json.loads(open(os.path.join(path, TRAIN_STATE)).read())
    assert on_disk == {**st.to_dict(), "components": {"precision": saved.state}}
    back, fresh = _Remedies(), TrainState()
    m.restore(acc, path, fresh, {"precision": back, "absent": _Remedies(x=1)})
    assert fresh.step == 4 and back.state == saved.state
    assert all(k not in st.to_dict() for k in ("fp8_margin_added", "fp8_off"))   # counters only


def test_a_checkpoint_of_the_previous_format_resumes_its_precisions_remedies(tmp_path):
    """train_state.json as fp8train wrote it before the precision kept its own state: its
    remedies were counters (fp8_margin_added, fp8_off, fp8_off_reason, and fp8_until_tokens
    for the hand-over). Such a checkpoint resumes, into a real native FP8 precision: the margin
    raised twice, FP8 off for the reason it gave."""
    import json
    from pathlib import Path

    import torch

    from fp8train.model import GPT, model_config_from

    from fp8train.checkpoint.files import TRAIN_STATE
    from fp8train.checkpoint.train_state import TrainState
    from fp8train.config.load import Config
    from fp8train.precision import build_precision
    m = CheckpointManager(str(tmp_path), keep=3)
    acc, st = _OneProcess(), TrainState()
    st.step, st.tokens, st.rollbacks = 9, 9000, 2
    path = m.save(acc, st, "", {})
    old = {**st.to_dict(), "fp8_margin_added": 2, "fp8_off": True,
           "fp8_off_reason": "for its loss gap (fp8_gap_action: recover)",
           "fp8_until_tokens": None}
    (Path(path) / TRAIN_STATE).write_text(json.dumps(old, indent=1, sort_keys=True))
    prec = build_precision(Config(use_fp8=True, fp8_backend="native", fp8_margin=1),
                           torch.device("cpu"), warn=pytest.fail)
    prec.convert(GPT(model_config_from("tiny", 256, 64)))   # as a resume converts, then loads
    fresh = TrainState()
    m.restore(acc, path, fresh, {"precision": prec})
    assert (fresh.step, fresh.tokens, fresh.rollbacks) == (9, 9000, 2)
    assert prec.state_dict() == dict(margin_added=2, off=True, handed_over=False,
                                     handed_over_tokens=None,
                                     off_reason="for its loss gap (fp8_gap_action: recover)")
    assert prec.margin() == 3 and "switched off for its loss gap" in prec.derived()["fp8"]


def test_a_checkpoint_whose_counters_held_the_evaluator_and_interval_resumes_them(tmp_path):
    """train_state.json as the release before this one wrote it: the precision's remedies under
    `components`, but the evaluator's record (best_val_*, target*), the log interval in
    progress (interval_*) and fp8_until's hand-over (fp8_until_tokens) as counters. Each
    component gets its own back, and the counters keep theirs."""
    import json
    from pathlib import Path

    from fp8train.checkpoint.files import TRAIN_STATE
    from fp8train.checkpoint.train_state import TrainState
    from fp8train.evaluate.evaluator import EvalRecord
    from fp8train.train.health import IntervalCarry
    m = CheckpointManager(str(tmp_path), keep=3)
    acc, st = _OneProcess(), TrainState()
    st.step, st.tokens = 12, 6144
    path = m.save(acc, st, "", {})
    old = {**st.to_dict(), "fp8_until_tokens": 5120, "best_val_loss": 3.5, "best_val_step": 10,
           "target": 3.6, "target_step": 10, "time_to_target_s": 1.5, "tokens_to_target": 5120,
           "interval_steps": 2, "interval_bad": 1, "interval_loss_sum": 3.25,
           "interval_penalty_sum": 0.0, "interval_loss_max": 3.25,
           "components": {"precision": {"margin_added": 0, "off": True, "handed_over": True,
                                        "off_reason": "after non-finite steps (fp8_recovery)"}}}
    (Path(path) / TRAIN_STATE).write_text(json.dumps(old, indent=1, sort_keys=True))
    fresh, prec, rec, carry = TrainState(), _Remedies(), EvalRecord(), IntervalCarry()
    m.restore(acc, path, fresh, {"precision": prec, "evaluator": rec, "interval": carry})
    assert fresh.to_dict() == st.to_dict()
    assert prec.state["handed_over_tokens"] == 5120 and prec.state["handed_over"] is True
    assert rec.state_dict() == dict(best_val_loss=3.5, best_val_step=10, target=3.6,
                                    target_step=10, time_to_target_s=1.5, tokens_to_target=5120)
    assert carry.state_dict() == dict(steps=2, bad=1, loss_sum=3.25, penalty_sum=0.0,
                                      loss_max=3.25)


def test_restore_refuses_another_format_before_loading_anything(tmp_path):
    import json

    from fp8train.checkpoint.files import MANIFEST, TRAIN_STATE
    from fp8train.checkpoint.train_state import TrainState
    m = CheckpointManager(str(tmp_path), keep=3)
    acc, st = _OneProcess(), TrainState()
    st.step = 5
    path = m.save(acc, st, "", {})
    manifest = json.loads(open(os.path.join(path, MANIFEST)).read())
    (tmp_path / "checkpoints" / "step_0000005" / MANIFEST).write_text(
        json.dumps({**manifest, "format": 1}))
    with pytest.raises(BadInput, match=r"cannot resume from .*step_0000005': it was written "
                                          r"by another version of fp8train \(checkpoint format 1; "
                                          r"this version resumes checkpoint format 2"):
        m.restore(acc, path, TrainState())
    (tmp_path / "checkpoints" / "step_0000005" / MANIFEST).write_text(json.dumps(manifest))
    (tmp_path / "checkpoints" / "step_0000005" / TRAIN_STATE).write_text('{"step": "five"}')
    with pytest.raises(BadInput, match=f"{TRAIN_STATE} cannot be read"):
        m.restore(acc, path, TrainState())
    assert acc.loaded is None


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
    with pytest.raises(BadInput, match="already holds checkpoints"):
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
    with pytest.raises(BadInput, match=r"no usable checkpoint in '.*checkpoints' \(2 tried"):
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
        with pytest.raises(BadInput, match=r"cannot resume from '.*step_0000002': it was "
                                              + expect.replace("(", r"\(")):
            resolve_resume(resume, m)
    assert [s for s, _ in m.complete()] == [1, 2]          # nothing moved aside


def test_a_checkpoint_named_explicitly_is_never_replaced_by_another(tmp_path):
    m = saved(tmp_path, 1, 2)
    newest = tmp_path / "checkpoints" / "step_0000002"
    _no_manifest_and("model.safetensors")(newest)
    with pytest.raises(BadInput, match=f"key 'resume': cannot resume from '{newest}': no "
                                          "manifest.json: every checkpoint"):
        resolve_resume(str(newest), m)
    older = tmp_path / "checkpoints" / "step_0000001"
    (older / "model.safetensors").write_bytes(b"x")
    with pytest.raises(BadInput, match=f"key 'resume': checkpoint '{older}' is unusable: "
                                          "file 'model.safetensors' has 1 bytes"):
        resolve_resume(str(older), m)
    assert newest.is_dir() and older.is_dir()


def test_resume_paths_that_hold_no_checkpoint_say_what_was_looked_for(tmp_path):
    from fp8train.checkpoint.locate import path_problem
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
        with pytest.raises(BadInput, match="checkpoints' is a file"):
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


@pytest.mark.parametrize("where", ["listdir", "open"])
def test_a_read_error_that_proves_nothing_moves_no_checkpoint_aside(tmp_path, monkeypatch, where):
    """EIO from a network filesystem's hiccup (simulated: it cannot be produced on a local disk)
    says nothing about the checkpoint: the resume stops in one line, and nothing is moved aside,
    where a missing file would have been passed over."""
    import errno

    import fp8train.checkpoint.verify as ckpt
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
    with pytest.raises(BadInput, match=r"step_0000002' cannot be read \(.*nothing was moved"):
        resolve_resume("auto", m, warn=lambda msg: None)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["latest", "step_0000001",
                                                            "step_0000002"]


def test_host_copy_is_taken_at_once_keeps_tied_tensors_tied_and_reuses_its_buffers():
    from collections import OrderedDict

    import torch

    from fp8train.checkpoint.host_copy import HostCopy
    w = torch.randn(4, 3)
    flat = torch.arange(6.0)
    model = OrderedDict(wte=w, head=w.detach(), view=flat[2:5], n=3)   # head tied to wte
    model._metadata = {"": {"version": 1}}
    opt = {"state": {0: {"step": torch.tensor(2.0), "exp_avg": torch.ones(2)}},
           "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": [0]}]}
    copier = HostCopy()
    m, o = copier.copy((model, opt))
    before = w.clone()
    w.add_(1.0)                                   # training goes on, in place
    flat.zero_()
    opt["state"][0]["exp_avg"].add_(1.0)
    opt["param_groups"][0]["params"].append(1)
    assert torch.equal(m["wte"], before) and torch.equal(m["head"], before)
    assert m["wte"].untyped_storage().data_ptr() == m["head"].untyped_storage().data_ptr()
    assert m["view"].tolist() == [2.0, 3.0, 4.0] and m["view"].storage_offset() == 2
    assert isinstance(m, OrderedDict) and m._metadata == model._metadata and m["n"] == 3
    assert o["state"][0]["exp_avg"].tolist() == [1.0, 1.0]
    assert o["param_groups"] == [{"lr": 0.1, "betas": (0.9, 0.95), "params": [0]}]
    # 3 storages copied: w (shared by two entries), flat, and the optimizer's two tensors
    assert copier.nbytes == 4 * 3 * 4 + 6 * 4 + 4 + 2 * 4
    again, _ = copier.copy((model, opt))
    assert again["wte"].untyped_storage().data_ptr() == m["wte"].untyped_storage().data_ptr()
    assert torch.equal(again["wte"], w)           # the same buffer, the new values


def test_a_background_save_writes_what_save_state_writes_as_of_its_step(tmp_path, monkeypatch):
    """A real Accelerator, a tiny GPT (tied embeddings) and fused AdamW after one step. The
    background save copies at the step; its writer is held while training goes on (parameters,
    moments and the RNG all change); released, it writes exactly the files a synchronous save
    (Accelerate's save_state) wrote at that step, through the same atomic phases."""
    import json
    import threading
    import time

    import torch
    from accelerate import Accelerator

    from fp8train.checkpoint.files import MANIFEST, read_manifest
    from fp8train.checkpoint.host_copy import HostCopy
    from fp8train.checkpoint.verify import verify
    from fp8train.model import GPT, ModelConfig
    torch.manual_seed(0)
    model = GPT(ModelConfig(arch="gpt2", n_layer=1, n_head=2, n_embd=16, ffn_hidden_size=32,
                            vocab_size=100, block_size=8))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    model(torch.randint(0, 100, (2, 8))).float().mean().backward()
    opt.step()
    acc = Accelerator(cpu=True)
    model, opt = acc.prepare(model, opt)
    st = TrainState()
    st.step, st.tokens = 1, 16
    sync = CheckpointManager(str(tmp_path / "sync"), keep=3).save(acc, st, "c: 1\n", {})
    release, original = threading.Event(), CheckpointManager._write_in_background

    def held(self, *args):   # the whole background part waits: nothing of it runs before
        assert release.wait(60)
        original(self, *args)

    monkeypatch.setattr(CheckpointManager, "_write_in_background", held)
    job = CheckpointManager(str(tmp_path / "async"), keep=3).save_in_background(
        acc, st, "c: 1\n", {"async": True}, HostCopy(), time.perf_counter(), model, opt)
    torch.rand(3)                                  # the RNG moves on
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    for state in opt.state.values():
        state["exp_avg"].add_(1.0)
    assert not job.done() and not os.path.exists(job.path)   # still being written
    release.set()
    assert job.wait() is None and job.done() and job.save_s > 0
    assert job.path == str(tmp_path / "async" / "checkpoints" / "step_0000001")
    assert verify(job.path)[0] is None
    names = sorted(os.listdir(sync))
    assert names == sorted(os.listdir(job.path)) and "optimizer.bin" in names
    for name in names:
        if name != MANIFEST:
            assert (tmp_path / "async" / "checkpoints" / "step_0000001" / name).read_bytes() == \
                open(os.path.join(sync, name), "rb").read(), name
    manifest = read_manifest(job.path)
    assert manifest["async"] is True and manifest["save_s"] > 0
    assert json.loads(open(os.path.join(sync, MANIFEST)).read())["files"] == manifest["files"]
    assert (tmp_path / "async" / "checkpoints" / "latest").read_text().strip() == "step_0000001"


def test_a_failed_background_write_leaves_nothing_and_is_agreed_at_the_wait(tmp_path,
                                                                            monkeypatch):
    import time

    import torch
    from accelerate import Accelerator

    from fp8train.checkpoint.host_copy import HostCopy
    acc = Accelerator(cpu=True)
    lin = torch.nn.Linear(2, 2)
    lin, opt = acc.prepare(lin, torch.optim.AdamW(lin.parameters()))

    def full(self, tmp, step, optimizers):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(CheckpointManager, "_write_optimizer_copy", full)
    m = CheckpointManager(str(tmp_path), keep=3)
    st = TrainState()
    st.step = 4
    job = m.save_in_background(acc, st, "", {}, HostCopy(), time.perf_counter(), lin, opt)
    assert job.wait() == "No space left on device"
    assert os.listdir(m.dir) == [] and m.latest() is None   # the partial write removed


# `scontrol show job 2` of a running job submitted with `sbatch --signal=B:USR1@90 job.sh`, its
# script holding `#SBATCH --signal=B:USR1@120`, on the Slurm 22.05.8 cluster tests/support/slurm_cluster.py
# starts (2026-11-27). No field holds either signal (`scontrol -d` adds none; job 1, submitted
# without the option, printed the same apart from its id): the window has to come from the script.
SHOW_JOB_22_05 = (
    "JobId=2 JobName=sigcheck\n"
    "   UserId=root(0) GroupId=root(0) MCS_label=N/A\n"
    "   Priority=4294901758 Nice=0 Account=(null) QOS=(null)\n"
    "   JobState=RUNNING Reason=None Dependency=(null)\n"
    "   Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0\n"
    "   RunTime=00:00:02 TimeLimit=00:05:00 TimeMin=N/A\n"
    "   SubmitTime=2026-11-27T23:36:13 EligibleTime=2026-11-27T23:36:13\n"
    "   AccrueTime=2026-11-27T23:36:13\n"
    "   StartTime=2026-11-27T23:36:14 EndTime=2026-11-27T23:41:14 Deadline=N/A\n"
    "   SuspendTime=None SecsPreSuspend=0 LastSchedEval=2026-11-27T23:36:14 Scheduler=Backfill\n"
    "   Partition=debug AllocNode:Sid=localhost:2870\n"
    "   ReqNodeList=(null) ExcNodeList=(null)\n"
    "   NodeList=vm\n"
    "   BatchHost=vm\n"
    "   NumNodes=1 NumCPUs=1 NumTasks=1 CPUs/Task=1 ReqB:S:C:T=0:0:*:*\n"
    "   TRES=cpu=1,node=1,billing=1\n"
    "   Socks/Node=* NtasksPerN:B:S:C=0:0:*:* CoreSpec=*\n"
    "   MinCPUsNode=1 MinMemoryNode=0 MinTmpDiskNode=0\n"
    "   Features=(null) DelayBoot=00:00:00\n"
    "   OverSubscribe=OK Contiguous=0 Licenses=(null) Network=(null)\n"
    "   Command=/tmp/slurmcap/job.sh\n"
    "   WorkDir=/tmp/slurmcap\n"
    "   StdErr=/dev/null\n"
    "   StdIn=/dev/null\n"
    "   StdOut=/dev/null\n"
    "   Power=\n"
)


def test_signal_specs_and_batch_scripts_parse_as_sbatch_reads_them():
    from support.runs import ROOT

    from fp8train.checkpoint.stop_window import (parse_signal, signal_in_script,
                                                 signal_in_submit_line)
    assert [parse_signal(s) for s in ("B:USR1@120", "USR1@90", "R:10@300", "SIGTERM@5",
                                      "RB:USR2@7", "USR1", "B:USR1@", "@120", "")] == \
        [120, 90, 300, 5, 7, 60, None, None, None]
    assert signal_in_script((ROOT / "submit_fp8.sh").read_text()) == "B:USR1@120"
    assert signal_in_script("#!/bin/bash\n#SBATCH --signal=USR1@30\n#SBATCH --signal B:USR2@45"
                            "  # later wins\n##SBATCH --signal=USR1@999\necho hi\n"
                            "#SBATCH --signal=USR1@1\n") == "B:USR2@45"   # not after a command
    assert signal_in_script("#!/bin/bash\necho\n") is None
    line = "   SubmitLine=sbatch --signal=B:USR1@300 --export=ALL submit_fp8.sh --max_steps=9\n"
    assert signal_in_submit_line("JobId=5 JobName=x\n" + line) == "B:USR1@300"
    assert signal_in_submit_line("JobId=5 JobName=x\n   SubmitLine=sbatch x.sh\n") is None
    assert signal_in_submit_line(SHOW_JOB_22_05) is None and "USR1" not in SHOW_JOB_22_05


def test_the_window_is_the_key_else_the_slurm_jobs_signal_and_never_an_error():
    from support.runs import ROOT

    from fp8train.checkpoint.stop_window import find_window
    script = (ROOT / "submit_fp8.sh").read_text()
    show_job = SHOW_JOB_22_05
    calls = []

    def scontrol(args):
        calls.append(args)
        return {("show", "job", "7"): show_job,   # job 7 here: the ids play no part
                ("write", "batch_script", "7", "-"): script}[tuple(args)]

    assert find_window(90.0, env={"SLURM_JOB_ID": "7"}, run=scontrol) == \
        (90.0, "checkpoint_window_s") and calls == []
    assert find_window(None, env={}, run=scontrol)[0] is None and calls == []
    assert find_window(None, env={"SLURM_JOB_ID": "7"}, run=scontrol) == \
        (120.0, "#SBATCH --signal=B:USR1@120 in the batch script of job 7")
    assert find_window(None, env={"SLURM_JOB_ID": "7", "SBATCH_SIGNAL": "USR1@200"},
                       run=scontrol) == (200.0, "SBATCH_SIGNAL=USR1@200 in the environment of "
                                                "job 7")
    newer = show_job + "   SubmitLine=sbatch --signal=B:USR1@600 submit_fp8.sh\n"
    assert find_window(None, env={"SLURM_JOB_ID": "7", "SBATCH_SIGNAL": "USR1@200"},
                       run=lambda args: newer if args[0] == "show" else script)[0] == 600.0

    def broken(args):
        raise FileNotFoundError(2, "No such file or directory: 'scontrol'")

    seconds, why = find_window(None, env={"SLURM_JOB_ID": "7"}, run=broken)
    assert seconds is None and "No such file or directory" in why
    seconds, why = find_window(None, env={"SLURM_JOB_ID": "7"},
                               run=lambda args: "" if args[0] == "show" else "#!/bin/sh\nx\n")
    assert seconds is None and "no #SBATCH --signal line" in why


def _checkpointer(tmp_path, layout="NO", window=(None, "unknown"), resumed=None, **keys):
    from types import SimpleNamespace

    from fp8train.checkpoint.checkpointer import Checkpointer
    said = []
    log = SimpleNamespace(warn=lambda m: said.append("WARNING: " + m), msg=said.append,
                          file_only=lambda m: said.append("file: " + m), log=said.append)
    acc = SimpleNamespace(distributed_type=layout, is_main_process=True)
    from fp8train.config.load import Config, section
    ck = section(Config(**dict(dict(checkpoint_async=False, checkpoint_interval=10), **keys)),
                 "checkpoint")
    return Checkpointer(ck, CheckpointManager(str(tmp_path), 3), acc, log, "", "h",
                        resumed=resumed, window=lambda configured: window), said


def test_checkpoint_async_under_fsdp_says_so_once_and_saves_synchronously(tmp_path):
    c, said = _checkpointer(tmp_path, layout="FSDP", checkpoint_async=True)
    assert not c.background and c.copier is None
    assert [m for m in said if m.startswith("WARNING")] == [
        "WARNING: checkpoint_async: not available under FSDP (every rank writes its shards "
        "collectively, through torch.distributed.checkpoint): each checkpoint is written before "
        "training goes on"]
    c, said = _checkpointer(tmp_path, checkpoint_async=True)
    assert c.background and not [m for m in said if m.startswith("WARNING")]


def test_a_save_over_half_the_window_is_warned_about_once(tmp_path):
    import json
    c, said = _checkpointer(tmp_path, window=(120.0, "#SBATCH --signal=B:USR1@120 in the batch "
                                                     "script of job 7"))
    assert said == ["file: preemption window: 120 s (#SBATCH --signal=B:USR1@120 in the batch "
                    "script of job 7)"]
    c._check_window(60.0, "checkpoint step 3 took")            # exactly half: fits
    c._check_window(61.0, "checkpoint step 6 took")
    c._check_window(90.0, "checkpoint step 9 took")            # said once
    warned = [m for m in said if m.startswith("WARNING")]
    assert warned == [
        "WARNING: checkpoint step 6 took 61.0 s to save, over half of the 120 s a stop signal "
        "leaves before the kill (#SBATCH --signal=B:USR1@120 in the batch script of job 7): a "
        "stop may be killed before its checkpoint is complete, and the requeued job then "
        "resumes from the one before; give the stop more time (sbatch --signal=B:USR1@180) or "
        "write output_dir to faster storage; checkpoint_async: true with a shorter "
        "checkpoint_interval makes a stop that runs out of time lose less"]
    # at start, for the checkpoint a run resumes from (its manifest's save_s)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "manifest.json").write_text(json.dumps({"format": 2, "save_s": 75.5}))
    c, said = _checkpointer(tmp_path, window=(120.0, "checkpoint_window_s"), resumed=str(ckpt),
                            checkpoint_async=True)
    warned = [m for m in said if m.startswith("WARNING")]
    assert len(warned) == 1 and warned[0].startswith(
        f"WARNING: the checkpoint this run resumed from ('{ckpt}') took 75.5 s to save, over "
        "half of the 120 s") and warned[0].endswith("(a stop also waits for a background write "
                                                     "in flight: it can take two saves)")
    c._check_window(100.0, "checkpoint step 3 took")
    assert len([m for m in said if m.startswith("WARNING")]) == 1
    # no window known: nothing is compared
    c, said = _checkpointer(tmp_path, resumed=str(ckpt))
    c._check_window(1e6, "checkpoint step 3 took")
    assert said == ["file: preemption window unknown (unknown): checkpoint saves are timed, not "
                    "compared with it"]


def _async_checkpointer(tmp_path):
    """A Checkpointer with checkpoint_async on over a real Accelerator and a prepared Linear,
    and the list of what it says."""
    from types import SimpleNamespace

    import torch
    from accelerate import Accelerator

    from fp8train.checkpoint.checkpointer import Checkpointer
    acc = Accelerator(cpu=True)
    lin = torch.nn.Linear(2, 2)
    lin, opt = acc.prepare(lin, torch.optim.AdamW(lin.parameters()))
    said = []
    log = SimpleNamespace(warn=lambda m: said.append("WARNING: " + m), msg=said.append,
                          file_only=lambda m: None, log=lambda row: None)
    from fp8train.config.load import Config, section
    ck = section(Config(checkpoint_async=True, checkpoint_interval=2), "checkpoint")
    return Checkpointer(ck, CheckpointManager(str(tmp_path), 3), acc, log, "", "h",
                        window=lambda configured: (None, "unknown"), model=lin,
                        optimizer=opt), said


def test_a_host_copy_that_fails_turns_async_off_and_saves_now(tmp_path, monkeypatch):
    """The copy into host memory fails (on a GPU: the pinned-memory allocation, which cannot
    happen here, so HostCopy.copy is made to raise as CUDA's allocator does): that checkpoint is
    written synchronously at once, with one warning, and so is every later one."""
    from fp8train.checkpoint.files import read_manifest
    from fp8train.checkpoint.host_copy import HostCopy

    def no_pinned_memory(self, obj):
        raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")

    monkeypatch.setattr(HostCopy, "copy", no_pinned_memory)
    c, said = _async_checkpointer(tmp_path)
    st = TrainState()
    for step in (2, 4):
        st.step = step
        assert c.save(st, False, 1.0, lambda: False)
        assert c.pending is None and c.latest().endswith(f"step_{step:07d}")
        assert "async" not in read_manifest(c.latest())
    warned = [m for m in said if m.startswith("WARNING")]
    assert len(warned) == 1 and "cudaHostAlloc" in warned[0] and \
        "checkpoint_async is off for the rest of the run" in warned[0]
    assert not c.background and st.checkpoints_written == 2


def test_a_failed_background_write_at_the_end_is_written_again(tmp_path, monkeypatch):
    """A stop that came while a background save was being started ends the run at that step;
    the write then fails in its thread: nothing trained since, so the run's last wait writes the
    same step again, synchronously, instead of ending with exit 1 and losing it."""
    from fp8train.checkpoint.files import read_manifest
    failures = []

    def full_once(self, tmp, step, optimizers):
        failures.append(step)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(CheckpointManager, "_write_optimizer_copy", full_once)
    c, said = _async_checkpointer(tmp_path)
    st = TrainState()
    st.step = 2
    assert c.save(st, False, 1.0, lambda: False) and c.pending is not None
    c.wait(st, final=True)
    assert failures == [2] and c.latest().endswith("step_0000002")
    assert "async" not in read_manifest(c.latest()) and st.checkpoints_written == 1
    warned = [m for m in said if m.startswith("WARNING")]
    assert len(warned) == 1 and "No space left on device" in warned[0] and \
        warned[0].endswith("writing it again before the run ends")


def test_a_components_state_of_the_wrong_kind_is_one_line_and_null_is_none(tmp_path):
    """A damaged or edited train_state.json: a component's value of the wrong kind stops the
    resume in one line naming the file and the component; `"components": null` reads as none."""
    import json
    from pathlib import Path

    from fp8train.checkpoint.files import TRAIN_STATE
    from fp8train.checkpoint.train_state import TrainState
    from fp8train.errors import BadInput
    from fp8train.evaluate.evaluator import EvalRecord
    m = CheckpointManager(str(tmp_path), keep=3)
    acc, st = _OneProcess(), TrainState()
    path = m.save(acc, st, "", {})
    bad = {**st.to_dict(), "components": {"evaluator": {"best_val_loss": "low"}}}
    (Path(path) / TRAIN_STATE).write_text(json.dumps(bad))
    with pytest.raises(BadInput, match=r"train_state.json cannot be read \(its evaluator state: "
                                       r"'best_val_loss' is 'low'\)"):
        m.restore(acc, path, TrainState(), {"evaluator": EvalRecord()})
    (Path(path) / TRAIN_STATE).write_text(json.dumps({**st.to_dict(), "components": None}))
    rec = EvalRecord()
    m.restore(acc, path, TrainState(), {"evaluator": rec})
    assert rec.state_dict() == EvalRecord().state_dict()


def test_a_rollback_past_fp8_untils_hand_over_keeps_fp8_off_and_forgets_its_tokens():
    """fp8_until handed FP8 over after 1,000 tokens; a rollback to a checkpoint from before the
    hand-over keeps FP8 off (remedies only add up) but the report no longer claims those 1,000
    tokens in FP8 (the steps after the checkpoint are trained again, in the base precision). A
    checkpoint from after the hand-over brings its tokens back on resume."""
    import torch

    from fp8train.config.load import Config
    from fp8train.model import GPT, model_config_from
    from fp8train.precision import build_precision

    def native():
        prec = build_precision(Config(use_fp8=True, fp8_backend="native"), torch.device("cpu"),
                               warn=pytest.fail)
        prec.convert(GPT(model_config_from("tiny", 256, 64)))
        return prec
    prec = native()
    before = prec.state_dict()
    assert prec.hand_over(1000).startswith("FP8 handed over to fp32")
    after = prec.state_dict()
    assert after["handed_over_tokens"] == 1000 and prec.hand_over(2000) is None
    prec.load_state_dict(before)
    assert prec.status() == {"fp8_margin": 0, "fp8_on": 0}
    assert prec.state_dict()["handed_over_tokens"] is None
    resumed = native()
    resumed.load_state_dict(after)
    assert resumed.state_dict() == after
