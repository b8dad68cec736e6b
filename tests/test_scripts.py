import subprocess
import sys

import pytest

from conftest import ROOT


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
