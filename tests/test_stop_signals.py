"""SIGUSR1 / SIGTERM / SIGINT on real training processes: finish the step, checkpoint, exit 3;
the resumed run ends exactly where an uninterrupted one does. A second signal exits at once."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import DATA_DIR, ROOT, run_train, tiny_args

# Long enough to be signalled mid-run; lr_decay_steps fixes the schedule so that a stopped and
# resumed run trains exactly like an uninterrupted one.
ARGS = dict(max_steps=40, lr_decay_steps=40, log_interval=2, eval_interval=20,
            checkpoint_interval=20, eval_samples=0, data_prefetch=0)


def start(args, launcher=()):
    env = dict(os.environ, FP8TRAIN_DATA_DIR=DATA_DIR, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, *launcher, "train_fp8.py", *map(str, args)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def wait_for_rows(out, n, proc, timeout=300):
    """Until metrics.jsonl has n training rows: the loop is running."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        path = out / "metrics.jsonl"
        if path.is_file() and sum('"train/loss"' in line for line in open(path)) >= n:
            return
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    raise TimeoutError("training did not start")


def rows(out):
    return [json.loads(line) for line in open(out / "metrics.jsonl")]


def latest(out):
    return (out / "checkpoints" / "latest").read_text().strip()


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM, signal.SIGINT])
def test_signal_checkpoints_and_exits_3(tmp_path, sig):
    out = tmp_path / "run"
    proc = start(tiny_args(out, **ARGS))
    wait_for_rows(out, 1, proc)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 3, stderr[-3000:]
    assert f"stopped early: {sig.name} received" in stdout and "(exit 3)" in stdout
    step = int(latest(out).split("_")[1])
    assert 2 <= step < 40 and rows(out)[-1]["step"] <= step
    assert "Traceback" not in stderr


def test_stopped_and_resumed_run_ends_like_an_uninterrupted_one(tmp_path):
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    assert run_train(*tiny_args(straight, **ARGS)).returncode == 0
    proc = start(tiny_args(stopped, **ARGS))
    wait_for_rows(stopped, 3, proc)
    proc.send_signal(signal.SIGUSR1)
    proc.communicate(timeout=300)
    assert proc.returncode == 3
    r = run_train(*tiny_args(stopped, **ARGS), "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout
    final = lambda out, key: [x[key] for x in rows(out) if key in x][-1]
    assert final(stopped, "val/loss") == final(straight, "val/loss")  # bit-exact on CPU
    assert final(stopped, "train/loss") == final(straight, "train/loss")


def test_a_second_signal_exits_at_once(tmp_path):
    out = tmp_path / "run"
    proc = start(tiny_args(out, **dict(ARGS, checkpoint_interval=1000)))
    wait_for_rows(out, 1, proc)
    proc.send_signal(signal.SIGUSR1)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "SIGTERM again: exiting now, without a checkpoint" in stderr


def test_two_ranks_stop_together_when_one_is_signalled(tmp_path):
    """torchrun, 2 CPU processes over gloo: only rank 1 gets SIGUSR1; the request is agreed
    across ranks, both save the same step and exit 3, nobody hangs in a collective."""
    psutil = pytest.importorskip("psutil")
    out = tmp_path / "run"
    proc = start(tiny_args(out, **ARGS, batch_size=4, gradient_accumulation_steps=1),
                 launcher=("-m", "torch.distributed.run", "--nproc_per_node", "2"))
    wait_for_rows(out, 1, proc)
    workers = [p for p in psutil.Process(proc.pid).children()
               if "train_fp8.py" in " ".join(p.cmdline())]
    rank1 = [p for p in workers if p.environ().get("RANK") == "1"]
    assert len(workers) == 2 and len(rank1) == 1
    rank1[0].send_signal(signal.SIGUSR1)
    stdout, stderr = proc.communicate(timeout=300)
    # torchrun reports any non-zero worker exit as its own failure (exit 1), naming the code.
    assert proc.returncode != 0 and "exitcode  : 3" in stderr, stderr[-3000:]
    assert "stopped early: SIGUSR1 received by another rank" in stdout  # rank 0 prints
    step = latest(out)
    assert os.path.isfile(out / "checkpoints" / step / "random_states_0.pkl")
    assert os.path.isfile(out / "checkpoints" / step / "random_states_1.pkl")
