"""In-process tests: The GPU check (scripts/diagnose_gpu.py, fp8train/diagnose) on this CPU
machine, for real, and its GPU report from injected numbers. The whole story, and the tests that
start processes: tests/e2e/test_diagnose_gpu.py."""


import contextlib
import json
import time
import types

import pytest
import torch
from support.fake_te import BLOCK_REASON, install_fake_te

from fp8train.diagnose import attention, cli, environment
from fp8train.diagnose.ceilings import judge_ceilings, measure_ceilings, timing_plan
from fp8train.diagnose.checks import run_check
from fp8train.diagnose.fp8_probes import (FWD_TOL, GRAD_TOL, check_native, check_torchao,
                                          fp8_section, import_error, judge)
from fp8train.diagnose.report import format_report, json_safe
from fp8train.diagnose.verdicts import verdicts

H100 = "NVIDIA H100 80GB HBM3"


CPU = torch.device("cpu")


def test_native_fp8_gemms_run_for_real_and_match_bf16():
    """torch._scaled_mm runs on CPU too: the native check's layouts, scales and tolerance."""
    res = run_check(check_native, CPU)
    assert res["ok"], res
    assert 0.01 < res["fwd_err"] < FWD_TOL and 0.01 < res["grad_err"] < GRAD_TOL


def test_torchao_check_runs_emulated_on_cpu():
    res = run_check(check_torchao, CPU)
    assert res["ok"], res
    assert "Float8Linear" in res["what"] and "emulated" in res["what"]
    assert res["fwd_err"] < FWD_TOL and res["grad_err"] < GRAD_TOL


def test_a_wrong_gemm_or_an_exception_is_a_failed_check_not_a_crash():
    wrong = run_check(lambda: judge({"what": "gemm", "fwd_err": 0.9, "grad_err": 0.05}))
    assert not wrong["ok"] and "fwd_err relative error 0.9 > 0.1" in wrong["error"]
    nan = run_check(lambda: judge({"what": "gemm", "fwd_err": float("nan")}))
    assert not nan["ok"]
    boom = run_check(lambda: 1 / 0)
    assert boom == {"ok": False, "error": "ZeroDivisionError: division by zero"}


def test_size_must_be_a_multiple_of_16(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--size", "1000"])
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
        "ceilings": judge_ceilings(name, measured),
    }
    report["verdicts"] = verdicts(report)
    return report


def _measured(bf16, fp8=None, fp8_skipped=None):
    plan = timing_plan(8192, quick=False)
    m = {"plan": plan, "bf16_matmul": {"ok": True, "tflops": bf16, "ms": 1.7},
         "d2d_copy": {"ok": True, "gbps": 2950.0, "ms": 0.73, "bytes": 1 << 30},
         "h2d_pinned": {"ok": True, "gbps": 53.2, "ms": 5.0, "bytes": 256 << 20}}
    m["fp8_matmul"] = ({"ok": True, "tflops": fp8, "ms": 0.85} if fp8 else
                       {"ok": False, "skipped": fp8_skipped})
    return m


def test_h100_report_prints_the_measured_ceilings_as_percent_of_the_datasheet_peak():
    """Injected numbers (no GPU here): bf16 650 and FP8 1300 TFLOP/s on an H100 SXM, whose
    bf16 dense peak in fp8train/observe/metrics.py is 989.4 TFLOP/s."""
    failed_ao = {"ok": False, "error": "RuntimeError: CUDA error: no kernel image"}
    failed_cudnn = {"ok": False, "error": "RuntimeError: cuDNN attention refused"}
    report = _gpu_report(H100, [9, 0], _measured(650.0, 1300.0), torchao_gemm=failed_ao,
                         cudnn=failed_cudnn)
    text = format_report(report)
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
    text = format_report(report)
    assert f"FP8 ({gate}; imports only)" in text
    assert "250.0 TFLOP/s  80% of the 312 TFLOP/s bf16 dense peak" in text
    v = {r["feature"]: (r["status"], r["reason"]) for r in report["verdicts"]}
    assert v["FP8 hardware"] == ("MISSING", gate)
    assert v["FP8 matmul ceiling"] == ("MISSING", gate)
    assert v["FP8 te"][0] == "MISSING" and gate in v["FP8 te"][1]

    report = _gpu_report("NVIDIA GeForce RTX 4090", [8, 9], _measured(160.0, 320.0))
    text = format_report(report)
    assert "no MFU: 'NVIDIA GeForce RTX 4090' is not in the peak table" in text
    assert "% of" not in next(line for line in text.splitlines() if "bf16 matmul" in line)
    assert "2.00x the bf16 matmul" in text


def test_json_that_cannot_be_written_is_one_error_line_and_exit_2(tmp_path, capsys):
    code = cli.main(["--json", str(tmp_path)])   # a directory: open() fails
    out, err = capsys.readouterr()
    assert code == 2 and "Verdict" in out   # the report is printed before the JSON is written
    assert err.strip().splitlines() == [f"error: cannot write {tmp_path}: Is a directory"]


def test_json_safe_writes_non_finite_numbers_as_strings():
    assert json_safe({"a": float("nan"), "b": (float("inf"), 1.5), "c": [None, "x"]}) == \
        {"a": "nan", "b": ["inf", 1.5], "c": [None, "x"]}


def test_cudnn_version_codes():
    assert environment.cudnn_version(90100) == "9.1.0"
    assert environment.cudnn_version(91002) == "9.10.2"
    assert environment.cudnn_version(8907) == "8.9.7"


def test_no_device_reason_names_the_cuda_build_and_the_driver_error(monkeypatch):
    """A CUDA build of torch on a machine without a driver (mocked: torch.cuda only)."""
    def no_driver():
        raise RuntimeError("Found no NVIDIA driver on your system.\n  Please check that you "
                           "have an NVIDIA GPU and installed a driver")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "init", no_driver)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    dev = environment.device_info()
    assert dev == {"cuda": False, "reason": (
        f"torch {torch.__version__} is built for CUDA 12.8 but sees no GPU (Found no NVIDIA "
        "driver on your system. Please check that you have an NVIDIA GPU and installed a "
        "driver; CUDA_VISIBLE_DEVICES=unset)")}


def _mock_gpu(monkeypatch, name, capability):
    """torch.cuda answering as if `name` were device 0 of 8 (nothing runs on it)."""
    props = types.SimpleNamespace(name=name, major=capability[0], minor=capability[1],
                                  total_memory=80 * 2**30, multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: tuple(capability))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: name)


def test_device_info_of_a_mocked_h100(monkeypatch):
    _mock_gpu(monkeypatch, H100, (9, 0))
    assert environment.device_info() == {
        "cuda": True, "reason": None, "index": 0, "count": 8, "name": H100,
        "capability": [9, 0], "memory_gib": 80.0, "sm_count": 132}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GEMMs must fail for want of CUDA")
def test_fp8_gemm_that_raises_is_a_failed_check_and_the_others_still_run(monkeypatch):
    """An FP8-capable GPU as far as torch.cuda's queries go (mocked), but every tensor moved to
    it fails: each importable backend gets a FAILED verdict with the library's error, none
    crashes the check; TE (not installed) stays MISSING."""
    _mock_gpu(monkeypatch, H100, (9, 0))
    dev = environment.device_info()
    fp8 = fp8_section(dev)
    assert fp8["gate"] is None
    backends = fp8["backends"]
    assert backends["te"]["imports"] is False and backends["te"]["gemm"] is None
    for name in ("torchao", "native"):
        gemm = backends[name]["gemm"]
        assert gemm["ok"] is False and gemm["error"] and "\n" not in gemm["error"], gemm
    report = {"device": dev, "fp8": fp8, "versions": {"nccl_available": False, "nccl": None,
                                                       "torch": torch.__version__}}
    status = {v["feature"]: v["status"] for v in verdicts(report)}
    assert status["FP8 hardware"] == "OK" and status["FP8 te"] == "MISSING"
    assert status["FP8 torchao"] == status["FP8 native"] == "FAILED"


def test_each_te_recipe_gets_its_own_verdict_with_tes_reason(monkeypatch):
    """An H100 (torch.cuda's queries mocked) with a Transformer Engine that imports (its
    transformer_engine.pytorch stood in for, TE's real recipe module from its wheel, as in
    tests/unit/test_te_recipes.py) whose block-scaled GEMM needs a newer CUDA: block is
    MISSING with TE's own reason and gets no GEMM check; delayed and current each get theirs
    (check_te stood in for: it runs TE's CUDA kernels)."""
    from fp8train.diagnose import fp8_probes
    from fp8train.diagnose.report import format_fp8
    te = install_fake_te(monkeypatch)
    _mock_gpu(monkeypatch, H100, (9, 0))
    te.block = (False, BLOCK_REASON)
    checked = []

    def check_te(device, recipe="delayed"):
        checked.append(recipe)
        return {"what": f"te.Linear forward + backward, {recipe}", "fwd_err": 0.04,
                "grad_err": 0.06}
    monkeypatch.setattr(fp8_probes, "check_te", check_te)
    for name in ("check_torchao", "check_native"):   # not what this test is about
        monkeypatch.setattr(fp8_probes, name, lambda device: {"what": "x", "fwd_err": 0.0,
                                                                "grad_err": 0.0})
    dev = environment.device_info()
    fp8 = fp8_section(dev)
    assert checked == ["delayed", "current"]
    te_entry = fp8["backends"]["te"]
    assert te_entry["version"] == "transformer_engine 2.20.2"
    assert te_entry["gemm"] == te_entry["recipes"]["delayed"]["gemm"]
    assert te_entry["recipes"]["block"] == {
        "available": False, "gemm": None,
        "reason": f"{BLOCK_REASON} (Transformer Engine's is_fp8_block_scaling_available, for "
                  "Float8BlockScaling)"}
    report = {"device": dev, "fp8": fp8, "versions": {"nccl_available": False, "nccl": None,
                                                       "torch": torch.__version__}}
    v = {r["feature"]: (r["status"], r["reason"]) for r in verdicts(report)}
    assert v["FP8 te"][0] == v["FP8 te current"][0] == "OK"
    assert "te.Linear forward + backward, current" in v["FP8 te current"][1]
    assert v["FP8 te block"] == ("MISSING", te_entry["recipes"]["block"]["reason"])
    lines = format_fp8(report).splitlines()
    assert lines[1].startswith("  te") and "per recipe (fp8_recipe):" in lines[1]
    assert lines[2].split()[0] == "delayed" and lines[2].endswith(": OK")
    assert lines[4].split()[0] == "block" and f"not available here: {BLOCK_REASON}" in lines[4]
    json.dumps(report)   # what --json writes


def test_fp8_gate_of_a_mocked_a100_runs_no_gemm(monkeypatch):
    _mock_gpu(monkeypatch, "NVIDIA A100-SXM4-80GB", (8, 0))
    fp8 = fp8_section(environment.device_info())
    assert "FP8 needs compute capability 8.9" in fp8["gate"] and "is 8.0" in fp8["gate"]
    assert all(b["gemm"] is None for b in fp8["backends"].values())


def test_import_errors_say_how_to_install_or_what_broke():
    missing = ModuleNotFoundError("No module named 'torchao'", name="torchao.float8")
    assert import_error(missing) == "torchao is not installed (pip install torchao)"
    te = ModuleNotFoundError("No module named 'transformer_engine'", name="transformer_engine")
    assert "transformer_engine is not installed (pip install --no-build-isolation" in \
        import_error(te)
    broken = OSError("libcudart.so.12: cannot open\n shared object file")
    assert import_error(broken) == ("import failed (OSError: libcudart.so.12: cannot open "
                                    "shared object file)")


def test_attention_kernels_run_or_fail_one_by_one_on_cpu(monkeypatch):
    """The real SDPA checks on CPU: torch has a CPU flash kernel, not the memory-efficient or
    cuDNN ones, so those two fail as entries of their own. A kernel this torch does not name
    at all is MISSING, not FAILED."""
    res = attention.check_attention(CPU)
    assert set(res) == {"flash", "efficient", "cudnn"}
    assert res["flash"]["ok"] and res["flash"]["rel_err"] < attention.ATTN_TOL
    for key in ("efficient", "cudnn"):
        assert res[key]["ok"] is False and res[key]["error"] and "missing" not in res[key]
    monkeypatch.setattr(attention, "ATTENTION", (("future", "FUTURE_ATTENTION"),))
    assert attention.check_attention(CPU) == {"future": {
        "ok": False, "missing": True,
        "error": f"torch {torch.__version__} has no SDPBackend.FUTURE_ATTENTION"}}


class _HostEvent:
    """torch.cuda.Event on the host clock (CUDA events mocked)."""

    def __init__(self, enable_timing=False):
        self.t = None

    def record(self):
        self.t = time.perf_counter()

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


@pytest.mark.skipif(torch.cuda.is_available(), reason="mocks CUDA events on a CPU machine")
def test_ceilings_measured_on_cpu_with_cuda_events_mocked(monkeypatch):
    """The real matmuls (bf16 torch.mm, FP8 torch._scaled_mm) and copies on CPU, timed with
    mocked CUDA events: the harness and its arithmetic, not a speed. Pinned memory needs a
    GPU, so that entry fails on its own; an FP8 gate skips the FP8 matmul and says why."""
    monkeypatch.setattr(torch.cuda, "Event", _HostEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    plan = dict(timing_plan(64, quick=True), copy_bytes=1 << 20, h2d_bytes=1 << 20,
                warmup_s=0.0)
    m = measure_ceilings(CPU, plan, None)
    for key in ("bf16_matmul", "fp8_matmul"):
        assert m[key]["ok"] and m[key]["tflops"] > 0 and m[key]["ms"] > 0, m[key]
        assert m[key]["tflops"] == pytest.approx(2 * 64**3 / (m[key]["ms"] / 1e3) / 1e12)
    assert m["d2d_copy"]["ok"] and m["d2d_copy"]["bytes"] == 1 << 20
    assert m["d2d_copy"]["gbps"] == pytest.approx(2 * (1 << 20) / m["d2d_copy"]["ms"] / 1e6)
    assert m["h2d_pinned"]["ok"] is False and m["h2d_pinned"]["error"]
    gated = measure_ceilings(CPU, plan, "FP8 needs compute capability 8.9")
    assert gated["fp8_matmul"] == {"ok": False, "skipped": "FP8 needs compute capability 8.9"}
    judged = judge_ceilings("cpu", m)
    assert judged["peak_bf16_tflops"] is None and "pct_of_peak" not in judged["bf16_matmul"]
    assert judged["fp8_matmul"]["speedup_vs_bf16"] == pytest.approx(
        m["fp8_matmul"]["tflops"] / m["bf16_matmul"]["tflops"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU checks must fail for want of CUDA")
def test_main_on_a_mocked_gpu_where_nothing_runs_reports_every_check_failed(monkeypatch, capsys,
                                                                            tmp_path):
    """main()'s GPU path end to end: torch.cuda's queries say H100 (mocked), but no kernel can
    run here. Every section is printed, each check is a FAILED verdict of its own (TE, not
    installed, is MISSING), and the command still exits 0 and writes its JSON."""
    _mock_gpu(monkeypatch, H100, (9, 0))
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    out = tmp_path / "gpu.json"
    assert cli.main(["--quick", "--size", "256", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for head in ("Environment", "FP8 (needs compute capability >= 8.9; this GPU has 9.0)",
                 "Attention (F.scaled_dot_product_attention", "Ceilings (matmuls 256^3, median "
                 "of 10", "MFU against the H100 SXM bf16 dense peak", "Verdict"):
        assert head in text, head
    report = json.loads(out.read_text())
    status = {v["feature"]: v["status"] for v in report["verdicts"]}
    assert status.pop("CUDA device") == status.pop("FP8 hardware") == "OK"
    assert status.pop("FP8 te") == status.pop("FP8 te current") == \
        status.pop("FP8 te block") == "MISSING"   # not installed: each TE recipe says so
    assert status.pop("NCCL") in ("OK", "MISSING")
    assert set(status.values()) == {"FAILED"}, status
    assert report["ceilings"]["plan"] == timing_plan(256, quick=True)
