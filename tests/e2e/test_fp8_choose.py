"""fp8_backend: auto and fp8_recipe: auto through train_fp8.py on a CPU: nothing is timed (FP8
is emulated), the default is taken and said, recorded in config.yaml and summary.json, and a
resumed run keeps its checkpoint's choice; auto with a recipe it cannot honour exits 2 in one
line. The choosing itself (injected timings): tests/unit/test_fp8_choose.py."""
import json

import yaml
from support.runs import TORCHRUN, run_train, tiny_args


def test_auto_on_a_cpu_takes_the_default_says_why_and_the_resume_keeps_it(tmp_path):
    out = tmp_path / "run"
    r = run_train(*tiny_args(out, use_fp8="true", fp8_backend="auto", max_steps=6))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "fp8 auto: nothing timed on cpu (FP8 is emulated there, slower whatever the " \
        "recipe): native delayed, the default" in r.stdout
    saved = yaml.safe_load(open(out / "config.yaml"))
    assert (saved["fp8_backend"], saved["fp8_recipe"]) == ("auto", "auto")
    derived = saved["derived"]
    assert (derived["fp8_backend"], derived["fp8_recipe"]) == ("native", "delayed")
    assert derived["fp8_choice"]["chosen"] == "native delayed"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["fp8_choice"]["chosen"] == "native delayed"
    assert "summary: FP8 recipe native delayed (fp8 auto: nothing timed on cpu" in r.stdout
    r = run_train(*tiny_args(out, use_fp8="true", fp8_backend="auto"), "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "fp8 auto: native delayed, as the resumed checkpoint's run chose" in r.stdout


def test_fp8_backend_auto_with_a_named_recipe_exits_2_in_one_line(tmp_path):
    r = run_train(*tiny_args(tmp_path / "run", use_fp8="true", fp8_backend="auto",
                             fp8_recipe="current"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert "key 'fp8_recipe' ('current') applies only with a named fp8_backend (auto chooses " \
        "the recipe too), but fp8_backend is 'auto'" in line


def test_evaluate_py_evaluates_in_fp8_with_the_recipe_auto_chose(tmp_path):
    """fp8_eval with fp8_backend auto: scripts/evaluate.py evaluates the checkpoint in FP8 and
    reproduces the logged val/loss, without the warning that FP8 cannot run. (On a CPU the
    choice is the default; that the derived choice replaces auto is tested in
    tests/unit/test_fp8_choose.py.)"""
    import subprocess
    import sys

    from support.runs import ROOT
    out = tmp_path / "run"
    r = run_train(*tiny_args(out, use_fp8="true", fp8_backend="auto", fp8_eval="true",
                             max_steps=6))
    assert r.returncode == 0, r.stderr[-3000:]
    logged = [json.loads(x) for x in open(out / "metrics.jsonl") if "val/loss" in x][-1]
    e = subprocess.run([sys.executable, "scripts/evaluate.py", str(out), "--json"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert e.returncode == 0, e.stderr[-2000:]
    assert "cannot run here" not in e.stderr
    got = json.loads(e.stdout)
    assert got["val/loss"] == logged["val/loss"] and got["step"] == 6, (got, logged)


def _two_ranks(out, env, choice_s: str, **extra):
    """torchrun, 2 CPU processes over gloo, fp8_recipe auto timed (slowly, as
    support/train_with_slow_choice.py makes it) on a CPU."""
    import os
    import subprocess

    from support.runs import DATA_DIR, ROOT
    full = dict(os.environ, FP8TRAIN_DATA_DIR=DATA_DIR, PYTHONUNBUFFERED="1",
                FP8TRAIN_CHOICE_SECONDS=choice_s, **env)
    args = tiny_args(out, use_fp8="true", fp8_backend="native", fp8_recipe="auto",
                     batch_size=4, gradient_accumulation_steps=1, max_steps=2, warmup_steps=1,
                     log_interval=1,
                     eval_interval=2, checkpoint_interval=2, eval_samples=0, **extra)
    return subprocess.Popen([*TORCHRUN, "--nproc_per_node",
                             "2", "tests/support/train_with_slow_choice.py", *args], cwd=ROOT,
                            env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_ranks_share_the_candidates_and_outlast_a_short_collective_timeout(tmp_path):
    """Rank 0 times native delayed for 4 x 3 s = 12 s, rank 1 current at once; the default
    process group's timeout is 5 s. Rank 1 waits for rank 0 on the choice's own CPU group,
    polling within the choice's bound, not in a default-group collective (which would fail after
    5 s, as it did while rank 0 timed every candidate alone): the run trains, with the faster
    recipe that rank 1 timed, and the table names both."""
    out = tmp_path / "run"
    proc = _two_ranks(out, {"FP8TRAIN_PG_TIMEOUT_S": "5"}, "3,0")
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    assert "fp8 auto: native current chosen" in stdout
    assert "fp8 auto: 2 candidates (2 measured) in " in stdout and " over 2 ranks" in stdout
    derived = yaml.safe_load(open(out / "config.yaml"))["derived"]
    assert derived["fp8_recipe"] == "current"
    table = derived["fp8_choice"]["table"]
    assert [(row["recipe"], row["rank"]) for row in table] == [("delayed", 0), ("current", 1)]


def test_a_sigterm_during_the_choice_ends_every_rank_at_once(tmp_path):
    """Rank 0 would time for minutes; SIGTERM to both ranks (as SLURM sends it) while rank 0
    times and rank 1 waits: both stop within seconds, exit 3 (nothing was trained or saved),
    with the one-line start-up stop and no traceback; nobody is left in a collective."""
    import signal
    import time

    psutil = __import__("pytest").importorskip("psutil")
    out = tmp_path / "run"
    marker = tmp_path / "started"
    proc = _two_ranks(out, {"FP8TRAIN_CHOICE_STARTED": str(marker)}, "300,0")
    t0 = time.time()
    while not ((tmp_path / "started.0").exists() and (tmp_path / "started.1").exists()):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() - t0 < 300, "the choice did not start on both ranks"
        time.sleep(0.1)
    time.sleep(2.0)    # rank 1 is past its own share (no wait in it), waiting for rank 0
    workers = [p for p in psutil.Process(proc.pid).children()
               if "train_with_slow_choice.py" in " ".join(p.cmdline())]
    assert len(workers) == 2
    t1 = time.time()
    for w in workers:
        w.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert time.time() - t1 < 30
    # Each rank left through its own stop (exit 3: rank 1 out of its wait too, not killed by the
    # launcher after rank 0 ended); torchrun reports the non-zero exits as its own failure,
    # with the one traceback of its own. On a loaded machine the rank that stops second may
    # still be on its way out (its handler already given back) when torchrun, seeing the first
    # exit, sends its own SIGTERM: that rank then ends by the signal (-15), as promptly.
    import re
    codes = sorted(int(c) for c in re.findall(r"exitcode  : (-?\d+)", stderr))
    assert codes in ([3, 3], [-15, 3]), stderr[-3000:]
    if codes == [3, 3]:
        assert "stopped: SIGTERM received before the first training step" in stdout
    assert stderr.count("Traceback") == 1 and "ChildFailedError" in stderr, stderr[-5000:]
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())
