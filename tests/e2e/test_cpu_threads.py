"""A CPU shared with another busy process: train_fp8.py's OpenMP threads sleep when they wait
(fp8train/train/threads.py), measured here against libgomp's default spinning, with a busy
process on every core. The policy itself, in process: tests/unit/test_cpu_threads.py."""
import json
import os
import subprocess
import sys
from contextlib import contextmanager

from support.runs import ROOT, run_train, tiny_args


@contextmanager
def busy_cores():
    """One busy Python loop per CPU, at this process's own niceness, for the block's length."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
             for _ in range(os.cpu_count() or 1)]
    try:
        yield
    finally:
        for p in loops:
            p.kill()
            p.wait()


def demo_step(policy: str) -> dict:
    """The demo's training step timed in a process of its own (support/cpu_threads_workload.py)."""
    r = subprocess.run([sys.executable, "tests/support/cpu_threads_workload.py", "--policy",
                        policy, "--seconds", "1", "--min_steps", "2", "--warmup", "1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def test_beside_a_busy_process_the_trainers_policy_is_much_faster_than_spinning():
    """With every core busy, libgomp's default (threads spin before they sleep) lets a
    preempted thread hold up every parallel region while its sibling burns the core it needs:
    the README demo ran 13 times slower. The trainer's policy must take well under that."""
    with busy_cores():
        spinning = demo_step("default")
        passive = demo_step("trainer")
    assert (spinning["wait_policy"], passive["wait_policy"]) == (None, "passive")
    assert spinning["threads"] == passive["threads"] == os.cpu_count()
    print(f"s/step beside a busy process: default {spinning['s_per_step']:.3f}, the trainer's "
          f"{passive['s_per_step']:.3f}")
    assert passive["s_per_step"] < 0.6 * spinning["s_per_step"], (passive, spinning)


def test_train_fp8_sets_the_policy_before_torch_and_keeps_the_users_own(tmp_path):
    r = run_train(*tiny_args(tmp_path / "a"), "--plan_only")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"(1 process, cpu, {os.cpu_count()} threads, OMP_WAIT_POLICY=passive, " in r.stdout
    r = run_train(*tiny_args(tmp_path / "b"), "--plan_only", env={"OMP_WAIT_POLICY": "active"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "threads, OMP_WAIT_POLICY=active, " in r.stdout
