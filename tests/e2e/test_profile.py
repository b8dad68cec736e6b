"""profile_steps: a real run records the steps asked for with torch.profiler into
<output_dir>/profile/, says where once, and keeps those steps out of its throughput.
(The CUDA memory snapshot needs a GPU: tests/gpu/test_gpu_train.py; what the profiler asks of
torch for it is checked here, with torch's CUDA memory functions mocked.)"""


import json

from support.runs import run_train, tiny_args

from fp8train.observe.metrics_file import read_rows


def test_profiled_steps_leave_a_trace_of_their_ops_and_stay_out_of_the_throughput(tmp_path):
    out = tmp_path / "run"
    r = run_train(*tiny_args(out, max_steps=8, log_interval=2, eval_interval=8,
                             checkpoint_interval=8, eval_samples=0), "--profile_steps=[3,4]")
    assert r.returncode == 0, r.stderr[-3000:]
    said = [line for line in r.stdout.splitlines() if line.startswith("profile of steps")]
    assert said == [f"profile of steps 3-4 written to {out}/profile/: open the trace in "
                    "https://ui.perfetto.dev (or chrome://tracing); those steps' tokens/s are "
                    "left out of the run's throughput"], r.stdout
    assert [p.name for p in (out / "profile").iterdir()] == ["trace_steps_3-4_rank0.json"]
    events = json.loads((out / "profile" / "trace_steps_3-4_rank0.json").read_text())
    events = [e for e in events["traceEvents"] if e.get("ph") == "X"]
    steps = {e["name"]: e for e in events if e["name"].startswith("ProfilerStep#")}
    assert sorted(steps) == ["ProfilerStep#3", "ProfilerStep#4"]
    for step in steps.values():   # the training step's work, inside the step's range
        inside = {e["name"] for e in events
                  if step["ts"] <= e["ts"] and e["ts"] + e["dur"] <= step["ts"] + step["dur"]}
        assert {"aten::mm", "aten::scaled_dot_product_attention"} <= inside or \
            {"aten::mm", "aten::_scaled_dot_product_flash_attention_for_cpu"} <= inside, inside
        assert any(name.startswith("Optimizer.step") for name in inside), inside
    rows = read_rows(out, strict=True)
    marked = {row["step"]: row.get("train/profiled") for row in rows if "train/loss" in row}
    assert marked == {2: None, 4: 1, 6: None, 8: None}
    # The steady state: steps 5-8 only (steps 1-2 are the warm-up interval, 3-4 profiled).
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steady_state_tokens"] == 4 * 8 * 2 * 64
