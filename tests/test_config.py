"""The config contract: strict keys, types and ranges, CLI overrides, one-line errors."""
import glob
import os
import subprocess
import sys
import textwrap

import pytest
import yaml

from conftest import ROOT
from fp8train import config as C
from fp8train.batching import BatchPlan, manual_plan
from fp8train.config import ConfigError, load_config


def write(tmp_path, text, name="x.yaml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return str(p)


def test_unknown_key_suggests_the_right_one(tmp_path):
    path = write(tmp_path, "lerning_rate: 0.1\n")
    with pytest.raises(ConfigError) as e:
        load_config(["--config", path])
    assert str(e.value) == f"unknown key 'lerning_rate' in {path} (did you mean 'learning_rate'?)"


def test_unknown_cli_option_suggests_the_right_one():
    with pytest.raises(ConfigError, match=r"unknown option '--warmup_step' in the command line "
                                          r"\(did you mean '--warmup_steps'\?\)"):
        load_config(["--warmup_step", "5"])


@pytest.mark.parametrize("text,key", [
    ("learning_rate: fast\n", "learning_rate"),
    ("learning_rate: -0.1\n", "learning_rate"),
    ("seq_len: 1.5\n", "seq_len"),
    ("use_fp8: maybe\n", "use_fp8"),
    ("fp8_backend: cuda\n", "fp8_backend"),
    ("batch_size: 0\n", "batch_size"),
    ("min_lr_ratio: 2\n", "min_lr_ratio"),
    ("batch_size: true\n", "batch_size"),
    ("model: gpt5\n", "model"),
    ("warmup_steps: 100\nmax_steps: 100\n", "warmup_steps"),
    ("penalty_weight: 0.1\n", "penalty_weight"),
    ("max_steps: null\nnum_epochs: null\n", "num_epochs"),
    ("seed: {a: 1}\n", "seed"),
    ("seed: 4294967296\n", "seed"),
])
def test_bad_values_name_file_and_key(tmp_path, text, key):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(["--config", path])
    msg = str(e.value)
    assert path in msg and f"'{key}'" in msg and "\n" not in msg


def test_float_literals_without_a_dot_are_numbers(tmp_path):
    # PyYAML reads 3e-3 as a string; the schema reads it as the number the user meant.
    cfg = load_config(["--config", write(tmp_path, "learning_rate: 3e-3\n")])
    assert cfg.learning_rate == pytest.approx(0.003)


def test_cli_overrides_yaml_in_both_spellings(tmp_path):
    path = write(tmp_path, "learning_rate: 0.1\nseq_len: 64\nuse_fp8: true\n")
    cfg = load_config(["--config", path, "--learning_rate=2e-4", "--seq_len", "32", "--no_fp8",
                       "--wandb_tags", "a,b", "--resume", "--compile", "--max_steps=null"])
    assert (cfg.learning_rate, cfg.seq_len, cfg.use_fp8) == (2e-4, 32, False)
    assert cfg.wandb_tags == ["a", "b"] and cfg.resume == "auto" and cfg.compile is True
    assert cfg.max_steps is None
    cfg = load_config(["--config", path, "--use_fp8", "false", "--fp8_backend", "native"])
    assert cfg.use_fp8 is False and cfg.fp8_backend == "native"
    # the last occurrence wins, as with any command line
    assert load_config(["--seed", "1", "--seed=2"]).seed == 2


def test_cli_errors():
    with pytest.raises(ConfigError, match="'--seq_len' needs a value"):
        load_config(["--seq_len"])
    with pytest.raises(ConfigError, match="unexpected argument 'stray'"):
        load_config(["stray"])
    with pytest.raises(ConfigError, match="the command line: key 'seq_len'"):
        load_config(["--seq_len=abc"])


def test_defaults_output_dir_from_config_name_and_data_dir_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("FP8TRAIN_DATA_DIR", "/some/data")
    cfg = load_config(["--config", write(tmp_path, "seed: 1\n", name="my_run.yaml")])
    assert cfg.output_dir == os.path.join("runs", "my_run") and cfg.data_dir == "/some/data"
    monkeypatch.delenv("FP8TRAIN_DATA_DIR")
    assert load_config([]).data_dir == "data"


@pytest.mark.parametrize("path", sorted(
    p for p in glob.glob(str(ROOT / "configs" / "**" / "*.yaml"), recursive=True)
    if os.sep + "sweeps" + os.sep not in p))   # sweep files: tests/test_sweep.py
def test_every_shipped_config_loads_and_validates(path):
    cfg = load_config(["--config", path])
    raw = yaml.safe_load(open(path))
    for key, value in raw.items():  # every value in the file reached the config
        got = getattr(cfg, key)
        assert got == value or (isinstance(value, float) and got == pytest.approx(value)), key


def test_shipped_configs_cover_the_documented_ones():
    names = {os.path.basename(p) for p in glob.glob(str(ROOT / "configs" / "*.yaml"))}
    assert {"test_fp8.yaml", "fineweb_edu_fp8.yaml", "fineweb_edu_bf16.yaml",
            "openwebtext_adaptive_batch.yaml", "test_auto_batch.yaml"} <= names
    fp8 = load_config(["--config", str(ROOT / "configs" / "fineweb_edu_fp8.yaml")])
    assert (fp8.dataset, fp8.target_effective_batch_size, fp8.max_batch_size) == \
        ("fineweb-edu", 512, 128)
    assert (fp8.learning_rate, fp8.warmup_steps, fp8.num_epochs, fp8.min_lr_ratio) == \
        (3e-3, 2000, 2, 0.1)
    assert (fp8.use_fp8, fp8.fp8_format, fp8.fp8_margin) == (True, "hybrid", 0)


def test_written_config_loads_back_identically(tmp_path):
    cfg = load_config(["--config", str(ROOT / "configs" / "test_fp8.yaml"), "--wandb_tags=x",
                       "--output_dir", str(tmp_path / "run")])
    path = tmp_path / "config.yaml"
    path.write_text(C.dump_yaml(cfg, {"micro_batch_size": 16, "world_size": 1}))
    again = load_config(["--config", str(path)])
    assert C.to_dict(again) == C.to_dict(cfg)


def test_help_lists_every_key_without_importing_torch():
    code = ("import sys; from fp8train.cli import main; rc = main(['--help']); "
            "print('TORCH', 'torch' in sys.modules, rc)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    assert "TORCH False 0" in out
    for key in C.KEYS:
        assert f"--{key} " in out, key


# --- bad input through the real entry point: exit 2, one line, no traceback -------------------

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


# --- batch plan ----------------------------------------------------------------------------------

def plan_for(world, **kw):
    return manual_plan(load_config([f"--{k}={v}" for k, v in kw.items()]), world)


def test_manual_batch_plan():
    assert plan_for(1, batch_size=8) == BatchPlan(8, 1, 1)
    assert plan_for(8, batch_size=16, target_effective_batch_size=512) == BatchPlan(16, 4, 8)
    assert plan_for(2, batch_size=4, gradient_accumulation_steps=3,
                    target_effective_batch_size=24).effective == 24
    with pytest.raises(ConfigError, match="nearest valid: 384 or 512"):
        plan_for(8, batch_size=16, target_effective_batch_size=500)
    with pytest.raises(ConfigError, match="= 32, but target_effective_batch_size is 64"):
        plan_for(1, batch_size=16, gradient_accumulation_steps=2, target_effective_batch_size=64)


def test_config_reference_documents_every_key():
    reference = (ROOT / "docs" / "config.md").read_text()
    missing = [k for k in C.KEYS if f"| `{k}` |" not in reference]
    assert not missing, f"keys missing from docs/config.md's key tables: {missing}"
