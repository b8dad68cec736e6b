"""What the tests share to run fp8train: the repository root, the corpus folder (the real
tinyshakespeare: taken from FP8TRAIN_DATA_DIR, else from a shared data folder beside the
checkout, else downloaded once by the project's own code into ./data), and a real
train_fp8.py process with tiny arguments."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _find_data_dir() -> str:
    for cand in (os.environ.get("FP8TRAIN_DATA_DIR"), ROOT.parent / "shared" / "data",
                 ROOT / "data"):
        if cand and (Path(cand) / "tinyshakespeare.txt").is_file():
            return str(cand)
    return str(ROOT / "data")  # the trainer downloads it here, or says where to put it


DATA_DIR = _find_data_dir()


def corpus_missing() -> "str | None":
    """Why tinyshakespeare cannot be had without a download, or None."""
    if (Path(DATA_DIR) / "tinyshakespeare.txt").is_file():
        return None
    return ("tinyshakespeare.txt not found (looked in $FP8TRAIN_DATA_DIR, the shared data folder "
            "beside the checkout and ./data); the GPU tests never download it: put the file in "
            "one of those folders")


def require_corpus() -> str:
    """The data folder; fails the test (no traceback) when the corpus is not in it."""
    why = corpus_missing()
    if why:
        pytest.fail(why, pytrace=False)
    return DATA_DIR


# torchrun on a free port of its own (--standalone): two multi-process tests side by side (the
# suite runs two test files at a time) never meet on one rendezvous port.
TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone")


def run_train(*args, env=None, timeout=600) -> subprocess.CompletedProcess:
    """`python train_fp8.py ARGS` in a real subprocess, from the repository root."""
    full_env = dict(os.environ, FP8TRAIN_DATA_DIR=DATA_DIR, PYTHONUNBUFFERED="1")
    full_env.update(env or {})
    return subprocess.run([sys.executable, entry_script(full_env), *map(str, args)], cwd=ROOT,
                          env=full_env, capture_output=True, text=True, timeout=timeout)


def entry_script(env) -> str:
    """train_fp8.py, or with FP8TRAIN_FAULTS set its fault-injecting twin (support/faults.py)."""
    return "tests/support/train_with_faults.py" if env.get("FP8TRAIN_FAULTS") else "train_fp8.py"


def rows(run_dir, key: "str | None" = None) -> list:
    """The run's metrics.jsonl rows in order (with `key`: those that have it), read by the
    package's own reader, strictly: a line that is not a row fails the test."""
    from fp8train.observe.metrics_file import read_rows
    found = read_rows(str(run_dir), strict=True)
    return found if key is None else [r for r in found if key in r]


# Parts of metric names that time the run: two runs of the same training differ in them only.
TIMINGS = ("per_sec", "time", "data_wait", "mfu", "_ms")


def untimed(row: dict) -> dict:
    """A metrics row without its timings, for comparing two runs' rows exactly."""
    return {k: v for k, v in row.items() if not any(t in k for t in TIMINGS)}


def tiny_args(output_dir, **overrides):
    """A seconds-long run: the demo config shrunk further, in fp32 unless FP8 is asked for
    (use_fp8=true) so that tests of the loop itself compare exact numbers, with AdamW and the
    cosine to 0.1 of a 3e-3 peak unless asked otherwise (the demo's own choices may change
    with its tuning)."""
    kw = dict(config="configs/test_fp8.yaml", output_dir=output_dir, use_fp8="false",
              optimizer="adamw", lr_schedule="cosine", learning_rate=3e-3, min_lr_ratio=0.1,
              n_layer=2, seq_len=64,
              batch_size=8, gradient_accumulation_steps=2, warmup_steps=3, max_steps=12,
              log_interval=4, eval_interval=6, checkpoint_interval=6, eval_sequences=32)
    kw.update(overrides)
    return [f"--{k}={v}" for k, v in kw.items()]


class FakeClock:
    """A clock the test moves by hand (`advance`), for what takes a `clock()` of seconds: time
    measured without sleeping."""

    def __init__(self, start: float = 1000.0):
        self.now = start

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def __call__(self) -> float:
        return self.now
