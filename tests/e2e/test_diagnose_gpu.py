"""The GPU check (scripts/diagnose_gpu.py, fp8train/diagnose) on this CPU machine, for real, and
its GPU report from injected numbers.

Run for real here: the whole script as a subprocess (no CUDA: it must say so, exit 0 and write
its JSON), the import checks (torchao is installed in the test environment, Transformer Engine
is not), and two of the FP8 GEMM checks themselves: torch._scaled_mm exists on CPU, so the
native check runs its real GEMMs, and torchao's check runs with torchao's CPU emulation. SDPA's
kernels and the matmul and copy timings also run on CPU, where they exist there.

Not runnable without a GPU: the TE check, the attention kernels on CUDA and the timed ceilings
(CUDA events). For those the tests feed made-up measurements of an H100 / A100 into the same
functions main() uses to judge and print them (verdicts, percentages of metrics.py's peaks).
Where a test needs a GPU to be there, only CUDA is mocked (torch.cuda's device queries, events
and synchronisation; a fake nvidia-smi): everything else runs as it does on a GPU machine.
"""


import json
import subprocess
import sys

import pytest
import torch
from support.runs import ROOT

from fp8train.diagnose import environment


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_script_on_a_cpu_machine_says_no_cuda_and_writes_json(tmp_path):
    out = tmp_path / "out.json"
    r = subprocess.run([sys.executable, "scripts/diagnose_gpu.py", "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "no CUDA" in r.stdout and "Traceback" not in r.stderr
    report = json.loads(out.read_text())
    assert report["versions"]["torch"] == torch.__version__
    assert report["versions"]["cuda_runtime"] == torch.version.cuda
    assert report["device"]["cuda"] is False and report["device"]["reason"]
    backends = report["fp8"]["backends"]
    assert set(backends) == {"te", "torchao", "native"}
    assert backends["torchao"]["imports"] is True      # a dev dependency of this project
    assert backends["te"]["imports"] is False          # needs CUDA to even install
    assert "transformer_engine is not installed" in backends["te"]["error"]
    assert backends["native"]["imports"] is True       # torch._scaled_mm
    assert all(b["gemm"] is None for b in backends.values())   # no device, no GEMM
    status = {v["feature"]: v["status"] for v in report["verdicts"]}
    assert status["CUDA device"] == "MISSING" and status["FP8 torchao"] == "MISSING"
    assert set(status.values()) == {"MISSING"}
    # the verdicts printed are the ones written
    for v in report["verdicts"]:
        assert f"{v['feature']:<26}{v['status']:<9}{v['reason']}" in r.stdout


def test_help_is_instant_and_imports_no_torch():
    code = ("import runpy, sys; sys.argv = ['diagnose_gpu.py', '--help']\n"
            "try:\n    runpy.run_path('scripts/diagnose_gpu.py', run_name='__main__')\n"
            "except SystemExit as e:\n    assert e.code == 0, e.code\n"
            "print('torch loaded' if 'torch' in sys.modules else 'no torch')")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "--size N" in r.stdout and r.stdout.strip().endswith("no torch")


def test_driver_version_from_nvidia_smi_else_from_torch(tmp_path, monkeypatch):
    """A fake nvidia-smi on PATH; without one, torch's driver query (mocked: CPU builds have
    none)."""
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text("#!/bin/sh\necho 570.124.06\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(smi.parent))
    assert environment.driver_version() == ("570.124.06", "nvidia-smi")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(torch._C, "_cuda_getDriverVersion", lambda: 12040, raising=False)
    assert environment.driver_version() == ("supports CUDA 12.4", "torch (no nvidia-smi)")
    monkeypatch.setattr(torch._C, "_cuda_getDriverVersion", lambda: 0)
    assert environment.driver_version() == (None, None)
