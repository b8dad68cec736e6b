"""The documentation is tested like code.

- Every command block marked as runnable on a CPU (fenced ```bash cpu) in README.md and the
  pages under docs/ (docs/records/ included) runs here as a reader would run it: from the
  repository root, with bash, its run directories (`runs/...`) moved into a temporary folder.
  A guide whose command broke fails.
- Every Python block (fenced ```python) runs too, in a folder that holds what the guides'
  Python names: the quick-start demo's run (`runs/test_fp8`, the demo config for fewer steps)
  and its export (`hf/test_fp8`).
- Every relative link in README.md and the pages under docs/ points at a file that exists
  and, for a `#anchor`, at a heading of that file; every repository path they name
  (`fp8train/...`, `scripts/...`) exists.
- docs/config.md is exactly what `python -m fp8train.config.reference` generates from the
  schema, so it cannot drift from the config.
- The README's quick-start commands are the ones CI runs, and the README stays a front door.
"""


import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.guides_shared import BLOCK, PYTHON, doc_files
from support.runs import DATA_DIR, ROOT


def _blocks():
    found = []
    for path in doc_files():
        text = path.read_text(encoding="utf-8")
        for i, m in enumerate(BLOCK.finditer(text), 1):
            found.append(pytest.param(m.group(1), id=f"{path.stem}-{i}"))
    return found


@pytest.mark.parametrize("block", _blocks())
def test_guide_command_runs_on_cpu(block, tmp_path):
    script = block.replace("runs/", f"{tmp_path}/runs/")
    # As after `pip install -e .` in the repository: the scripts import fp8train from here.
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, FP8TRAIN_DATA_DIR=DATA_DIR, FP8TRAIN_OFFLINE="1",
               WANDB_MODE="offline", PYTHONUNBUFFERED="1", PYTHONPATH=pythonpath)
    named = sorted(set(re.findall(r"runs/(guide-[\w.-]+)", block)))
    before = {name for name in named if Path(ROOT, "runs", name).exists()}
    r = subprocess.run(["bash", "-o", "pipefail", "-c", script], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    after = {name for name in named if Path(ROOT, "runs", name).exists()}
    assert after <= before, f"a guide command wrote into the repository's runs/: {after - before}"


def _python_blocks():
    return [pytest.param(m.group(1), id=f"{path.stem}-python-{i}")
            for path in doc_files()
            for i, m in enumerate(PYTHON.finditer(path.read_text(encoding="utf-8")), 1)]


@pytest.fixture(scope="module")
def demo_export(tmp_path_factory):
    """A folder holding runs/test_fp8 (the demo config: the same model and 64-token context,
    20 steps) and hf/test_fp8 (its export), the checkout's own files beside them."""
    root = tmp_path_factory.mktemp("guides_python")
    env = dict(os.environ, FP8TRAIN_DATA_DIR=DATA_DIR, PYTHONPATH=str(ROOT))
    run = root / "runs" / "test_fp8"
    for argv in (["train_fp8.py", "--config", "configs/test_fp8.yaml", f"--output_dir={run}",
                  "--max_steps=20", "--warmup_steps=2", "--log_interval=10",
                  "--eval_interval=20", "--eval_sequences=8", "--checkpoint_interval=20"],
                 ["scripts/export_hf.py", str(run), str(root / "hf" / "test_fp8")]):
        r = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
    for name in os.listdir(ROOT):        # configs/, scripts/, ... as from the checkout
        if not (root / name).exists():
            (root / name).symlink_to(ROOT / name)
    return root


@pytest.mark.parametrize("block", _python_blocks())
def test_guide_python_runs(block, demo_export):
    env = dict(os.environ, PYTHONPATH=str(ROOT), FP8TRAIN_DATA_DIR=DATA_DIR,
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    r = subprocess.run([sys.executable, "-c", block], cwd=demo_export, env=env,
                       capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "Traceback" not in out, out[-4000:]


def test_config_reference_command_prints_the_page():
    r = subprocess.run([sys.executable, "-m", "fp8train.config.reference"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout == (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
