"""The GPU suite's own rules, checked on CPU: its quick tier holds the tests docs/gpu.md names,
and a GPU test without its corpus fails instead of skipping."""


import subprocess
import sys

from support.runs import ROOT

QUICK = {
    "tests/gpu/test_gpu_fp8.py::test_fp8_backend_tracks_bf16_on_gpu[native-None]",
    "tests/gpu/test_gpu_fp8.py::test_fp8_backend_tracks_bf16_on_gpu[torchao-None]",
    "tests/gpu/test_gpu_fp8.py::test_native_scaled_mm_matches_its_emulation_on_gpu",
    "tests/gpu/test_gpu_fp8.py::test_fp8_backend_trains_under_compile[torchao]",
    "tests/gpu/test_gpu_train.py::test_resume_on_gpu_continues_the_step_count",
    "tests/gpu/test_gpu_speed.py::test_every_block_runs_compiled_from_one_graph_on_gpu[bf16]",
    "tests/gpu/test_gpu_speed.py::test_every_block_runs_compiled_from_one_graph_on_gpu[torchao]",
    "tests/gpu/test_gpu_speed.py::test_muon_on_gpu_is_one_batched_compiled_update_with_few_kernels",
}


def test_the_quick_tier_is_the_documented_one():
    """`pytest -m gpu_quick tests/gpu` selects exactly these (collected here, skipped without
    CUDA), and docs/gpu.md names each of them."""
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-m",
                        "gpu_quick", "-p", "no:cacheprovider", "tests/gpu"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    collected = {line for line in r.stdout.splitlines() if "::" in line}
    assert collected == QUICK
    doc = (ROOT / "docs" / "gpu.md").read_text()
    for test in QUICK:
        name = test.split("::")[1].split("[")[0]
        assert name in doc, name
