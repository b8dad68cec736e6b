import importlib.util
import os
import shlex
import subprocess
import sys

import pytest
from support.bad_cases_tools import TOOL_CASES
from support.bad_input_kit import write_files
from support.runs import ROOT, run_train, tiny_args


def test_visualize_lr_schedule_writes_a_png_and_prints_values(tmp_path):
    out = tmp_path / "lr.png"
    r = subprocess.run([sys.executable, "scripts/visualize_lr_schedule.py", "--warmup_steps",
                        "2000", "--total_steps", "20000", "--max_lr", "0.003", "--output",
                        str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    values = dict(line.split() for line in r.stdout.splitlines()[1:] if line.strip()[0].isdigit())
    assert float(values["1999"]) == 0.003 and float(values["19999"]) == 0.0003
    assert float(values["0"]) == 0.003 / 2000


def test_checkpoint_benchmark_times_both_modes_with_the_trainers_writer(tmp_path):
    """scripts/bench_checkpoint.py on the tiny preset: one synchronous and one background save,
    each timed, in results.json and the table; the checkpoints removed afterwards."""
    import json
    r = subprocess.run([sys.executable, "scripts/bench_checkpoint.py", "--preset", "tiny",
                        "--vocab", "256", "--repeats", "1", "--out", str(tmp_path / "b")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    results = json.loads((tmp_path / "b" / "results.json").read_text())["results"]
    assert [(x["mode"], x["save"]) for x in results] == [("sync", 1), ("async", 1)]
    assert all(0 < x["blocked_s"] <= x["save_s"] and x["size_gb"] > 0 for x in results)
    assert "| sync | 1 |" in r.stdout and "| async | 1 |" in r.stdout
    assert [p.name for p in (tmp_path / "b").iterdir()] == ["results.json"]


def test_visualize_rejects_warmup_past_the_end(tmp_path):
    r = subprocess.run([sys.executable, "scripts/visualize_lr_schedule.py", "--warmup_steps",
                        "10", "--total_steps", "10", "--max_lr", "0.1"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "warmup_steps (10) must be in" in r.stderr


SCRIPTS = sorted(p.name for p in (ROOT / "scripts").glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_runs_from_any_directory_on_the_installed_package(tmp_path, script):
    """No script edits sys.path: each imports the installed fp8train (`pip install -e .`), so
    it runs the same from any working directory."""
    path = ROOT / "scripts" / script
    assert "sys.path" not in path.read_text()
    r = subprocess.run([sys.executable, str(path), "--help"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "usage:" in r.stdout, r.stderr[-3000:]


# --- bad input to the tools: one line, exit 2 (the cases: tests/support/bad_cases_tools.py) ----------

def _fill_tool(text: str, d, python: str) -> str:
    return text.replace("{d}", str(d)).replace("{python}", python)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in TOOL_CASES])
def test_tool_bad_input_is_one_line_and_exit_2(case, tmp_path):
    d = tmp_path
    write_files(d, case.files)
    bare = d / "bare-python"   # this interpreter without its site-packages: no torch, ...
    bare.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -S "$@"\n')
    bare.chmod(0o755)
    env = dict(os.environ, **{k: _fill_tool(v, d, sys.executable) for k, v in case.env.items()})
    r = subprocess.run([_fill_tool(a, d, sys.executable) for a in case.argv], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    shown = f"exit {r.returncode}\n--- stderr:\n{r.stderr[-4000:]}\n--- stdout:\n{r.stdout[-2000:]}"
    assert "Traceback" not in r.stderr + r.stdout, shown
    assert r.returncode == 2, shown
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "error: " in lines[0], shown
    for e in case.expect if isinstance(case.expect, tuple) else (case.expect,):
        assert _fill_tool(e, d, sys.executable) in lines[0], shown


def test_export_prints_no_torchao_import_noise(tmp_path):
    """Loading the export back imports torchao through transformers' quantizers (where torchao
    is installed); its kernel-library and deprecation log lines are not the export's business:
    a successful export leaves stderr empty."""
    if importlib.util.find_spec("torchao") is None:
        pytest.skip("torchao is not installed: nothing imports it")
    run = tmp_path / "run"
    r = run_train(*tiny_args(run, max_steps=2, warmup_steps=0, checkpoint_interval=2,
                             eval_interval=2, eval_sequences=4, eval_samples=0))
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run([sys.executable, "scripts/export_hf.py", str(run), str(tmp_path / "hf")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "logits match" in r.stdout, r.stderr[-3000:]
    assert r.stderr == ""
