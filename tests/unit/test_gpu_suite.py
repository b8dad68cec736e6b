"""The GPU suite's own rules, checked on CPU: its quick tier holds the tests docs/gpu.md names,
and a GPU test without its corpus fails instead of skipping."""


import pytest
from support import runs


def test_a_gpu_test_without_its_corpus_fails_and_says_where_it_looked(monkeypatch, tmp_path):
    monkeypatch.setattr(runs, "DATA_DIR", str(tmp_path))
    with pytest.raises(pytest.fail.Exception, match="tinyshakespeare.txt not found .*looked in"):
        runs.require_corpus()
    (tmp_path / "tinyshakespeare.txt").write_text("text")
    assert runs.require_corpus() == str(tmp_path)
