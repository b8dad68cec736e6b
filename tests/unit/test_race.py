"""The demo-against-nanoGPT race (fp8train/analysis/race.py): the lines it reads from each
tool's output, the point it compares at, the report, and a folder that is not nanoGPT.
(The race itself runs nanoGPT, which is never part of this project:
docs/records/benchmarks.md.)"""
import pytest

from fp8train.errors import BadInput
from fp8train.analysis.race import NANOGPT_EVAL, OURS_EVAL, at_time, prepare_nanogpt, report


def test_the_evaluation_lines_of_both_tools_are_read():
    m = NANOGPT_EVAL.search("step 2000: train loss 1.7648, val loss 1.8857")
    assert (m.group(1), m.group(m.lastindex)) == ("2000", "1.8857")
    m = OURS_EVAL.search("[12:00:01] eval step 1,250: val/loss 1.7804, val/ppl 5.93")
    assert (m.group(1), m.group(m.lastindex)) == ("1,250", "1.7804")


def test_the_comparison_takes_the_last_evaluation_at_or_before_the_time():
    points = [(43.5, 250, 2.05), (86.2, 500, 1.78)]
    assert at_time(points, 115.0) == (86.2, 500, 1.78)
    assert at_time(points, 50.0) == (43.5, 250, 2.05)
    assert at_time(points, 10.0) is None


def test_the_report_says_the_verdict():
    r = {"window": 64, "whole_val": {"nanogpt": 1.8982, "fp8train": 1.7704},
         "nanogpt": {"points": [(114.0, 2000, 1.8857)]},
         "fp8train": {"points": [(86.2, 500, 1.7804)]},
         "verdict": {"nanogpt_seconds": 115.0, "nanogpt_val_loss": 1.8857,
                     "fp8train_at_that_time": (86.2, 500, 1.7804), "fp8train_seconds": 87.0,
                     "fp8train_val_loss": 1.7804, "no_worse_at_equal_time": True}}
    text = report(r)
    assert "| val loss, every 64-byte window of the split | 1.8982 | 1.7704 |" in text
    assert "1.7804 (step 500, 86 s)" in text and text.endswith(
        "fp8train no worse than nanoGPT at equal wall time.\n")


def test_a_folder_that_is_not_nanogpt_is_one_line(tmp_path):
    with pytest.raises(BadInput, match="is not a nanoGPT checkout"):
        prepare_nanogpt(str(tmp_path), str(tmp_path / "tinyshakespeare.txt"), print)
