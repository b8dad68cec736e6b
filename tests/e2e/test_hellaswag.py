"""HellaSwag in a real run (hellaswag/acc and acc_norm at its interval, in the log line, the
summary and summary.json) and scripts/evaluate.py --hellaswag reproducing it from the checkpoint,
from the file and, offline, from the hub's copy in a local datasets cache; offline without a
path or a cached copy, each command fails at once in one line naming its own option. The
readers of each format and their one-line errors: tests/unit/test_hellaswag.py."""
import json
import os
import subprocess
import sys
import time

import pytest
from support.hellaswag_shared import datasets_cache, write_hellaswag
from support.runs import ROOT, run_train, tiny_args

from fp8train.observe.metrics_file import read_rows


@pytest.fixture
def hellaswag_file(tmp_path):
    return write_hellaswag(tmp_path)


def evaluate_py(*args, env=None):
    """scripts/evaluate.py ARGS, importing fp8train from this checkout."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "scripts/evaluate.py", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=path, **(env or {})))


def test_a_run_logs_both_accuracies_and_evaluate_py_reproduces_them(tmp_path, hellaswag_file):
    out = tmp_path / "run"
    r = run_train(*tiny_args(out, hellaswag_interval=12, hellaswag_path=hellaswag_file))
    assert r.returncode == 0, r.stderr[-2000:]
    rows = read_rows(out, strict=True)
    (row,) = [row for row in rows if "hellaswag/acc" in row]
    acc, norm = row["hellaswag/acc"], row["hellaswag/acc_norm"]
    assert row["step"] == 12 and row["hellaswag/examples"] == 4
    assert {acc, norm} <= {0.0, 0.25, 0.5, 0.75, 1.0} and row["val/hellaswag_acc"] == norm
    assert f"HellaSwag acc {acc:.4f}, acc_norm {norm:.4f} (per token) over 4 examples" in r.stdout
    summary = json.loads((out / "summary.json").read_text())["hellaswag"]
    assert summary == {"acc": acc, "acc_norm": norm, "examples": 4, "acc_norm_by": "token",
                       "step": 12}
    assert f"summary: HellaSwag at step 12: acc {acc:.4f}, acc_norm {norm:.4f} (per token) " \
           "over 4 examples" in r.stdout
    e = evaluate_py(str(out), "--hellaswag", hellaswag_file, "--json")
    assert e.returncode == 0, e.stderr[-2000:]
    got = json.loads(e.stdout)
    assert (got["hellaswag/acc"], got["hellaswag/acc_norm"], got["val/hellaswag_acc"]) == \
        (acc, norm, norm)
    assert got["examples"] == 4 and got["step"] == 12 and got["acc_norm_by"] == "token"
    # The hub's copy, offline, from a datasets cache (labels as strings): the same examples.
    home = datasets_cache(tmp_path / "hf")
    e = evaluate_py(str(out), "--hellaswag",
                    env=dict(FP8TRAIN_OFFLINE="1", HF_HOME=home,
                             HF_DATASETS_CACHE=os.path.join(home, "datasets")))
    assert e.returncode == 0, e.stderr[-2000:]
    assert f"HellaSwag acc {acc:.4f}, acc_norm {norm:.4f} (per token) over 4 examples" in \
        e.stdout and "Traceback" not in e.stderr


@pytest.mark.parametrize("command", ["train", "evaluate"])
def test_offline_without_a_path_fails_at_once_naming_the_option_of_the_command(tmp_path,
                                                                               command):
    env = dict(FP8TRAIN_OFFLINE="1", HF_HOME=str(tmp_path / "empty"),
               HF_DATASETS_CACHE=str(tmp_path / "empty" / "datasets"))
    start = time.monotonic()
    if command == "train":
        r = run_train(*tiny_args(tmp_path / "run", hellaswag_interval=6), env=env)
        where, option = "--hellaswag_interval=6: key 'hellaswag_interval': ", "hellaswag_path"
    else:   # before the checkpoint is even looked at
        r = evaluate_py(str(tmp_path / "no-run-yet"), "--hellaswag", env=env)
        where, option = "", "--hellaswag PATH"
    seconds = time.monotonic() - start
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"error: {where}HellaSwag from the hub (Rowan/hellaswag): it is not in the local "
        f"HuggingFace cache and offline mode is set (FP8TRAIN_OFFLINE=1); give {option} a local "
        "copy: hellaswag_val.jsonl (github.com/rowanz/hellaswag) or the hub's validation "
        "parquet"], r.stderr
    assert seconds < 30, seconds          # no retries against the hub
    assert not (tmp_path / "run").exists()  # nothing built
