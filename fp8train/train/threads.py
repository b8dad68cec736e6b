"""How torch's CPU threads wait, chosen before torch is imported: a CPU run shared with another
busy process must slow down in proportion, not by ten times.

torch's CPU build runs its parallel regions (and MKL's GEMMs) on OpenMP threads (GNU libgomp
here: `torch.__config__.parallel_info()`), one per core. Between regions libgomp's threads
spin, by default for about 300,000 iterations before they sleep. On an idle machine that saves a
wake-up per region; on a machine where another process is busy, a spinning thread holds the core
that its straggling sibling, or the other process, needs, and every region waits for the thread
that was preempted: the README demo went from 82 s to 1,087 s on 2 cores shared with one busy
process. With `OMP_WAIT_POLICY=passive` a thread that is done sleeps at once, its core goes to
whoever is runnable (its sibling first, which the scheduler moves there), and a shared machine
costs its fair share of time instead (docs/records/benchmarks.md, "CPU: a busy machine").

libgomp reads the variable once, when torch loads it, so `apply()` sets it in the environment
of the process (and of the processes it starts) before torch is imported: train/cli.py calls it
first. A choice the user made is kept: OMP_WAIT_POLICY, GOMP_SPINCOUNT or KMP_BLOCKTIME (Intel's
OpenMP) already set. The thread count stays torch's (OMP_NUM_THREADS, else one per core).

Only CPU runs are changed: on a machine with an NVIDIA GPU visible (a /dev/nvidiaN device, and
CUDA_VISIBLE_DEVICES not empty or -1) the GPU does the training, the host threads feed it, and
whether sleeping threads would cost a GPU run its launch latency is not measured: libgomp's
default stays. Standard library only.
"""
from __future__ import annotations

import glob
import os
from typing import Mapping, MutableMapping, Optional

POLICY = ("OMP_WAIT_POLICY", "passive")
USER_CHOICES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def gpu_visible(environ: Mapping[str, str], dev: str = "/dev") -> bool:
    """Whether this process would see an NVIDIA GPU, told without importing torch or CUDA."""
    if environ.get("CUDA_VISIBLE_DEVICES", "x").strip() in ("", "-1"):
        return False
    return bool(glob.glob(os.path.join(dev, "nvidia[0-9]*")))


def apply(environ: Optional[MutableMapping[str, str]] = None, dev: str = "/dev") -> str:
    """Set OpenMP's wait policy in `environ` (os.environ) unless the user chose one or a GPU is
    visible (`gpu_visible`, devices under `dev`); returns what holds, in words, for the log
    ("OMP_WAIT_POLICY=passive", the user's setting, or "" when nothing was set)."""
    environ = os.environ if environ is None else environ
    chosen = [f"{k}={environ[k]}" for k in USER_CHOICES if environ.get(k, "").strip()]
    if chosen:
        return ", ".join(chosen) + " (yours)"
    if gpu_visible(environ, dev):
        return ""
    name, value = POLICY
    environ[name] = value
    return f"{name}={value}"


def device_text(device) -> str:
    """The device for the start line; on a CPU with its threads and how they wait: "cpu, 2
    threads, OMP_WAIT_POLICY=passive". Call after torch is imported."""
    from ..observe.metrics import device_name
    if device.type != "cpu":
        return device_name(device)
    import torch
    chosen = [f"{k}={os.environ[k]}" for k in USER_CHOICES if os.environ.get(k, "").strip()]
    return f"cpu, {torch.get_num_threads()} threads" + "".join(f", {c}" for c in chosen)
