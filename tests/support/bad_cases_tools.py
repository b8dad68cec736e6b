"""Bad-input cases: tools. See tests/e2e/test_bad_input.py for how a case is run and judged.

CASES are inputs to train_fp8.py. TOOL_CASES are inputs to the other entry points (the
scripts in scripts/, run_sweep.py, submit_fp8.sh), judged the same way by
tests/e2e/test_scripts.py: exit code 2, exactly one line on stderr holding `expect`, no
traceback. In argv, files and expect, {d} is the case's own empty temporary directory; `files`
maps paths under {d} to str or bytes contents (DIR: a directory); `env` is added to the
environment ({python}: the interpreter running the tests)."""
from dataclasses import dataclass, field
from typing import Union

from support.bad_input_kit import DIR

CASES = [
]

# A finished run's files, as far as the tools read them.
RUN = {"metrics.jsonl": '{"step": 2, "tokens": 64, "train/loss": 5.0, "train/lr": 0.001}\n'
                        '{"step": 2, "tokens": 64, "val/loss": 4.9, "time/wall_s": 3.0}\n',
       "summary.json": '{"status": "completed", "steps": 2, "tokens": 64}\n',
       "config.yaml": "seq_len: 32\npenalty_weight: 0.0\n"}


def run_files(prefix: str, **edits) -> dict:
    return {f"{prefix}/{k}": edits.get(k, v) for k, v in RUN.items()}


@dataclass
class ToolCase:
    id: str
    argv: list                                 # the command, from the repository root
    expect: Union[str, tuple]                  # substring(s) of the one error line
    files: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)


PLOT, COMPARE = ["{python}", "scripts/plot_run.py"], ["{python}", "scripts/compare_runs.py"]
NO_PACKAGES = "{d}/bare-python"   # a python that sees no site-packages (made by the runner)

TOOL_CASES = [
    # plot_run.py -------------------------------------------------------------------------------
    ToolCase("plot-run-dir-missing", PLOT + ["{d}/nope"],
             expect="run directory '{d}/nope' does not exist"),
    ToolCase("plot-run-dir-is-a-file", PLOT + ["{d}/a/config.yaml"], files=run_files("a"),
             expect="'{d}/a/config.yaml' is a file, not a run directory"),
    ToolCase("plot-run-without-metrics-yet", PLOT + ["{d}/a"],
             files={"a/config.yaml": RUN["config.yaml"]},
             expect="no metrics.jsonl in '{d}/a'"),
    ToolCase("plot-metrics-not-utf8", PLOT + ["{d}/a"],
             files=run_files("a", **{"metrics.jsonl": b"\xff\xfe{}\n"}),
             expect="cannot read '{d}/a/metrics.jsonl'"),
    ToolCase("plot-out-is-a-file", PLOT + ["{d}/a", "--out", "{d}/a/summary.json"],
             files=run_files("a"), expect="cannot create '{d}/a/summary.json'"),
    # compare_runs.py ---------------------------------------------------------------------------
    ToolCase("compare-run-dir-missing", COMPARE + ["{d}/a", "{d}/nope", "--no_plot"],
             files=run_files("a"), expect="run directory '{d}/nope' does not exist"),
    ToolCase("compare-not-a-run-dir", COMPARE + ["{d}/a", "{d}/empty", "--no_plot"],
             files=dict(run_files("a"), empty=DIR),
             expect="'{d}/empty' has neither summary.json nor metrics.jsonl: not a run"),
    ToolCase("compare-run-dir-is-a-file", COMPARE + ["{d}/a", "{d}/a/summary.json", "--no_plot"],
             files=run_files("a"), expect="'{d}/a/summary.json' is a file, not a run directory"),
    ToolCase("compare-same-run-twice", COMPARE + ["{d}/a", "{d}/a/", "--no_plot"],
             files=run_files("a"), expect="run directory '{d}/a/' is given twice"),
    ToolCase("compare-metrics-not-utf8", COMPARE + ["{d}/a", "{d}/b", "--no_plot"],
             files=dict(run_files("a"), **{"b/metrics.jsonl": b"\xff\xfe{}\n"}),
             expect="cannot read '{d}/b/metrics.jsonl'"),
    ToolCase("compare-summary-not-json", COMPARE + ["{d}/a", "{d}/b", "--no_plot"],
             files=dict(run_files("a"), **run_files("b", **{"summary.json": '{"steps": '})),
             expect="cannot read '{d}/b/summary.json'"),
    ToolCase("compare-out-is-a-file", COMPARE + ["{d}/a", "--out", "{d}/a/summary.json"],
             files=run_files("a"), expect="cannot write to '{d}/a/summary.json'"),
    ToolCase("compare-out-holds-an-earlier-comparison", COMPARE + ["{d}/a", "--out", "{d}/cmp"],
             files=dict(run_files("a"), **{"cmp/compare.md": "| earlier |\n"}),
             expect="'{d}/cmp' holds an earlier comparison (compare.md); pass --overwrite to "
                    "replace it, or --out another folder"),
    # run_sweep.py ------------------------------------------------------------------------------
    ToolCase("sweep-create-without-wandb",
             ["{python}", "-c", "import runpy, sys; sys.modules['wandb'] = None; "
              "sys.argv = ['run_sweep.py', 'create', 'configs/sweeps/sweep_lambda.yaml']; "
              "runpy.run_path('run_sweep.py', run_name='__main__')"],
             expect="through the wandb package, which is not installed: pip install wandb"),
    ToolCase("sweep-agent-without-wandb",
             ["{python}", "-c", "import runpy, sys; sys.modules['wandb'] = None; "
              "sys.argv = ['run_sweep.py', 'agent', 'e/p/abc123']; "
              "runpy.run_path('run_sweep.py', run_name='__main__')"],
             expect="through the wandb package, which is not installed: pip install wandb"),
    # submit_fp8.sh (no SLURM: it runs here as a plain bash script) ------------------------------
    ToolCase("submit-without-the-packages", ["bash", "submit_fp8.sh", "--max_steps=2"],
             env={"PYTHON": NO_PACKAGES, "GPUS_PER_NODE": "0",
                  "CONFIG": "configs/test_fp8.yaml"},
             expect=(f"error: {NO_PACKAGES} cannot import torch, accelerate", "pip install -e .",
                     "set PYTHON to")),
    ToolCase("submit-python-not-found", ["bash", "submit_fp8.sh"],
             env={"PYTHON": "{d}/no-such-python", "GPUS_PER_NODE": "0",
                  "CONFIG": "configs/test_fp8.yaml"},
             expect="error: PYTHON={d}/no-such-python not found"),
]
