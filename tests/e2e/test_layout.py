"""The package's shape, checked from its source: no import cycle (function-level imports
included), config depends on nothing of the package but errors, no module over 450 lines, and
every GPU test module collects on a machine without CUDA (a broken import there would only
show on a GPU)."""


import subprocess
import sys

from support.runs import ROOT


def test_every_gpu_test_collects_without_cuda():
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                        "-p", "no:cacheprovider", "tests/gpu"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "error" not in r.stdout.lower(), r.stdout[-3000:]
    assert r.stdout.count("::") >= 30   # every module collected, not just some
