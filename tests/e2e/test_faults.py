"""Fault injection on real training processes: kill -9 anywhere, corrupt checkpoints, NaN
losses, failing checkpoint writes, changed configs on resume. Faults are placed with the
FP8TRAIN_FAULTS hook (tests/support/faults.py, installed by tests/support/train_with_faults.py) or from outside
(SIGKILL, a file-size limit)."""


import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from safetensors.torch import load_file
from support.runs import DATA_DIR, ROOT, entry_script, rows, run_train, tiny_args

from fp8train.observe.metrics_file import read_rows

# FP8 (native, emulated on CPU) so that its scale state is part of what must survive; a fixed
# LR schedule so that a resumed run trains exactly like an uninterrupted one.
STEPS = 36


KILL_ARGS = dict(use_fp8="true", fp8_backend="native", max_steps=STEPS, lr_decay_steps=STEPS,
                 log_interval=1, eval_interval=1000, checkpoint_interval=3, keep_checkpoints=2,
                 eval_samples=0, resume="auto")


class Run:
    """train_fp8.py in a subprocess whose stdout is read line by line as it comes."""

    def __init__(self, args, faults="", preexec_fn=None, launcher=()):
        env = dict(os.environ, FP8TRAIN_DATA_DIR=DATA_DIR, PYTHONUNBUFFERED="1")
        env.pop("FP8TRAIN_FAULTS", None)
        if faults:
            env["FP8TRAIN_FAULTS"] = faults
        self.proc = subprocess.Popen([sys.executable, *launcher, entry_script(env),
                                      *map(str, args)],
                                     cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, preexec_fn=preexec_fn)
        self.lines, self.err_lines = [], []
        # Both pipes drained by threads (never by communicate(), which would race them).
        self.readers = [threading.Thread(target=lambda: self.lines.extend(self.proc.stdout),
                                         daemon=True),
                        threading.Thread(target=lambda: self.err_lines.extend(self.proc.stderr),
                                         daemon=True)]
        for t in self.readers:
            t.start()

    def wait_for_step(self, step, timeout=300):
        t0 = time.time()
        while time.time() - t0 < timeout:
            if any(line.startswith("step ") and int(line.split()[1].split("/")[0].replace(",", ""))
                   >= step for line in list(self.lines)):
                return True
            if self.proc.poll() is not None:
                return False
            time.sleep(0.01)
        raise TimeoutError(f"step {step} not reached")

    def finish(self, timeout=600):
        self.proc.wait(timeout=timeout)
        for t in self.readers:
            t.join()
        self.stdout, self.stderr = "".join(self.lines), "".join(self.err_lines)
        return self.proc.returncode


def final_state(out, step=STEPS):
    d = out / "checkpoints" / f"step_{step:07d}"
    return load_file(str(d / "model.safetensors")), torch.load(d / "optimizer.bin",
                                                               weights_only=False)


def losses(out):
    rows = read_rows(out, strict=True)
    return [(r["step"], r["train/loss"]) for r in rows if "train/loss" in r]


def assert_same_state(a, b):
    (pa, oa), (pb, ob) = a, b
    assert pa.keys() == pb.keys()
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k
    for k, sa in oa["state"].items():
        for name, t in sa.items():
            assert torch.equal(t, ob["state"][k][name]), (k, name)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run every interrupted one must equal."""
    out = tmp_path_factory.mktemp("reference") / "run"
    r = Run(tiny_args(out, **KILL_ARGS))
    assert r.finish() == 0, r.stderr[-3000:]
    return out


def kill_plan(seed=8):
    """Ten kills at increasing steps: four inside checkpoint writes (each phase), three inside
    a step (after backward, before the update), three from outside at whatever point the
    process happens to be in."""
    rng = random.Random(seed)
    kinds = ["step", "save:state", "outside", "save:manifest", "step", "save:pointer",
             "outside", "save:state", "outside", "step"]
    plan, cur = [], 1
    for kind in kinds:
        if kind.startswith("save"):
            step = (cur // 3 + 1) * 3 + 3 * rng.randint(0, 1)
        else:
            step = cur + rng.randint(1, 3)
        plan.append((kind, step))
        cur = step
    assert cur < STEPS
    return plan


def test_kill_9_ten_times_ends_bit_exact(tmp_path, reference):
    out = tmp_path / "run"
    args = tiny_args(out, **KILL_ARGS)
    plan = kill_plan()
    resumed_from = []
    for kind, step in plan:
        if kind == "outside":
            r = Run(args)
            if r.wait_for_step(step - 1):
                r.proc.send_signal(signal.SIGKILL)
        elif kind == "step":
            r = Run(args, faults=f"kill@step:{step}")
        else:
            r = Run(args, faults=f"kill@save:{step}:{kind.split(':')[1]}")
        code = r.finish()
        assert code == -signal.SIGKILL, (kind, step, code, r.stderr[-2000:])
        resumed_from += [line for line in r.lines if line.startswith("resumed from")]
        assert "unusable" not in r.stderr and "Traceback" not in r.stderr
    r = Run(args)
    assert r.finish() == 0, r.stderr[-3000:]
    # Every restart resumed from a checkpoint it had verified, none was ever found corrupt:
    # a kill at any point leaves the complete new checkpoint or none.
    verified = [line for line in r.lines if ": verified" in line]
    assert len(resumed_from) >= 7 and "unusable" not in r.stderr and len(verified) == 1
    assert not [n for n in os.listdir(out / "checkpoints") if n.startswith(".tmp-")]
    assert losses(out) == losses(reference)           # the same loss at every step
    assert_same_state(final_state(out), final_state(reference))


# Background checkpoint writes (checkpoint_async), with a window far above any save of this run.
ASYNC_ARGS = dict(KILL_ARGS, checkpoint_async="true", checkpoint_window_s=3600)


def sha256(path):
    import hashlib
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_async_save_killed_mid_write_keeps_the_previous_one_and_resumes_bit_exact(tmp_path,
                                                                                  reference):
    """checkpoint_async on the kill test's run. kill -9 lands in the background write of step
    6 (its model file written, the optimizer's not), once training has gone on to step 8: the
    previous checkpoint (step 3, itself written in the background) is intact and `latest`. The
    resume continues from it, saving in the background, and ends bit-identical to the
    uninterrupted synchronous run, every loss included; its background-written checkpoint of
    step 33 is that run's file for file. Every save logs its duration, the time training waited
    and its size on disk; none comes near the window, so nothing is warned about."""
    from fp8train.checkpoint.files import directory_bytes, read_manifest
    from fp8train.checkpoint.verify import verify
    out = tmp_path / "run"
    ckpts = out / "checkpoints"
    args = tiny_args(out, **ASYNC_ARGS)
    r = Run(args, faults="kill@asyncsave:6")
    assert r.finish() == -signal.SIGKILL, r.stderr[-3000:]
    assert sorted(os.listdir(ckpts)) == [".tmp-step_0000006", "latest", "step_0000003"]
    assert (ckpts / "latest").read_text().strip() == "step_0000003"
    assert verify(str(ckpts / "step_0000003"))[0] is None
    assert read_manifest(str(ckpts / "step_0000003"))["async"] is True
    assert max(step for step, _ in losses(out)) >= 7   # trained on while step 6 was written
    r = Run(args)
    assert r.finish() == 0, r.stderr[-3000:]
    assert f"resumed from {ckpts / 'step_0000003'} at step 3" in r.stdout
    assert "checkpoint step 33 saved in the background (" in r.stdout
    assert "stop signal leaves" not in r.stderr and "Traceback" not in r.stderr
    assert losses(out) == losses(reference)
    assert_same_state(final_state(out), final_state(reference))
    ours, theirs = ckpts / "step_0000033", reference / "checkpoints" / "step_0000033"
    assert read_manifest(str(ours))["async"] is True and "async" not in read_manifest(str(theirs))
    for name in ("model.safetensors", "optimizer.bin", "random_states_0.pkl"):
        assert sha256(ours / name) == sha256(theirs / name), name
    saves = {row["step"]: row for row in rows(out) if "checkpoint/save_s" in row}
    assert sorted(saves) == list(range(3, STEPS + 1, 3))
    for step in (33, 36):
        on_disk = directory_bytes(str(ckpts / f"step_{step:07d}"))
        assert saves[step]["checkpoint/size_gb"] == pytest.approx(on_disk / 1e9, rel=1e-9)
    assert all(x["checkpoint/save_s"] > 0 and x["checkpoint/blocked_s"] > 0
               for x in saves.values())


def test_a_corrupt_newest_checkpoint_is_reported_and_the_previous_one_used(tmp_path, reference):
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    newest = out / "checkpoints" / f"step_{STEPS:07d}"
    older = out / "checkpoints" / f"step_{STEPS - 3:07d}"
    model = newest / "model.safetensors"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0xFF                      # one flipped byte
    model.write_bytes(bytes(data))
    r = run_train(*tiny_args(out, **dict(KILL_ARGS, max_steps=STEPS + 3)))
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"checkpoint '{newest}' is unusable (file 'model.safetensors' does not match its " \
           "checksum)" in r.stderr
    assert f"resumed from {older} at step {STEPS - 3}" in r.stdout
    assert (out / "checkpoints" / f"step_{STEPS:07d}.corrupt").is_dir()

    # Named explicitly, a corrupt checkpoint is an error, not a silent substitute.
    bad = out / "checkpoints" / f"step_{STEPS + 3:07d}"
    (bad / "optimizer.bin").write_bytes(b"truncated")
    r = run_train(*tiny_args(tmp_path / "other", **dict(KILL_ARGS, resume=bad)))
    want = json.loads((bad / "manifest.json").read_text())["files"]["optimizer.bin"]["size"]
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"error: key 'resume': checkpoint '{bad}' is unusable: file 'optimizer.bin' has 9 bytes, "
        f"the manifest says {want:,} (--resume auto picks the newest good checkpoint of a run)"]


def test_no_usable_checkpoint_at_all_is_an_error(tmp_path, reference):
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    for d in (out / "checkpoints").glob("step_*"):
        (d / "manifest.json").write_text("{not json")
    r = run_train(*tiny_args(out, **KILL_ARGS))
    assert r.returncode == 2
    assert r.stderr.count("is unusable (unreadable manifest") == 2
    assert r.stderr.strip().splitlines()[-1].startswith(
        f"error: no usable checkpoint in '{out / 'checkpoints'}' (2 tried")
    assert len(list((out / "checkpoints").glob("step_*"))) == 2   # nothing moved: still there


NAN_ARGS = dict(use_fp8="true", fp8_backend="native", max_steps=24, lr_decay_steps=24,
                log_interval=2, eval_interval=1000, checkpoint_interval=6, eval_samples=0,
                max_bad_steps=3)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_nan_step_is_skipped_and_counted(tmp_path, optimizer):
    """Skipped on the device by either optimizer (Muon's part too: optimizer.py)."""
    out = tmp_path / "run"
    r = run_train(*tiny_args(out, **NAN_ARGS, optimizer=optimizer),
                  env={"FP8TRAIN_FAULTS": "nan@5"})
    assert r.returncode == 0, r.stderr[-3000:]
    skipped = {row["step"]: row["train/skipped_steps"] for row in rows(out)
               if "train/skipped_steps" in row}
    assert skipped[6] == 1 and sum(skipped.values()) == 1
    assert "step 6: 1 step(s) of the last 2 had non-finite gradients" in r.stdout
    assert "1 non-finite steps skipped" in r.stdout and "rollback" not in r.stdout.lower()
    # Parameters and the FP8 scale history are finite: the NaN step left no trace.
    assert all(torch.isfinite(t).all() for t in load_file(
        str(out / "checkpoints" / "step_0000024" / "model.safetensors")).values())


def test_repeated_nans_roll_back_raise_the_margin_and_finish(tmp_path):
    out = tmp_path / "run"
    r = run_train(*tiny_args(out, **NAN_ARGS), env={"FP8TRAIN_FAULTS": "nan@8-12"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert ("ROLLBACK: 3 or more consecutive steps with non-finite gradients (their updates "
            "were skipped), up to step") in r.stderr
    assert f"restored {out / 'checkpoints' / 'step_0000006'} (step 6); fp8_margin 0 -> 1; " \
           "skipping the" in r.stderr
    event = [row for row in rows(out) if "recovery/rollbacks" in row]
    assert len(event) == 1 and event[0]["step"] == 6 and event[0]["recovery/fp8_margin"] == 1
    assert "1 rollback(s)" in r.stdout
    steps = [row["step"] for row in rows(out) if "train/loss" in row]
    assert steps == sorted(set(steps)) and steps[-1] == 24   # no step logged twice
    # The remedy survives a resume: it is part of the checkpoint's training state.
    r = run_train(*tiny_args(out, **dict(NAN_ARGS, max_steps=30, resume="auto")))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "restored a checkpoint 1 time(s) after non-finite steps; precision now: FP8 native " \
           "(emulated on CPU: numerics only, no speed-up); delayed scaling, hybrid, margin 1" \
           in r.stdout


def test_bf16_recovery_switches_fp8_off(tmp_path):
    out = tmp_path / "run"
    r = run_train(*tiny_args(out, **NAN_ARGS, fp8_recovery="bf16"),
                  env={"FP8TRAIN_FAULTS": "nan@8-12"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "FP8 switched off: the converted layers compute in fp32 from here" in r.stderr
    assert [row["recovery/fp8_on"] for row in rows(out) if "recovery/fp8_on" in row] == [0]


@pytest.mark.parametrize("faults,expected", [
    ("nan!@8-24", "again after restoring a checkpoint at step"),     # the remedy does not help
    ("nan@2-6", "before the first checkpoint: nothing to restore"),
])
def test_divergence_that_cannot_be_recovered_stops_with_one_line(tmp_path, faults, expected):
    r = run_train(*tiny_args(tmp_path / "run", **NAN_ARGS), env={"FP8TRAIN_FAULTS": faults})
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: 3 or more consecutive steps") and expected in last
    assert "lower learning_rate" in last and "Traceback" not in r.stderr


WRITE_ARGS = dict(max_steps=12, lr_decay_steps=12, log_interval=3, eval_interval=1000,
                  checkpoint_interval=3, eval_samples=0, resume="auto")


def file_size_limit(limit):
    """A real write failure that root cannot bypass: files beyond `limit` bytes fail with
    EFBIG, the way a full disk fails with ENOSPC (SIGXFSZ ignored, as on a real full disk
    nothing is signalled)."""
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


@pytest.fixture(scope="module")
def six_steps(tmp_path_factory):
    out = tmp_path_factory.mktemp("write") / "run"
    r = Run(tiny_args(out, **dict(WRITE_ARGS, max_steps=6)))
    assert r.finish() == 0, r.stderr[-3000:]
    return out


def test_failed_checkpoint_writes_keep_the_previous_one_and_training_goes_on(tmp_path,
                                                                              six_steps):
    out = tmp_path / "run"
    shutil.copytree(six_steps, out)
    r = Run(tiny_args(out, **WRITE_ARGS), preexec_fn=file_size_limit(200_000))
    assert r.finish() == 1
    lines = r.stderr.strip().splitlines()
    warned = [line for line in lines if line.startswith("WARNING: checkpoint of step 9 could not")]
    assert len(warned) == 1 and "File too large" in warned[0] and \
        f"the previous checkpoint '{out / 'checkpoints' / 'step_0000006'}' is intact; training " \
        "goes on" in warned[0]
    assert lines[-1].startswith("error: checkpoint of step 12 could not be written") and \
        lines[-1].endswith("stopping because it was the run's last checkpoint: the steps after "
                           "the previous one are lost")
    assert sorted(os.listdir(out / "checkpoints")) == ["latest", "step_0000003", "step_0000006"]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_0000006"
    # ... and it loads: a run without the limit resumes from it.
    r = run_train(*tiny_args(out, **WRITE_ARGS))
    assert r.returncode == 0 and f"resumed from {out / 'checkpoints' / 'step_0000006'}" in r.stdout


def test_checkpoint_required_stops_at_the_first_failed_write(tmp_path, six_steps):
    out = tmp_path / "run"
    shutil.copytree(six_steps, out)
    r = Run(tiny_args(out, **WRITE_ARGS, checkpoint_required="true"),
            preexec_fn=file_size_limit(200_000))
    assert r.finish() == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: checkpoint of step 9 could not be written")
    assert last.endswith("stopping because checkpoint_required is true")


def test_a_write_failing_on_one_rank_is_agreed_by_both(tmp_path):
    """torchrun, 2 gloo processes: rank 1's write of step 3 fails (ENOSPC, injected), rank 0's
    succeeds; both drop the checkpoint, warn once, and carry on to the end."""
    out = tmp_path / "run"
    r = Run(tiny_args(out, **dict(WRITE_ARGS, max_steps=6, gradient_accumulation_steps=1)),
            faults="fail@save:3@rank1",
            launcher=("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"))
    assert r.finish() == 0, r.stderr[-3000:]
    assert r.stderr.count("WARNING: checkpoint of step 3 could not be written") == 1
    assert "rank 1: No space left on device" in r.stderr
    assert sorted(os.listdir(out / "checkpoints")) == ["latest", "step_0000006"]


def test_a_failed_background_write_is_reported_at_the_next_save_and_training_goes_on(tmp_path):
    """checkpoint_async: the write of step 3 fails in its thread (injected ENOSPC once its files
    are written); the next save, which waits for it first, warns once, naming the error and the
    intact state; no partial checkpoint is left, and the run's count of checkpoints is right."""
    out = tmp_path / "run"
    r = Run(tiny_args(out, **dict(WRITE_ARGS, max_steps=6, checkpoint_async="true")),
            faults="fail@save:3")
    assert r.finish() == 0, r.stderr[-3000:]
    warned = [line for line in r.stderr.splitlines() if line.startswith("WARNING: checkpoint")]
    assert len(warned) == 1 and warned[0].startswith(
        "WARNING: checkpoint of step 3 could not be written") and \
        "No space left on device" in warned[0] and "there is no earlier checkpoint; training " \
        "goes on" in warned[0], r.stderr
    assert sorted(os.listdir(out / "checkpoints")) == ["latest", "step_0000006"]
    assert json.loads((out / "summary.json").read_text())["checkpoints_written"] == 1


def test_resume_refuses_changes_that_change_training(tmp_path, six_steps):
    out = tmp_path / "run"
    shutil.copytree(six_steps, out)
    base = dict(WRITE_ARGS, max_steps=9)
    r = run_train(*tiny_args(out, **base, n_embd=64, learning_rate=1e-3))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"error: --n_embd=64, --learning_rate=0.001: resuming "
        f"'{out / 'checkpoints' / 'step_0000006'}' with "
        "settings that change training: n_embd None -> 64, learning_rate 0.003 -> 0.001; put "
        "them back, pass --allow_config_change to continue with the new values, or start a new "
        "run with another --output_dir"]
    # Harmless changes (how long, how often to log) need no permission.
    r = run_train(*tiny_args(out, **dict(base, log_interval=1, eval_interval=500)))
    assert r.returncode == 0 and "differ" not in r.stderr
    r = run_train(*tiny_args(out, **dict(base, max_steps=12, learning_rate=1e-3,
                                         allow_config_change="true")))
    assert r.returncode == 0
    assert "(--allow_config_change; training continues with the new values): learning_rate " \
           "0.003 -> 0.001" in r.stderr
