"""scripts/diagnose_gpu.py on this CPU machine, for real, and its GPU report from injected numbers.

Run for real here: the whole script as a subprocess (no CUDA: it must say so, exit 0 and write
its JSON), the import checks (torchao is installed in the test environment, Transformer Engine
is not), and two of the FP8 GEMM checks themselves: torch._scaled_mm exists on CPU, so the
native check runs its real GEMMs, and torchao's check runs with torchao's CPU emulation.

Not runnable without a GPU: the TE check, the attention kernels on CUDA and the timed ceilings
(CUDA events). For those the tests feed made-up measurements of an H100 / A100 into the same
functions main() uses to judge and print them (verdicts, percentages of metrics.py's peaks).
"""
import importlib.util
import json
import subprocess
import sys

import pytest
import torch

from conftest import ROOT

spec = importlib.util.spec_from_file_location("diagnose_gpu", ROOT / "scripts" / "diagnose_gpu.py")
dg = importlib.util.module_from_spec(spec)
spec.loader.exec_module(dg)

H100 = "NVIDIA H100 80GB HBM3"
CPU = torch.device("cpu")


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


def test_native_fp8_gemms_run_for_real_and_match_bf16():
    """torch._scaled_mm runs on CPU too: the native check's layouts, scales and tolerance."""
    res = dg.run_check(dg.check_native, CPU)
    assert res["ok"], res
    assert 0.01 < res["fwd_err"] < dg.FWD_TOL and 0.01 < res["grad_err"] < dg.GRAD_TOL


def test_torchao_check_runs_emulated_on_cpu():
    res = dg.run_check(dg.check_torchao, CPU)
    assert res["ok"], res
    assert "Float8Linear" in res["what"] and "emulated" in res["what"]
    assert res["fwd_err"] < dg.FWD_TOL and res["grad_err"] < dg.GRAD_TOL


def test_a_wrong_gemm_or_an_exception_is_a_failed_check_not_a_crash():
    wrong = dg.run_check(lambda: dg._judge({"what": "gemm", "fwd_err": 0.9, "grad_err": 0.05}))
    assert not wrong["ok"] and "fwd_err relative error 0.9 > 0.1" in wrong["error"]
    nan = dg.run_check(lambda: dg._judge({"what": "gemm", "fwd_err": float("nan")}))
    assert not nan["ok"]
    boom = dg.run_check(lambda: 1 / 0)
    assert boom == {"ok": False, "error": "ZeroDivisionError: division by zero"}


def test_size_must_be_a_multiple_of_16(capsys):
    with pytest.raises(SystemExit) as e:
        dg.main(["--size", "1000"])
    assert e.value.code == 2 and "multiple of 16" in capsys.readouterr().err


def _gpu_report(name, capability, measured, gate=None, torchao_gemm=None, cudnn=None):
    """A report as main() builds it on a GPU, with the measurements made up."""
    ok_gemm = {"ok": True, "what": "te.Linear forward + backward", "fwd_err": 0.038,
               "grad_err": 0.059}
    native = dict(ok_gemm, what="torch._scaled_mm forward + grad_input GEMMs")
    report = {
        "versions": {"python": "3.11.7", "torch": "2.13.0+cu128", "cuda_runtime": "12.8",
                     "cudnn": "9.10.2", "nccl": "2.27.3", "nccl_available": True,
                     "driver": "570.124.06", "driver_source": "nvidia-smi"},
        "device": {"cuda": True, "reason": None, "index": 0, "count": 8, "name": name,
                   "capability": capability, "memory_gib": 79.1, "sm_count": 132},
        "fp8": {"gate": gate, "backends": {
            "te": {"imports": True, "version": "transformer_engine 2.5.0", "error": None,
                   "gemm": None if gate else ok_gemm},
            "torchao": {"imports": True, "version": "torchao 0.18.0", "error": None,
                        "gemm": None if gate else torchao_gemm},
            "native": {"imports": True, "version": "torch 2.13.0+cu128, torch._scaled_mm",
                       "error": None, "gemm": None if gate else native}}},
        "attention": {"flash": {"ok": True, "rel_err": 0.002},
                      "efficient": {"ok": True, "rel_err": 0.002},
                      "cudnn": cudnn or {"ok": True, "rel_err": 0.002}},
        "ceilings": dg.judge_ceilings(name, measured),
    }
    report["verdicts"] = dg.verdicts(report)
    return report


def _measured(bf16, fp8=None, fp8_skipped=None):
    plan = dg.timing_plan(8192, quick=False)
    m = {"plan": plan, "bf16_matmul": {"ok": True, "tflops": bf16, "ms": 1.7},
         "d2d_copy": {"ok": True, "gbps": 2950.0, "ms": 0.73, "bytes": 1 << 30},
         "h2d_pinned": {"ok": True, "gbps": 53.2, "ms": 5.0, "bytes": 256 << 20}}
    m["fp8_matmul"] = ({"ok": True, "tflops": fp8, "ms": 0.85} if fp8 else
                       {"ok": False, "skipped": fp8_skipped})
    return m


def test_h100_report_prints_the_measured_ceilings_as_percent_of_the_datasheet_peak():
    """Injected numbers (no GPU here): bf16 650 and FP8 1300 TFLOP/s on an H100 SXM, whose
    bf16 dense peak in fp8train/metrics.py is 989.4 TFLOP/s."""
    failed_ao = {"ok": False, "error": "RuntimeError: CUDA error: no kernel image"}
    failed_cudnn = {"ok": False, "error": "RuntimeError: cuDNN attention refused"}
    report = _gpu_report(H100, [9, 0], _measured(650.0, 1300.0), torchao_gemm=failed_ao,
                         cudnn=failed_cudnn)
    text = dg.format_report(report)
    lines = text.splitlines()
    bf16 = next(line for line in lines if line.strip().startswith("bf16 matmul"))
    assert "650.0 TFLOP/s" in bf16 and "66% of the 989.4 TFLOP/s bf16 dense peak" in bf16
    fp8 = next(line for line in lines if line.strip().startswith("FP8 matmul"))
    assert "1300.0 TFLOP/s" in fp8 and "66% of the 1978.8 TFLOP/s FP8 dense peak" in fp8
    assert "2.00x the bf16 matmul" in fp8 and "131% of the bf16 peak" in fp8
    assert "MFU against the H100 SXM bf16 dense peak, 989.4 TFLOP/s" in text
    assert "2950.0 GB/s  (1 GiB, read + write)" in text and "53.2 GB/s  (256 MiB, pinned)" in text
    assert "NVIDIA H100 80GB HBM3 (device 0 of 8), compute capability 9.0" in text
    assert "570.124.06 (nvidia-smi)" in text
    v = {r["feature"]: (r["status"], r["reason"]) for r in report["verdicts"]}
    assert v["CUDA device"][0] == v["FP8 hardware"][0] == v["FP8 te"][0] == "OK"
    assert v["FP8 torchao"] == ("FAILED", failed_ao["error"])
    assert v["SDPA cudnn attention"] == ("FAILED", failed_cudnn["error"])
    assert v["SDPA flash attention"][0] == "OK"
    assert v["bf16 matmul ceiling"] == ("OK", "650.0 TFLOP/s, 66% of the bf16 peak")
    assert v["NCCL"] == ("OK", "NCCL 2.27.3 in torch.distributed")
    assert "FP8 torchao               FAILED   RuntimeError: CUDA error" in text
    json.dumps(report)   # what --json writes


def test_old_gpu_says_fp8_needs_8_9_and_unknown_gpu_gets_no_percentages():
    gate = "FP8 needs compute capability 8.9 or newer (H100/H200, L40, RTX 4090); A100 is 8.0"
    report = _gpu_report("NVIDIA A100-SXM4-80GB", [8, 0], _measured(250.0, fp8_skipped=gate),
                         gate=gate)
    text = dg.format_report(report)
    assert f"FP8 ({gate}; imports only)" in text
    assert "250.0 TFLOP/s  80% of the 312 TFLOP/s bf16 dense peak" in text
    v = {r["feature"]: (r["status"], r["reason"]) for r in report["verdicts"]}
    assert v["FP8 hardware"] == ("MISSING", gate)
    assert v["FP8 matmul ceiling"] == ("MISSING", gate)
    assert v["FP8 te"][0] == "MISSING" and gate in v["FP8 te"][1]

    report = _gpu_report("NVIDIA GeForce RTX 4090", [8, 9], _measured(160.0, 320.0))
    text = dg.format_report(report)
    assert "no MFU: 'NVIDIA GeForce RTX 4090' is not in the peak table" in text
    assert "% of" not in next(line for line in text.splitlines() if "bf16 matmul" in line)
    assert "2.00x the bf16 matmul" in text
