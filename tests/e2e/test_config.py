"""The config contract: strict keys, types and ranges, CLI overrides, one-line errors."""


import os
import subprocess
import sys

import pytest
import yaml
from support.config_shared import write
from support.runs import ROOT

from fp8train.config import load as C


def test_no_arguments_prints_usage_and_writes_nothing(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "train_fp8.py")], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == "", r
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no config given; usage: "
                                                   "train_fp8.py --config FILE"), r.stderr
    assert "configs/test_fp8.yaml" in lines[0] and "--help" in lines[0]
    assert list(tmp_path.iterdir()) == []


# Entry points whose help is read through a pipe that closes early (`--help | head`).
PIPED = ["train_fp8.py", "run_sweep.py", "scripts/visualize_lr_schedule.py"]


@pytest.mark.parametrize("entry", PIPED)
def test_help_into_a_closed_pipe_exits_quietly(entry):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.Popen([sys.executable, entry, "--help"], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()    # the reader is gone before the first line is written
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 0 and err == "", err


def test_help_lists_every_key_without_importing_torch():
    code = ("import sys; from fp8train.train.cli import main; rc = main(['--help']); "
            "print('TORCH', 'torch' in sys.modules, rc)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    assert "TORCH False 0" in out
    for key in C.KEYS:
        assert f"--{key} " in out, key


BAD_CONFIGS = {
    "unknown_key": ("lerning_rate: 0.1\n", "unknown key 'lerning_rate'"),
    "wrong_type": ("seq_len: long\n", "key 'seq_len'"),
    "negative_lr": ("learning_rate: -3.0e-4\n", "key 'learning_rate'"),
    "warmup_ge_total": ("warmup_steps: 50\nmax_steps: 50\n", "key 'warmup_steps'"),
    "not_yaml": ("seed: [1, 2\n", "not valid YAML"),
    "empty": ("", "file is empty"),
    "a_list": ("- seed\n- 1\n", "expected a mapping"),
    "nested": ("model:\n  n_layer: 2\n", "key 'model'"),
    "dataset_missing": ("dataset: /no/such/corpus.txt\n", "key 'dataset'"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_config_exits_2_with_one_line(tmp_path, case):
    text, expected = BAD_CONFIGS[case]
    path = write(tmp_path, text, name=f"{case}.yaml")
    r = subprocess.run([sys.executable, "train_fp8.py", "--config", path], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert path in lines[0] and expected in lines[0], lines[0]


def test_missing_config_file_exits_2(tmp_path):
    r = subprocess.run([sys.executable, "train_fp8.py", "--config", str(tmp_path / "nope.yaml")],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip() == f"error: config file '{tmp_path / 'nope.yaml'}' not found"


def test_short_run_of_a_config_shortens_its_warmup_and_records_it(tmp_path, data_dir):
    """`--max_steps=20` over configs/test_fp8.yaml (warmup_steps: 30) trains, with one warning,
    the shortened warmup in config.yaml's derived section, and the LR following it."""
    import json
    out = tmp_path / "run"
    r = subprocess.run(
        [sys.executable, "train_fp8.py", "--config", "configs/test_fp8.yaml", "--max_steps=20",
         f"--output_dir={out}", f"--dataset={data_dir}/tinyshakespeare.txt", "--no_fp8",
         "--n_layer=2", "--seq_len=32", "--batch_size=2", "--gradient_accumulation_steps=1",
         "--log_interval=1", "--eval_interval=100", "--eval_sequences=4", "--eval_samples=0",
         "--checkpoint_interval=100", "--optimizer=adamw", "--lr_schedule=cosine",
         "--learning_rate=3e-3", "--min_lr_ratio=0.1"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    warnings = [line for line in r.stderr.splitlines() if "warmup" in line]
    assert warnings == ["WARNING: warmup_steps (30, configs/test_fp8.yaml) is not shorter than "
                        "the run's 20 steps: warming up for 2 steps instead (10% of the "
                        "schedule)"], r.stderr
    derived = yaml.safe_load((out / "config.yaml").read_text())["derived"]
    assert (derived["warmup_steps"], derived["lr_schedule_steps"]) == (2, 20)
    lrs = {row["step"]: row["train/lr"] for row in map(json.loads, open(out / "metrics.jsonl"))
           if "train/lr" in row}
    assert lrs[1] == pytest.approx(3e-3 / 2) and lrs[2] == pytest.approx(3e-3)
    assert lrs[20] == pytest.approx(3e-4)
