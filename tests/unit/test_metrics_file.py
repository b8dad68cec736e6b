"""metrics.jsonl read back (fp8train/observe/metrics_file.py): the one reader, for the tools,
the sweep runner, evaluate.py and the tests."""
import json

import pytest

from fp8train.observe.metrics_file import read_rows


def test_rows_come_back_in_order_and_a_torn_last_line_is_passed_over_quietly(tmp_path):
    rows = [{"step": 1, "train/loss": 5.0}, {"step": 2, "val/loss": 4.5},
            {"step": 1, "train/loss": 4.9}]
    text = "\n".join(json.dumps(r) for r in rows)
    (tmp_path / "metrics.jsonl").write_text(text + "\n[1, 2]\n\n" + text + '\n{"step": 3, "tr')
    skipped = []
    assert read_rows(tmp_path, skipped=skipped) == rows + rows   # a directory or the file
    assert skipped == [4]              # the list in the middle; the torn last line is expected
    assert read_rows(tmp_path / "metrics.jsonl") == rows + rows
    with pytest.raises(ValueError, match=r"metrics.jsonl line 4 is not a metrics row"):
        read_rows(tmp_path, strict=True)
    with pytest.raises(OSError):
        read_rows(tmp_path / "elsewhere")
