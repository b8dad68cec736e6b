"""The preemption window: how many seconds a stop signal leaves the run before it is killed, so
that a checkpoint save that would not fit in it is said before it costs a requeue hours of work.

It is `checkpoint_window_s` when that is set. Otherwise, in a SLURM job (SLURM_JOB_ID set), it
is the warning time of the job's `--signal=[{R|B}:]SIG[@TIME]` (TIME seconds; sbatch's default
is 60 when only the signal is given). Slurm keeps the signal in the job but reports it nowhere
(checked on Slurm 22.05 and in Slurm's sources: the job info that `scontrol show job` and
`squeue` print has no field for it), so it is read from where sbatch took it, in sbatch's own
order of precedence:

  1. the sbatch command line: `SubmitLine=` in `scontrol show job JOB` (Slurm 25.11 and later);
  2. the SBATCH_SIGNAL environment variable, which the job inherits from its submission;
  3. the `#SBATCH --signal` lines of the batch script (`scontrol write batch_script JOB -`).

On a Slurm before 25.11 a `--signal` given on the sbatch command line is not seen, and the
script's is used: set checkpoint_window_s when you override it there. When nothing is found,
or scontrol fails in any way, there is no window and no warning (a train.log line says why):
none of this may stop training.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
from typing import Callable, Optional, Tuple

DEFAULT_SIG_TIME = 60   # sbatch: a signal without @TIME is sent 60 s before the end
SCONTROL_TIMEOUT_S = 5

# [{R|B}:]<sig_num>[@sig_time]: the signal by name (USR1, SIGUSR1) or number
_SPEC = re.compile(r"^(?:[RB]{1,2}:)?(?:SIG)?[A-Z0-9]+(?:@(\d+))?$", re.IGNORECASE)

Runner = Callable[[list], str]


def parse_signal(spec: str) -> Optional[int]:
    """The seconds before the end at which `--signal=spec` signals the job; None when `spec`
    is not a signal spec."""
    m = _SPEC.match(spec.strip())
    if not m:
        return None
    return int(m.group(1)) if m.group(1) is not None else DEFAULT_SIG_TIME


def signal_in_args(words: list) -> Optional[str]:
    """The value of the last `--signal` among sbatch command-line words (the last one wins).
    The batch script's own arguments are scanned too: train_fp8.py has no --signal option."""
    found = None
    for i, w in enumerate(words):
        if w.startswith("--signal="):
            found = w.split("=", 1)[1]
        elif w == "--signal" and i + 1 < len(words):
            found = words[i + 1]
    return found


def signal_in_submit_line(show_job: str) -> Optional[str]:
    """`--signal` of the sbatch command line in `scontrol show job` output (its SubmitLine=
    field, Slurm 25.11 and later; it runs to the end of its line)."""
    m = re.search(r"^\s*SubmitLine=(.*)$", show_job, re.MULTILINE)
    if not m:
        return None
    try:
        words = shlex.split(m.group(1))
    except ValueError:
        words = m.group(1).split()
    return signal_in_args(words)


def signal_in_script(script: str) -> Optional[str]:
    """`--signal` of a batch script's `#SBATCH` lines: sbatch reads them up to the first line
    that is neither blank nor a comment, and the last one given wins."""
    found = None
    for line in script.splitlines()[1:] if script.startswith("#!") else script.splitlines():
        s = line.strip()
        if s and not s.startswith("#"):
            break
        if not s.startswith("#SBATCH"):
            continue
        try:
            words = shlex.split(s[len("#SBATCH"):], comments=True)
        except ValueError:
            continue
        value = signal_in_args(words)
        if value is not None:
            found = value
    return found


def _scontrol(args: list) -> str:
    out = subprocess.run(["scontrol", *args], capture_output=True, text=True, encoding="utf-8",
                         errors="replace", timeout=SCONTROL_TIMEOUT_S)
    if out.returncode != 0:
        raise OSError(f"scontrol {' '.join(args)} exited {out.returncode}: "
                      f"{(out.stderr or out.stdout).strip()[:200]}")
    return out.stdout


def slurm_window(job_id: str, env=None, run: Runner = _scontrol) -> Tuple[Optional[int], str]:
    """(seconds, where they come from) for SLURM job `job_id`; (None, why) when the job's
    signal cannot be found. `run(args)`: scontrol's stdout (tests pass recorded output)."""
    env = os.environ if env is None else env
    problems = []
    try:
        spec = signal_in_submit_line(run(["show", "job", str(job_id)]))
        if spec is not None:
            return _answer(spec, f"--signal={spec} on the sbatch command line of job {job_id}")
    except (OSError, subprocess.SubprocessError) as e:
        problems.append(str(e) or type(e).__name__)
    spec = env.get("SBATCH_SIGNAL")
    if spec:
        return _answer(spec, f"SBATCH_SIGNAL={spec} in the environment of job {job_id}")
    try:
        spec = signal_in_script(run(["write", "batch_script", str(job_id), "-"]))
        if spec is not None:
            return _answer(spec, f"#SBATCH --signal={spec} in the batch script of job {job_id}")
        problems.append("its batch script has no #SBATCH --signal line")
    except (OSError, subprocess.SubprocessError) as e:
        problems.append(str(e) or type(e).__name__)
    return None, f"job {job_id}: no --signal found ({'; '.join(problems)})"


def _answer(spec: str, where: str) -> Tuple[Optional[int], str]:
    seconds = parse_signal(spec)
    if seconds is None:
        return None, f"{where}: not a signal spec"
    return seconds, where


def find_window(configured: Optional[float], env=None,
                run: Runner = _scontrol) -> Tuple[Optional[float], str]:
    """(seconds a stop signal leaves before the kill, where that comes from), or (None, why
    none is known). Never raises: a failing scontrol only means no window."""
    if configured is not None:
        return float(configured), "checkpoint_window_s"
    env = os.environ if env is None else env
    job = env.get("SLURM_JOB_ID")
    if not job:
        return None, "not a SLURM job and checkpoint_window_s is not set"
    try:
        seconds, where = slurm_window(job, env, run)
    except Exception as e:   # whatever happens here, training goes on without a window
        return None, f"job {job}: {type(e).__name__}: {e}"
    return (float(seconds) if seconds is not None else None), where
