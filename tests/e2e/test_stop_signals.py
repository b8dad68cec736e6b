"""SIGUSR1 / SIGTERM / SIGINT on real training processes: acknowledged at once, finish the step
(abandon an evaluation), checkpoint, exit 3; the resumed run logs exactly the rows an
uninterrupted one does. A second signal exits at once; one during start-up stops it at once.
Signals at exact points (a step, an evaluation, a checkpoint write) are real SIGUSR1s the
process sends itself there (tests/support/faults.py)."""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from support.runs import DATA_DIR, ROOT, entry_script, rows, run_train, tiny_args, untimed

# Long enough to be signalled mid-run; lr_decay_steps fixes the schedule so that a stopped and
# resumed run trains exactly like an uninterrupted one.
ARGS = dict(max_steps=40, lr_decay_steps=40, log_interval=2, eval_interval=20,
            checkpoint_interval=20, eval_samples=0, data_prefetch=0)


def start(args, launcher=(), env=None):
    env = dict(os.environ, FP8TRAIN_DATA_DIR=DATA_DIR, PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.Popen([sys.executable, *launcher, entry_script(env), *map(str, args)],
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
                 launcher=("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"))
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


# Rows every 4 steps, an evaluation every 6: a stop in step 7 falls between two log steps.
ROWS = dict(max_steps=12, lr_decay_steps=12, log_interval=4, eval_interval=6,
            checkpoint_interval=100, eval_samples=0, data_prefetch=0)
ACK = "SIGUSR1 received: stopping after this step; a checkpoint follows"


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted run the stopped ones must log exactly."""
    out = tmp_path_factory.mktemp("straight") / "run"
    r = run_train(*tiny_args(out, **ROWS))
    assert r.returncode == 0, r.stderr[-3000:]
    return out, r.stdout


def logged(out, key):
    """The rows with `key`, timings left out (they differ from run to run)."""
    return [untimed(x) for x in rows(out) if key in x]


def faulty(out, faults, **overrides):
    return run_train(*tiny_args(out, **dict(ROWS, **overrides)), env={"FP8TRAIN_FAULTS": faults})


def test_a_stop_between_log_steps_loses_no_logged_loss(tmp_path, straight):
    """SIGUSR1 in step 7 (rows at 4, 8, 12): acknowledged at once, on the console and in
    train.log; the checkpoint carries the interval's loss sums, so the resumed run's row at step
    8 averages steps 5-8, as the uninterrupted run's does, and every row is the same."""
    out = tmp_path / "run"
    r = faulty(out, "usr1@step:7")
    assert r.returncode == 3, r.stderr[-3000:]
    assert latest(out) == "step_0000007"
    assert ACK in r.stdout and r.stdout.index(ACK) < r.stdout.index("stopped early: SIGUSR1")
    assert ACK in (out / "train.log").read_text()
    r = run_train(*tiny_args(out, **ROWS), "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert logged(out, "train/loss") == logged(straight[0], "train/loss")
    assert [x["step"] for x in logged(out, "train/loss")] == [4, 8, 12]
    assert logged(out, "val/loss") == logged(straight[0], "val/loss")


def test_the_first_progress_line_comes_after_the_first_step(straight):
    """Not a terminal (a pipe here, a file under SLURM): a line after step 1, long before the
    first log step, then the rows."""
    stdout = straight[1]
    assert "step 1/12 | first step" in stdout
    assert stdout.index("step 1/12 | first step") < stdout.index("step 4/12 | loss")


def test_a_signal_abandons_the_evaluation_and_the_resume_runs_it(tmp_path, straight):
    """SIGUSR1 as the evaluation of step 6 starts: it is left at its first batch, no val row,
    the checkpoint follows at once (exit 3); the resumed run evaluates step 6 first, and logs
    what the uninterrupted run logged."""
    out = tmp_path / "run"
    r = faulty(out, "usr1@eval:6")
    assert r.returncode == 3, r.stderr[-3000:]
    assert "evaluation at step 6 abandoned: SIGUSR1 received" in r.stdout
    assert latest(out) == "step_0000006" and not logged(out, "val/loss")
    r = run_train(*tiny_args(out, **ROWS), "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "the evaluation of step 6 was abandoned at a stop: it runs first" in r.stdout
    assert logged(out, "val/loss") == logged(straight[0], "val/loss")
    assert logged(out, "train/loss") == logged(straight[0], "train/loss")


def test_a_signal_during_the_final_evaluation_is_finished_by_the_resume(tmp_path, straight):
    """The last step's evaluation abandoned: the run's end is checkpointed (exit 3), and the
    resume, with no step left, still owes and runs that evaluation instead of 'nothing to do'."""
    out = tmp_path / "run"
    assert faulty(out, "usr1@eval:12").returncode == 3
    assert latest(out) == "step_0000012"
    r = run_train(*tiny_args(out, **ROWS), "--resume")
    assert r.returncode == 0 and "nothing to do" not in r.stdout, r.stderr[-3000:]
    assert logged(out, "val/loss") == logged(straight[0], "val/loss")
    assert json.loads((out / "summary.json").read_text())["status"] == "completed"


def test_a_signal_during_a_checkpoint_write_stops_right_after_it(tmp_path):
    """The periodic checkpoint of step 5 is being written when SIGUSR1 comes: that checkpoint
    is the stop's; no further step is trained and none saved."""
    out = tmp_path / "run"
    r = faulty(out, "usr1@save:5", checkpoint_interval=5)
    assert r.returncode == 3, r.stderr[-3000:]
    assert "stopped early: SIGUSR1 received; resume with --resume (exit 3) at step 5" in r.stdout
    assert latest(out) == "step_0000005"
    assert not (out / "checkpoints" / "step_0000006").exists()


def test_a_stop_during_a_background_write_waits_for_it_then_saves_the_stop(tmp_path,
                                                                           straight):
    """checkpoint_async: SIGUSR1 comes while the checkpoint of step 5 is written in the
    background (sent by its writer, which then takes 3 s more). The run finishes its step, waits
    for that write (it ends complete and valid), saves the stop's step synchronously after it
    and exits 3; the resumed run logs exactly what the uninterrupted one logs. A window of 1 ms
    makes every save too long for it: said once by each process, the first time at start-up
    for the checkpoint it resumed."""
    from fp8train.checkpoint.files import read_manifest
    from fp8train.checkpoint.verify import verify
    out = tmp_path / "run"
    keys = dict(checkpoint_interval=5, checkpoint_async="true", checkpoint_window_s=0.001)
    r = faulty(out, "usr1@asyncsave:5", **keys)
    assert r.returncode == 3, r.stderr[-3000:]
    step = int(latest(out).split("_")[1])
    assert 5 < step < 12
    waited = "waiting for the checkpoint of step 5, which is being written in the background"
    assert r.stdout.index(waited) < r.stdout.index("checkpoint step 5 saved in the background") \
        < r.stdout.index(f"checkpoint step {step} saved (")
    assert f"stopped early: SIGUSR1 received; resume with --resume (exit 3) at step {step}" \
        in r.stdout
    for s, background in ((5, True), (step, False)):
        path = str(out / "checkpoints" / f"step_{s:07d}")
        assert verify(path)[0] is None and read_manifest(path).get("async", False) is background
    warned = [line for line in r.stderr.splitlines() if "a stop signal leaves" in line]
    assert len(warned) == 1 and "checkpoint step 5 took" in warned[0], r.stderr
    assert "checkpoint_window_s" in warned[0]
    r = run_train(*tiny_args(out, **dict(ROWS, **keys)), "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    warned = [line for line in r.stderr.splitlines() if "a stop signal leaves" in line]
    assert len(warned) == 1 and "the checkpoint this run resumed from" in warned[0], r.stderr
    assert logged(out, "train/loss") == logged(straight[0], "train/loss")
    assert logged(out, "val/loss") == logged(straight[0], "val/loss")


class _SilentProxy:
    """An HTTP proxy that accepts connections and never answers: a download hangs in start-up
    for as long as the test wants."""

    def __init__(self):
        self.server = socket.create_server(("127.0.0.1", 0))
        self.held = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                self.held.append(self.server.accept())
            except OSError:
                return

    @property
    def env(self):
        url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        return {"https_proxy": url, "HTTPS_PROXY": url, "http_proxy": url, "HTTP_PROXY": url,
                "no_proxy": "", "NO_PROXY": ""}


def test_a_signal_during_start_up_stops_at_once_without_a_traceback(tmp_path):
    """SIGTERM while the run is still starting (here: downloading its corpus): nothing to save,
    so it ends at once with one line, also in train.log, and exit 3 (a scheduler's requeue
    starts it again); not the 30 s the download would wait, not a traceback."""
    proxy = _SilentProxy()
    out = tmp_path / "run"
    proc = start(tiny_args(out, **ARGS, data_dir=tmp_path / "data"), env=proxy.env)
    for line in proc.stdout:
        if line.startswith("downloading tinyshakespeare"):
            break
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 3, stderr[-3000:]
    assert time.time() - t0 < 20
    said = "stopped: SIGTERM received before the first training step"
    assert said in stdout and said in (out / "train.log").read_text()
    assert "Traceback" not in stderr
    assert not (tmp_path / "data" / "tinyshakespeare.txt").exists()
    proxy.server.close()


def test_two_ranks_leave_an_evaluation_together_when_one_is_signalled(tmp_path):
    """torchrun, 2 CPU processes over gloo: rank 1 alone gets SIGUSR1 as the evaluation of step
    4 starts (25 batches per rank). The ranks agree to abandon it at the same batch (no rank
    left in a collective), save step 4 together and exit 3."""
    pytest.importorskip("psutil")
    out = tmp_path / "run"
    proc = start(tiny_args(out, max_steps=6, lr_decay_steps=6, log_interval=2, eval_interval=4,
                           checkpoint_interval=100, eval_samples=0, data_prefetch=0,
                           batch_size=4, gradient_accumulation_steps=1, eval_sequences=200),
                 launcher=("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"),
                 env={"FP8TRAIN_FAULTS": "usr1@eval:4@rank1"})
    stdout, stderr = proc.communicate(timeout=600)
    assert "exitcode  : 3" in stderr, stderr[-3000:]
    assert "evaluation at step 4 abandoned: SIGUSR1 received by another rank" in stdout
    assert latest(out) == "step_0000004" and not any("val/loss" in x for x in rows(out))
    for rank in (0, 1):
        assert (out / "checkpoints" / "step_0000004" / f"random_states_{rank}.pkl").is_file()
