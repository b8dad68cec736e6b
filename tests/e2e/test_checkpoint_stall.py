"""What a background checkpoint (checkpoint_async) costs the training thread while it is written:
the write must not hold the GIL (safetensors 0.8+, torch.save's storage writes), each background
save measures the longest stall it caused (`checkpoint/stall_max_s`) and the steps trained
meanwhile (`checkpoint/overlap_steps`), and a safetensors that would hold the GIL turns
checkpoint_async off at start with one warning. Measured numbers: fp8train/checkpoint/write_stall.py."""


import re

import pytest

from fp8train.observe.metrics_file import read_rows


pytestmark = pytest.mark.usefixtures("no_accelerate_state_left")


def test_a_real_run_logs_the_stall_of_each_background_save(tmp_path):
    """train_fp8.py with checkpoint_async: the periodic checkpoint's row in metrics.jsonl has
    checkpoint/stall_max_s and checkpoint/overlap_steps, and its console line says them; the
    final checkpoint, written synchronously, has neither."""

    from support.runs import run_train, tiny_args
    out = tmp_path / "run"
    r = run_train(*tiny_args(out, max_steps=8, log_interval=2, checkpoint_interval=4,
                             eval_interval=8, eval_samples=0, checkpoint_async="true"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert not [line for line in r.stderr.splitlines() if line.startswith("WARNING")], r.stderr
    rows = read_rows(out, strict=True)
    saves = {row["step"]: row for row in rows if "checkpoint/save_s" in row}
    assert sorted(saves) == [4, 8]
    bg = saves[4]
    assert isinstance(bg["checkpoint/stall_max_s"], float) and \
        0 <= bg["checkpoint/stall_max_s"] < 1.0, bg
    assert isinstance(bg["checkpoint/overlap_steps"], int) and \
        0 <= bg["checkpoint/overlap_steps"] <= 4, bg
    assert "checkpoint/stall_max_s" not in saves[8] and "checkpoint/overlap_steps" not in saves[8]
    line = [x for x in r.stdout.splitlines() if "saved in the background" in x]
    assert len(line) == 1 and re.fullmatch(
        r"checkpoint step 4 saved in the background \(\d+\.\d s; training waited \d+\.\d s, "
        r"then trained (\d+) steps? during the write, stalled (\d+\.\d\d) s at most\)",
        line[0]), r.stdout
