"""W&B sweeps (run_sweep.py, fp8train/sweep/): sweep-file validation, the local runner end to
end (real train_fp8.py trials), seeded random sampling, the trial command line (built by
`local` as wandb's own agent code builds it, the launcher chosen by FP8TRAIN_LAUNCHER), and
`agent`: W&B's own agent, run for real, starting real trial processes. The only thing stubbed
anywhere is the W&B server, which cannot be reached here: FakeServer answers the GraphQL
requests of wandb's public API and agent (wandb.Api is pointed at it), and wandb.sweep is
replaced for `create`. W&B itself runs with WANDB_MODE=offline."""


import csv
import json
import math
import os
import shlex
import subprocess
import sys

import pytest
import yaml
from support.runs import DATA_DIR, ROOT, rows
from support.sweep_shared import COMMAND, GRID, RUN_ID, SWEEP_ID, sweep_cfg, write

from fp8train import sweep as S


def run_sweep(*args, env=None, timeout=300):
    full_env = dict(os.environ, FP8TRAIN_DATA_DIR=DATA_DIR, PYTHONUNBUFFERED="1")
    # `${interpreter}` is `python`, as with `wandb agent`: make it this test's interpreter
    full_env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + full_env.get("PATH", "")
    full_env.update(env or {})
    return subprocess.run([sys.executable, "run_sweep.py", *map(str, args)], cwd=ROOT,
                          env=full_env, capture_output=True, text=True, timeout=timeout)


def test_bad_sweeps_through_the_real_entry_point(tmp_path):
    """Real processes: exit 2, one line naming the file and key, no traceback."""
    typo = write(tmp_path, sweep_cfg({"penalty_wieght": {"values": [0.0]}}), "typo.yaml")
    bayes = write(tmp_path, sweep_cfg({"learning_rate": {"distribution": "log_uniform_values",
                                                         "min": 1e-4, "max": 1e-2}},
                                      method="bayes"), "bayes.yaml")
    notyaml = write(tmp_path, "method: grid\nparameters: [unclosed\n", "broken.yaml")
    macro = write(tmp_path, dict(sweep_cfg({"seed": {"values": [1]}}),
                                 command=COMMAND + ["${args_jsn}"]), "macro.yaml")
    cases = [(["validate", typo], f"{typo}: parameters.penalty_wieght: not a config key (did "
              "you mean penalty_weight?)"),
             (["local", bayes, "--max-trials", "2"],
              f"{bayes}: method: bayes needs the W&B server: use create + agent"),
             (["create", notyaml], f"{notyaml}: not valid YAML"),
             (["local", macro, "--max-trials", "1"],
              f"{macro}: command[6]: unknown macro ${{args_jsn}} (wandb agent would drop it)"),
             (["local", str(tmp_path / "nope.yaml")], "sweep file"),
             (["local", typo.replace("typo", "nope")], "not found")]
    for argv, expected in cases:
        r = run_sweep(*argv)
        assert r.returncode == 2, (argv, r.stdout, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and expected in lines[0], r.stderr
        assert "Traceback" not in r.stderr


def test_help_does_not_import_torch_or_wandb():
    code = ("import runpy, sys; sys.argv = ['run_sweep.py', '--help']\n"
            "try:\n    runpy.run_path('run_sweep.py', run_name='__main__')\n"
            "except SystemExit as e:\n    rc = e.code\n"
            "print('LOADED', 'torch' in sys.modules, 'wandb' in sys.modules, rc)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert "LOADED False False 0" in r.stdout, r.stderr
    for cmd in ("create", "agent", "local"):
        assert cmd in r.stdout


SHORT = ["--max_steps=6", "--eval_interval=6", "--log_interval=3", "--n_layer=2", "--seq_len=64",
         "--eval_sequences=16", "--batch_size=8", "--warmup_steps=2", "--use_fp8=false",
         "--use_wandb=false"]


def metrics_rows(run_dir):
    return rows(run_dir)


def test_local_grid_runs_real_trials_and_tabulates_them(tmp_path):
    out = tmp_path / "sweep"
    r = run_sweep("local", "configs/sweeps/sweep_lambda.yaml", "--max-trials", "3",
                  "--output_dir", out, *SHORT[:5], "--", *SHORT[5:])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "grid, 3 of 5 trials" in r.stdout
    for i in (1, 2, 3):
        assert f"[trial {i}/3] penalty_weight=" in r.stdout
    trials = sorted(p for p in os.listdir(out) if p.startswith("trial_"))
    assert trials == ["trial_001", "trial_002", "trial_003"]

    with open(out / "results.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [row["trial"] for row in rows] == trials
    assert [float(row["penalty_weight"]) for row in rows] == GRID[:3]
    for row in rows:
        run_dir = out / row["run_dir"]
        log = metrics_rows(run_dir)
        val = [x["val/loss"] for x in log if "val/loss" in x]
        tps = sorted(x["train/tokens_per_sec"] for x in log if "train/tokens_per_sec" in x)
        assert val and math.isfinite(float(row["val_loss"]))
        assert float(row["val_loss"]) == val[-1]
        assert float(row["tokens_per_sec"]) == pytest.approx(
            (tps[(len(tps) - 1) // 2] + tps[len(tps) // 2]) / 2, abs=0.06)
        assert row["exit_code"] == "0"
        cfg = yaml.safe_load(open(run_dir / "config.yaml"))
        # the trial got its parameters, the fixed ones and the overrides from its command line
        assert cfg["penalty_weight"] == float(row["penalty_weight"])
        assert cfg["penalty_type"] == "z_loss" and cfg["max_steps"] == 6
        assert cfg["output_dir"] == str(run_dir)
    best = min(rows, key=lambda row: float(row["val_loss"]))
    assert [row["best"] for row in rows].count("1") == 1 and best["best"] == "1"
    md = (out / "results.md").read_text()
    assert md.count("**best**") == 1
    best_line = next(line for line in md.splitlines() if "**best**" in line)
    assert best["run_dir"] in best_line
    # a second run into the same directory is refused instead of mixing two sweeps
    again = run_sweep("local", "configs/sweeps/sweep_lambda.yaml", "--max-trials", "1",
                      "--output_dir", out, *SHORT)
    assert again.returncode == 2 and "already holds a sweep's trials" in again.stderr


def test_local_failed_trial_exits_1_after_writing_the_table(tmp_path):
    """A real trial that fails at run time (no corpus in its data_dir, downloads off)."""
    empty = tmp_path / "no_data"
    empty.mkdir()
    path = write(tmp_path, sweep_cfg({"seed": {"values": [1]}}))
    out = tmp_path / "sweep"
    r = run_sweep("local", path, "--output_dir", out, *SHORT, f"--data_dir={empty}",
                  env={"FP8TRAIN_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    assert "[trial 1/1] FAILED (exit code" in r.stdout and "1 of 1 trials failed" in r.stdout
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert len(rows) == 1 and rows[0]["exit_code"] != "0" and rows[0]["best"] == "0"
    assert "**best**" not in (out / "results.md").read_text()


@pytest.mark.skipif(not os.path.exists("/usr/bin/env"), reason="needs /usr/bin/env -S")
def test_env_splits_the_launcher_into_its_words(tmp_path):
    """What the trial's process really runs: /usr/bin/env -S<launcher> splits the launcher as
    a shell would, so quoted words (a path with a space, a quote, a $) stay whole."""
    folder = tmp_path / "a dir"
    folder.mkdir()
    script = folder / "show.py"
    script.write_text("import json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    launcher = [sys.executable, str(script), "it's $HOME ${HOME} #not a comment"]
    env = dict(os.environ, **S.launcher_env(launcher))
    command = S.build_command(COMMAND, "train_fp8.py", {"seed": 1, "use_wandb": False},
                              environ=env)
    r = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == [launcher[2], "train_fp8.py", "--config",
                                    "configs/test_fp8.yaml", "--seed=1", "--use_wandb=False"]


def test_agent_cli_options_choose_the_launcher(tmp_path):
    import argparse
    ns = argparse.Namespace(accelerate_config="accelerate_configs/h200.yaml", num_processes=None)
    assert S.cli._launcher(ns) == ["accelerate", "launch", "--config_file",
                                   os.path.abspath("accelerate_configs/h200.yaml")]
    ns = argparse.Namespace(accelerate_config=None, num_processes=4)
    assert S.cli._launcher(ns) == ["accelerate", "launch", "--num_processes", "4"]
    ns = argparse.Namespace(accelerate_config=None, num_processes=None)
    assert S.cli._launcher(ns) == ["python"]
    with pytest.raises(S.SweepError, match="--accelerate_config: file 'nope.yaml' not found"):
        S.cli._launcher(argparse.Namespace(accelerate_config="nope.yaml", num_processes=None))
    r = run_sweep("agent", "x/y/z", "--accelerate_config", "a.yaml", "--num_processes", "2")
    assert r.returncode == 2 and "not allowed with argument" in r.stderr


def test_trial_process_is_stopped_when_the_agent_stops_it(tmp_path):
    """Ctrl-C (or any interruption) of the waiting trial: the process group gets SIGTERM
    before the interruption propagates."""
    import threading
    import time

    marker = tmp_path / "terminated"
    script = ("import signal, sys, time\n"
              f"signal.signal(signal.SIGTERM, lambda *a: (open({str(marker)!r}, 'w').close(), "
              "sys.exit(3)))\n"
              "print('ready', flush=True)\n"
              "time.sleep(60)\n")
    box = {}

    def target():
        try:
            S.run_command([sys.executable, "-c", script], env=dict(os.environ), cwd=str(ROOT),
                          grace=10)
        except BaseException as e:  # noqa: B036 - what an asynchronous interruption injects
            box["exc"] = e

    t = threading.Thread(target=target)
    t.start()
    time.sleep(1.5)
    from wandb.agents.pyagent import _terminate_thread
    _terminate_thread(t)  # an asynchronous exception in the waiting thread
    t.join(timeout=20)
    assert not t.is_alive() and "exc" in box and marker.exists()


class FakeServer:
    """The W&B server, the one thing stubbed: it answers the GraphQL requests of wandb's public
    API and of wandb's agent. The sweep (its config as YAML), agent registration, and
    heartbeats, which hand out `runs` [(run_id, {param: value})] one at a time while no run is
    running, send a `stop` once for each run in `stop` that the agent reports running, and
    `exit` once every run has been handed out."""

    def __init__(self, config, runs, stop=()):
        self.config_yaml = yaml.safe_dump(config)
        self.runs, self.stop = list(runs), set(stop)
        self.requests = []

    def execute_graphql(self, query, variables=None, **kw):
        variables = dict(variables or {})
        if "createAgent" in query:
            self.requests.append(("createAgent", variables))
            return {"createAgent": {"agent": {"id": "agent-1"}}}
        if "agentHeartbeat" in query:
            running = json.loads(variables["runState"])
            self.requests.append(("heartbeat", running))
            commands = [{"type": "stop", "run_id": r} for r in running if r in self.stop]
            self.stop -= set(running)
            if not running:
                if self.runs:
                    run_id, params = self.runs.pop(0)
                    commands.append({"type": "run", "run_id": run_id, "program": "train_fp8.py",
                                     "args": {k: {"value": v} for k, v in params.items()}})
                else:
                    commands.append({"type": "exit"})
            return {"agentHeartbeat": {"agent": {"id": "agent-1"},
                                       "commands": json.dumps(commands)}}
        assert "sweep" in query, query
        self.requests.append(("sweep", variables))
        return {"project": {"sweep": {"id": "sweep-1", "name": SWEEP_ID, "state": "RUNNING",
                                      "config": self.config_yaml, "runs": {"edges": []}}}}


class FakeApi:
    """What wandb.Api() gives back here: the client's settings and its GraphQL connection,
    which is the FakeServer; `sweep()` is wandb's own public Sweep object on it."""

    def __init__(self, server, overrides=None, **kw):
        self.settings = {"entity": "e", "project": "p", **(overrides or {})}
        self._service_api = server

    def sweep(self, path):
        from wandb.apis.public import Sweep
        parts = [self.settings["entity"], self.settings["project"]] + path.split("/")
        return Sweep(self._service_api, *parts[-3:])


def serve(config, runs, stop=()):
    """Point wandb at a FakeServer (for the rest of this process)."""
    import wandb
    server = FakeServer(config, runs, stop)
    wandb.Api = lambda *a, **kw: FakeApi(server, **kw)
    return server


# One trial's processes, for the agent's tests: the "launcher" records its command line and
# environment, then exits with its --seed (0 or < 100), or (--seed >= 100) runs until stopped,
# with a second process in its group (as a second rank), each noting the SIGTERM it gets.
TRIAL = r'''
import json, os, signal, subprocess, sys, time
log = os.environ["FAKE_TRIAL_LOG"]
def note(**kw):
    with open(log, "a") as fh:
        fh.write(json.dumps(kw) + "\n")
argv = sys.argv[1:]
note(event="start", argv=argv, cwd=os.getcwd(),
     env={k: v for k, v in os.environ.items() if k.startswith(("WANDB_", "FP8TRAIN_"))})
seed = next(int(a.split("=", 1)[1]) for a in argv if a.startswith("--seed="))
if seed < 100:
    sys.exit(seed)
RANK = ("import json, signal, sys, time\n"
        "def stop(*a):\n"
        "    with open(sys.argv[1], 'a') as fh:\n"
        "        fh.write(json.dumps({'event': 'stopped', 'who': 'rank'}) + '\\n')\n"
        "    sys.exit(3)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "open(sys.argv[1], 'a').write(json.dumps({'event': 'ready', 'who': 'rank'}) + '\\n')\n"
        "time.sleep(120)\n")
rank = subprocess.Popen([sys.executable, "-c", RANK, log])
def stop(*a):
    note(event="stopped", who="launcher")
    rank.wait()
    sys.exit(3)
signal.signal(signal.SIGTERM, stop)
note(event="ready", who="launcher")
time.sleep(120)
'''


def trial_events(path):
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """W&B offline, a key the stubbed server accepts, W&B's files in tmp_path, the recording
    trial; wandb.Api and os.environ are restored afterwards."""
    import wandb
    monkeypatch.setattr(wandb, "Api", wandb.Api)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("FAKE_TRIAL_LOG", str(tmp_path / "trials.jsonl"))
    monkeypatch.setenv("WANDB_SERVICE", "agent-service-token")
    for k in ("WANDB_SWEEP_ID", "WANDB_RUN_ID", "WANDB_ENTITY", "WANDB_PROJECT"):
        monkeypatch.delenv(k, raising=False)
    (tmp_path / "trial.py").write_text(TRIAL)
    return tmp_path


AGENT_SWEEP = sweep_cfg({"seed": {"values": [0, 3, 100]}, "use_wandb": {"value": True}})


def test_agent_runs_the_sweeps_trials_with_wandbs_own_agent(wandb_offline):
    """W&B's agent (wandb.agent without a function) builds each trial from the sweep's command,
    with the launcher in FP8TRAIN_LAUNCHER, in the agent's environment and the repository
    root; the agent reports the trials' exit codes and its own."""
    server = serve(AGENT_SWEEP, [(RUN_ID, {"seed": 0, "use_wandb": True}),
                                 ("r2", {"seed": 3, "use_wandb": True})])
    trial = wandb_offline / "trial.py"
    before, cwd = dict(os.environ), os.getcwd()
    lines = []
    rc = S.agent(f"team/proj/{SWEEP_ID}", launcher=[sys.executable, str(trial)],
                 out=lines.append)
    assert rc == 1
    assert lines[-1] == "agent: 2 trials run, 1 failed (r2)"
    assert dict(os.environ) == before and os.getcwd() == cwd
    assert server.requests[0] == ("sweep", {"entity": "team", "project": "proj",
                                            "name": SWEEP_ID})
    starts = [e for e in trial_events(wandb_offline / "trials.jsonl") if e["event"] == "start"]
    assert [e["env"]["WANDB_RUN_ID"] for e in starts] == [RUN_ID, "r2"]
    first = starts[0]
    assert first["env"]["WANDB_SWEEP_ID"] == SWEEP_ID
    assert "WANDB_SERVICE" not in first["env"]  # the agent's own connection stays with it
    assert first["cwd"] == str(ROOT)
    assert first["env"][S.LAUNCHER_VAR] == shlex.join(
        [sys.executable, "-m", "fp8train.sweep.supervise", sys.executable, str(trial)])
    # the launcher runs the program and its parameters, as build_command (= W&B) builds them
    built = S.build_command(COMMAND, "train_fp8.py", {"seed": 0, "use_wandb": True})
    assert first["argv"] == built[2:] == ["train_fp8.py", "--config", "configs/test_fp8.yaml",
                                          "--seed=0", "--use_wandb=True"]


def test_a_wandb_stop_reaches_every_process_of_the_trial(wandb_offline):
    """A stop from W&B (early termination): the agent sends SIGTERM to the trial, and the
    trial's supervisor passes it on to its whole process group (every rank)."""
    serve(AGENT_SWEEP, [(RUN_ID, {"seed": 100, "use_wandb": True})], stop=[RUN_ID])
    lines = []
    rc = S.agent(SWEEP_ID, launcher=[sys.executable, str(wandb_offline / "trial.py")],
                 out=lines.append)
    assert rc == 1 and lines[-1] == f"agent: 1 trials run, 1 failed ({RUN_ID})"
    events = trial_events(wandb_offline / "trials.jsonl")
    assert {e["who"] for e in events if e["event"] == "stopped"} == {"launcher", "rank"}


DRIVER = r'''
import json, sys
sys.path[:0] = [sys.argv[1]]
import e2e.test_sweep as T
from fp8train import sweep as S
config, runs, launcher = json.loads(sys.argv[2])
T.serve(config, runs)
S.cli._launcher = lambda args: launcher
sys.exit(S.main(["agent", "e/p/" + T.SWEEP_ID, "--count", "5"]))
'''


def test_sigterm_stops_the_running_trial_and_the_agent_exits_130(wandb_offline):
    """What a job script does to stop a sweep agent (run_sweep.py agent, a real process): its
    running trial gets SIGTERM in every process, no further trial starts, exit code 130."""
    import signal
    import time

    runs = [(RUN_ID, {"seed": 100, "use_wandb": True}), ("r2", {"seed": 0, "use_wandb": True})]
    launcher = [sys.executable, str(wandb_offline / "trial.py")]
    log = wandb_offline / "trials.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(ROOT / "tests"),
         json.dumps([AGENT_SWEEP, runs, launcher])], cwd=ROOT, env=dict(os.environ),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while len([e for e in trial_events(log) if e["event"] == "ready"]) < 2:
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out + err
    assert "agent: 1 trials run, 1 failed" in out and err.rstrip().endswith("interrupted")
    events = trial_events(log)
    assert {e["who"] for e in events if e["event"] == "stopped"} == {"launcher", "rank"}
    assert [e["env"]["WANDB_RUN_ID"] for e in events if e["event"] == "start"] == [RUN_ID]


def test_agent_runs_real_trials(wandb_offline, monkeypatch, capsys):
    """`run_sweep.py agent` with the default launcher (python): a real train_fp8.py trial,
    logging offline into <output_dir>/<W&B run id>."""
    out = wandb_offline / "sweep"
    monkeypatch.setenv("FP8TRAIN_DATA_DIR", DATA_DIR)
    fixed = {a[2:].split("=")[0]: yaml.safe_load(a.split("=")[1]) for a in SHORT}
    fixed["use_wandb"] = True
    cfg = dict(sweep_cfg({"penalty_weight": {"values": [0.0, 0.01]},
                          "penalty_type": {"value": "z_loss"},
                          **{k: {"value": v} for k, v in fixed.items()}}),
               command=COMMAND[:5] + [f"--output_dir={out}", "${args}"])
    serve(cfg, [("trial-a", dict(fixed, penalty_weight=0.01, penalty_type="z_loss"))])
    assert S.main(["agent", f"e/p/{SWEEP_ID}"]) == 0
    assert "agent: 1 trials run, 0 failed" in capsys.readouterr().out
    run = yaml.safe_load(open(out / "trial-a" / "config.yaml"))
    assert run["penalty_weight"] == 0.01 and run["max_steps"] == 6 and run["use_wandb"]
    assert any("val/loss" in row for row in metrics_rows(out / "trial-a"))
