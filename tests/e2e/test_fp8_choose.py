"""fp8_backend: auto and fp8_recipe: auto through train_fp8.py on a CPU: nothing is timed (FP8
is emulated), the default is taken and said, recorded in config.yaml and summary.json, and a
resumed run keeps its checkpoint's choice; auto with a recipe it cannot honour exits 2 in one
line. The choosing itself (injected timings): tests/unit/test_fp8_choose.py."""
import json

import yaml
from support.runs import run_train, tiny_args


def test_auto_on_a_cpu_takes_the_default_says_why_and_the_resume_keeps_it(tmp_path):
    out = tmp_path / "run"
    r = run_train(*tiny_args(out, use_fp8="true", fp8_backend="auto", max_steps=6))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "fp8 auto: nothing timed on cpu (FP8 is emulated there, slower whatever the " \
        "recipe): native delayed, the default" in r.stdout
    saved = yaml.safe_load(open(out / "config.yaml"))
    assert (saved["fp8_backend"], saved["fp8_recipe"]) == ("auto", "auto")
    derived = saved["derived"]
    assert (derived["fp8_backend"], derived["fp8_recipe"]) == ("native", "delayed")
    assert derived["fp8_choice"]["chosen"] == "native delayed"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["fp8_choice"]["chosen"] == "native delayed"
    assert "summary: FP8 recipe native delayed (fp8 auto: nothing timed on cpu" in r.stdout
    r = run_train(*tiny_args(out, use_fp8="true", fp8_backend="auto"), "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "fp8 auto: native delayed, as the resumed checkpoint's run chose" in r.stdout


def test_fp8_backend_auto_with_a_named_recipe_exits_2_in_one_line(tmp_path):
    r = run_train(*tiny_args(tmp_path / "run", use_fp8="true", fp8_backend="auto",
                             fp8_recipe="current"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert "key 'fp8_recipe' ('current') applies only with a named fp8_backend (auto chooses " \
        "the recipe too), but fp8_backend is 'auto'" in line


def test_evaluate_py_evaluates_in_fp8_with_the_recipe_auto_chose(tmp_path):
    """fp8_eval with fp8_backend auto: scripts/evaluate.py evaluates the checkpoint in FP8 and
    reproduces the logged val/loss, without the warning that FP8 cannot run. (On a CPU the
    choice is the default; that the derived choice replaces auto is tested in
    tests/unit/test_fp8_choose.py.)"""
    import subprocess
    import sys

    from support.runs import ROOT
    out = tmp_path / "run"
    r = run_train(*tiny_args(out, use_fp8="true", fp8_backend="auto", fp8_eval="true",
                             max_steps=6))
    assert r.returncode == 0, r.stderr[-3000:]
    logged = [json.loads(x) for x in open(out / "metrics.jsonl") if "val/loss" in x][-1]
    e = subprocess.run([sys.executable, "scripts/evaluate.py", str(out), "--json"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert e.returncode == 0, e.stderr[-2000:]
    assert "cannot run here" not in e.stderr
    got = json.loads(e.stdout)
    assert got["val/loss"] == logged["val/loss"] and got["step"] == 6, (got, logged)
