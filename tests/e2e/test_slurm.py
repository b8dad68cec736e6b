"""submit_fp8.sh on a real SLURM cluster (Debian's slurmctld + slurmd + munge, started by
tests/support/slurm_cluster.py on this machine), and bash -n + shellcheck on every shell script.

The cluster has two nodes, both on this machine (two slurmd daemons, one CPU each), so that the
multi-node path (one accelerate launcher per node through srun, c10d rendezvous, the stop signal
reaching every node) runs for real. The jobs train on CPU with the production script as it is:
sbatch options (--gpus-per-node=0, --cpus-per-task=1, --time) and GPUS_PER_NODE=0 in the
environment override its 8-GPU defaults.

Skipped only where SLURM cannot be had: its binaries are missing and this is not root or there
is no apt-get. Where the packages are installed (CI installs them) the tests run, and a cluster
that does not come up is an error, not a skip.
"""
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.runs import DATA_DIR, ROOT
from support.slurm_cluster import SlurmCluster, SlurmUnavailable, missing_binaries

from fp8train.observe.metrics_file import read_rows

SCRIPT = "submit_fp8.sh"

# The jobs and reference runs use one thread per process (OMP_NUM_THREADS=1), so that two of
# them share the 2 cores and the numbers do not depend on the thread count.
# A tiny run, seconds long.
TINY = dict(use_fp8="false", n_layer=2, seq_len=64, max_steps=12, warmup_steps=3, log_interval=4,
            eval_interval=6, checkpoint_interval=6, eval_sequences=32, eval_samples=0)
# Long enough (a few seconds of steps) to be stopped in the middle.
STOPPABLE = dict(use_fp8="false", n_layer=2, seq_len=64, batch_size=8,
                 gradient_accumulation_steps=1, max_steps=150, warmup_steps=3, log_interval=10,
                 eval_interval=150, checkpoint_interval=50, eval_sequences=8, eval_samples=0)


def overrides(d: dict, output_dir) -> list[str]:
    return [f"--{k}={v}" for k, v in d.items()] + [f"--output_dir={output_dir}"]


# --- shell scripts --------------------------------------------------------------------------------

def shell_scripts() -> list[Path]:
    skip = {".git", "build", "runs", "data", "logs", "node_modules"}
    found = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in skip and not d.startswith(".")]
        found += [Path(dirpath) / f for f in filenames if f.endswith(".sh")]
    return sorted(found) + [ROOT / ".ci" / "run"]   # the CI script is bash too


def test_shell_scripts_parse_and_pass_shellcheck():
    scripts = shell_scripts()
    assert ROOT / SCRIPT in scripts and ROOT / "scripts" / "train_h100_fast.sh" in scripts
    for path in scripts:
        r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert r.returncode == 0, f"bash -n {path}:\n{r.stderr}"
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (CI installs it: apt-get install shellcheck)")
    r = subprocess.run(["shellcheck", "--shell=bash", *map(str, scripts)], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stdout + r.stderr


# --- the cluster ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster():
    if missing_binaries() and (os.geteuid() != 0 or shutil.which("apt-get") is None):
        pytest.skip(f"SLURM is not installed ({', '.join(missing_binaries())} missing) and "
                    "cannot be installed here (needs root and apt-get)")
    try:
        c = SlurmCluster.start(nodes=2)
    except SlurmUnavailable as e:
        pytest.skip(str(e))
    yield c
    c.stop()
    shutil.rmtree(c.root, ignore_errors=True)


def submit(cluster, workdir: Path, sbatch_opts: list, train_args: list, **env) -> str:
    """sbatch submit_fp8.sh from the repository root, the job running in `workdir` (so that the
    script's own logs/fp8_train_%j.{out,err} land there), on CPU."""
    (workdir / "logs").mkdir(parents=True, exist_ok=True)
    job_env = dict(FP8TRAIN_DATA_DIR=DATA_DIR, PYTHON=sys.executable, OMP_NUM_THREADS="1",
                   CONFIG="configs/test_fp8.yaml", GPUS_PER_NODE="0", WANDB_MODE="disabled")
    job_env.update(env)
    return cluster.sbatch(["--export=ALL", f"--chdir={workdir}", "--gpus-per-node=0",
                           "--cpus-per-task=1", "--time=15", *sbatch_opts, SCRIPT, *train_args],
                          cwd=ROOT, env=job_env)


def job_logs(workdir: Path, job_id: str) -> tuple[str, str]:
    out, err = (workdir / "logs" / f"fp8_train_{job_id}.{ext}" for ext in ("out", "err"))
    return (out.read_text(errors="replace") if out.exists() else "",
            err.read_text(errors="replace") if err.exists() else "")


def metrics(run_dir: Path) -> list[dict]:
    """The rows so far (a line being written is skipped)."""
    path = run_dir / "metrics.jsonl"
    return read_rows(path) if path.exists() else []


def final(rows: list[dict], key: str) -> tuple[int, float]:
    last = [r for r in rows if key in r][-1]
    return last["step"], last[key]


def explain(cluster, workdir, job_id) -> str:
    out, err = job_logs(workdir, job_id)
    return f"--- job stdout\n{out[-4000:]}\n--- job stderr\n{err[-4000:]}\n{cluster.logs(1500)}"


def wait_for_rows(cluster, job_id, workdir: Path, run_dir: Path, n: int, timeout=180):
    """Until the running job has logged `n` training rows."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if len([r for r in metrics(run_dir) if "train/loss" in r]) >= n:
            return
        info = cluster.job_info(job_id)
        assert info.get("JobState") in ("PENDING", "RUNNING", "CONFIGURING"), \
            f"{info}\n{explain(cluster, workdir, job_id)}"
        time.sleep(0.3)
    raise TimeoutError(f"no {n} metrics rows in {run_dir} after {timeout} s\n"
                       f"{explain(cluster, workdir, job_id)}")


# --- the tests ------------------------------------------------------------------------------------

@pytest.mark.slurm
def test_job_trains_to_the_end_and_writes_its_logs(cluster, tmp_path):
    work, run = tmp_path / "job", tmp_path / "run"
    t0 = time.time()
    job = submit(cluster, work, [], overrides(TINY, run))
    info = cluster.wait_job(job, timeout=240)
    why = explain(cluster, work, job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", why
    assert info["Restarts"] == "0", why
    out, err = job_logs(work, job)
    # the #SBATCH defaults of the script: logs/fp8_train_%j.{out,err} in the job's directory
    assert "done at step 12" in out, why
    assert f"job {job} restart 0 on 1 node(s)" in err and "training exited 0" in err, why
    assert "--resume=auto" in err, why   # a requeued job would continue
    rows = metrics(run)
    assert final(rows, "train/loss")[0] == 12 and final(rows, "val/loss")[0] == 12
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == \
        ["step_0000006", "step_0000012"]
    assert (run / "checkpoints" / "latest").read_text().strip().endswith("step_0000012")
    assert not (ROOT / "logs" / f"fp8_train_{job}.out").exists()   # nothing left in the repo
    # The stop window, found by the trainer in the job's own batch script (the script's
    # --signal=B:USR1@120), through scontrol: Slurm 22.05 reports it nowhere else.
    assert f"preemption window: 120 s (#SBATCH --signal=B:USR1@120 in the batch script of job " \
           f"{job})" in (run / "train.log").read_text(), why
    print(f"normal job: {time.time() - t0:.1f} s")


def reference_run(out_dir: Path, processes: int) -> subprocess.Popen:
    """The same training without SLURM and without a stop, started in the background."""
    env = dict(os.environ, FP8TRAIN_DATA_DIR=DATA_DIR, OMP_NUM_THREADS="1", WANDB_MODE="disabled",
               PYTHONUNBUFFERED="1")
    args = ["train_fp8.py", "--config", "configs/test_fp8.yaml", *overrides(STOPPABLE, out_dir)]
    if processes == 1:
        cmd = [sys.executable, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={processes}", *args]
    log = open(out_dir.parent / f"{out_dir.name}.log", "w")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def stop_requeue_resume(cluster, tmp_path, nodes: int):
    """Submit a run, let it log a few rows, send the batch script USR1 as SLURM does before the
    time limit; the job must stop after a checkpoint (exit 3), requeue itself, resume, finish,
    and end with exactly the numbers of an uninterrupted run."""
    work, run, ref = tmp_path / "job", tmp_path / "run", tmp_path / "reference"
    t0 = time.time()
    extra = [f"--nodes={nodes}"] if nodes > 1 else []
    env = dict(GPUS_PER_NODE="1", ACCEL_CONFIG="accelerate_configs/multinode_8xh100.yaml") \
        if nodes > 1 else {}
    job = submit(cluster, work, extra, overrides(STOPPABLE, run), **env)
    reference = reference_run(ref, processes=nodes)
    try:
        wait_for_rows(cluster, job, work, run, 3)
        cluster.run("scancel", "--signal=USR1", "--batch", job)
        t_signal = time.time() - t0
        info = cluster.wait_job(job, timeout=300)
        why = explain(cluster, work, job)
        assert reference.wait(timeout=300) == 0, (ref.parent / "reference.log").read_text()
    finally:
        if reference.poll() is None:
            reference.kill()
    out, err = job_logs(work, job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", why
    assert info["Restarts"] == "1", why
    # first run: the signal reached every node's trainer, which saved and exited 3 ...
    assert "USR1: asking training to save a checkpoint and stop" in err, why
    assert len(re.findall(r"sent SIGUSR1 to training process \d+", err)) == nodes, why
    assert "again" not in err, why   # exactly one signal per process
    stop = re.search(r"stopped early: SIGUSR1 received.*\(exit 3\) at step (\d+)", out)
    assert stop, why
    step = int(stop.group(1))
    assert 0 < step < STOPPABLE["max_steps"] - STOPPABLE["log_interval"], why
    assert f"stopped after a checkpoint (exit 3): requeueing job {job}" in err, why
    # ... the job ran again (SLURM_RESTART_COUNT=1), resumed from that checkpoint, finished
    assert f"job {job} restart 1 on {nodes} node(s)" in err, why
    assert re.search(rf"resumed from \S+step_{step:07d} at step {step}\b", out), why
    assert f"done at step {STOPPABLE['max_steps']}" in out and "training exited 0" in err, why
    # and it is the uninterrupted run, bit for bit (resume is exact on CPU)
    got, want = metrics(run), metrics(ref)
    for key in ("train/loss", "val/loss"):
        assert final(got, key) == final(want, key), (key, final(got, key), final(want, key))
    assert [r["step"] for r in got if "train/loss" in r] == \
        [r["step"] for r in want if "train/loss" in r]
    print(f"{nodes}-node stop/requeue/resume: USR1 at {t_signal:.1f} s, stopped at step {step}, "
          f"done at {time.time() - t0:.1f} s")


@pytest.mark.slurm
def test_usr1_stops_with_a_checkpoint_requeues_and_resumes_exactly(cluster, tmp_path):
    stop_requeue_resume(cluster, tmp_path, nodes=1)


@pytest.mark.slurm
def test_two_node_job_stops_on_every_node_requeues_and_resumes_exactly(cluster, tmp_path):
    stop_requeue_resume(cluster, tmp_path, nodes=2)


@pytest.mark.slurm
def test_stop_at_the_requeue_limit_is_not_requeued(cluster, tmp_path):
    """MAX_REQUEUES bounds the requeues: at the limit a stopped job ends with exit 3 (its
    checkpoint kept for a resubmission) instead of requeueing itself again."""
    work, run = tmp_path / "job", tmp_path / "run"
    job = submit(cluster, work, [], overrides(STOPPABLE, run), MAX_REQUEUES="0")
    wait_for_rows(cluster, job, work, run, 2)
    cluster.run("scancel", "--signal=USR1", "--batch", job)
    info = cluster.wait_job(job, timeout=240)
    why = explain(cluster, work, job)
    out, err = job_logs(work, job)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "3:0", why
    assert info["Restarts"] == "0", why
    assert "NOT requeued: 0 requeues done (MAX_REQUEUES=0)" in err, why
    step = int(re.search(r"\(exit 3\) at step (\d+)", out).group(1))
    assert (run / "checkpoints" / "latest").read_text().strip().endswith(f"step_{step:07d}")
