"""HellaSwag in a real run (val/hellaswag_acc at its interval) and scripts/evaluate.py
--hellaswag reproducing it from the checkpoint."""
import json
import subprocess
import sys

import pytest
from support.hellaswag_shared import write_hellaswag
from support.runs import ROOT, run_train, tiny_args


@pytest.fixture
def hellaswag_file(tmp_path):
    return write_hellaswag(tmp_path)


def test_a_run_logs_hellaswag_and_evaluate_py_reproduces_it(tmp_path, hellaswag_file):
    out = tmp_path / "run"
    r = run_train(*tiny_args(out, hellaswag_interval=12, hellaswag_path=hellaswag_file))
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    accs = {row["step"]: row["val/hellaswag_acc"] for row in rows if "val/hellaswag_acc" in row}
    assert list(accs) == [12] and accs[12] in (0.0, 0.25, 0.5, 0.75, 1.0)
    assert f"val/hellaswag_acc {accs[12]:.4f}" in r.stdout
    e = subprocess.run([sys.executable, "scripts/evaluate.py", str(out), "--hellaswag",
                        hellaswag_file, "--json"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert e.returncode == 0, e.stderr[-2000:]
    got = json.loads(e.stdout)
    assert got["val/hellaswag_acc"] == accs[12] and got["examples"] == 4 and got["step"] == 12
