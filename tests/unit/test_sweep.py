"""In-process tests: W&B sweeps (run_sweep.py, fp8train/sweep/): sweep-file validation, the local
runner end to end (real train_fp8.py trials), seeded random sampling, the trial command line
(built by ... The whole story, and the tests that start processes: tests/e2e/test_sweep.py."""


import glob
import json
import math
import os

import pytest
import yaml
from support.runs import ROOT
from support.sweep_shared import COMMAND, GRID, RUN_ID, SWEEP_ID, sweep_cfg, write

from fp8train import sweep as S

SHIPPED = sorted(glob.glob(str(ROOT / "configs" / "sweeps" / "*.yaml")))


def test_the_three_lambda_sweeps_are_shipped():
    names = {os.path.basename(p) for p in SHIPPED}
    assert {"sweep_lambda.yaml", "sweep_lambda_openwebtext.yaml",
            "sweep_lambda_fineweb.yaml"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=os.path.basename)
def test_every_shipped_sweep_validates(path):
    cfg = S.validate_sweep(path)
    assert cfg["program"] == "train_fp8.py" and cfg["method"] in S.METHODS
    assert cfg["metric"] == {"name": "val/loss", "goal": "minimize"}
    cmd = cfg["command"]
    assert cmd[:3] == ["${env}", S.LAUNCHER_ITEM, "${program}"] and cmd[-1] == "${args}"
    assert cmd[3] == "--config" and os.path.isfile(ROOT / cmd[4])
    if os.path.basename(path).startswith("sweep_lambda"):
        assert cfg["parameters"]["penalty_weight"] == {"values": GRID}


def test_lambda_sweeps_use_their_base_configs():
    def load(name):
        return yaml.safe_load(open(ROOT / "configs" / "sweeps" / name))
    assert load("sweep_lambda.yaml")["command"][4] == "configs/test_fp8.yaml"
    owt = load("sweep_lambda_openwebtext.yaml")
    assert owt["command"][4] == "configs/openwebtext_adaptive_batch.yaml"
    assert owt["parameters"]["use_wandb"] == {"value": True}
    fw = load("sweep_lambda_fineweb.yaml")
    assert fw["command"][4] == "configs/fineweb_edu_fp8.yaml"
    assert fw["parameters"]["use_fp8"] == {"value": True}
    assert fw["parameters"]["dataset"] == {"value": "fineweb-edu"}


BAD = {
    "unknown_parameter": (sweep_cfg({"penalty_wieght": {"values": [0.0, 0.1]}}),
                          "parameters.penalty_wieght: not a config key (did you mean "
                          "penalty_weight?)"),
    "bad_value": (sweep_cfg({"penalty_type": {"value": "z_loss"},
                             "penalty_weight": {"values": [0.0, -0.1]}}),
                  "parameters.penalty_weight: value -0.1 is not valid: key 'penalty_weight' "
                  "must be a number >= 0.0"),
    "first_value_invalid": (sweep_cfg({"learning_rate": {"values": [-1.0, 1.0e-3]}}),
                            "parameters.learning_rate: value -1.0 is not valid: key "
                            "'learning_rate' must be a number > 0.0"),
    "value_invalid_with_base_config": (
        sweep_cfg({"penalty_weight": {"values": [0.0, 0.1]}}),
        "parameters.penalty_weight: value 0.1 is not valid: key 'penalty_weight' (0.1) applies "
        "only with penalty_type: z_loss or logit_l2, but penalty_type is 'none'"),
    "bad_choice": (sweep_cfg({"fp8_backend": {"values": ["te", "cuda"]}}),
                   "parameters.fp8_backend: value cuda is not valid: key 'fp8_backend' must be "
                   "one of te, torchao, native"),
    "missing_program": ({k: v for k, v in sweep_cfg({"seed": {"values": [1, 2]}}).items()
                         if k != "program"}, "program: missing"),
    "program_not_a_file": (dict(sweep_cfg({"seed": {"values": [1, 2]}}), program="train.py"),
                           "program: 'train.py' is not a file in the repository root"),
    "bad_method": (sweep_cfg({"seed": {"values": [1, 2]}}, method="hyperopt"),
                   "method: must be grid, random or bayes, got 'hyperopt'"),
    "bad_metric_goal": (dict(sweep_cfg({"seed": {"values": [1, 2]}}),
                             metric={"name": "val/loss", "goal": "lowest"}),
                        "metric.goal: must be minimize or maximize"),
    "base_config_missing": (dict(sweep_cfg({"seed": {"values": [1, 2]}}),
                                 command=COMMAND[:4] + ["configs/nope.yaml", "${args}"]),
                            "command: --config configs/nope.yaml: file not found"),
    "no_args_macro": (dict(sweep_cfg({"seed": {"values": [1, 2]}}), command=COMMAND[:5]),
                      "command: needs exactly one ${args}"),
    "int_key_continuous": (sweep_cfg({"n_layer": {"distribution": "uniform", "min": 1.0,
                                                  "max": 4.0}}, method="random"),
                           "parameters.n_layer: uniform point 2.5 is not valid"),
    "inverted_bounds": (sweep_cfg({"learning_rate": {"distribution": "log_uniform_values",
                                                     "min": 0.01, "max": 0.001}},
                                  method="random"),
                        "parameters.learning_rate: min (0.01) must be smaller than max (0.001)"),
    "grid_combination": (sweep_cfg({"max_steps": {"values": [100, 40]},
                                    "warmup_steps": {"values": [10, 50]}}),
                         "parameters: combination max_steps=40, warmup_steps=50 is not valid"),
    # A random sweep draws each parameter apart: a combination that fails though each value
    # passes alone would fail in the trials that draw it; refused when the sweep is read.
    "random_combination": (sweep_cfg({"max_steps": {"values": [100, 40]},
                                      "warmup_steps": {"values": [10, 50]}}, method="random"),
                           "parameters: combination max_steps=40, warmup_steps=50 (which a "
                           "trial may draw) is not valid"),
    "unknown_macro": (dict(sweep_cfg({"seed": {"values": [1, 2]}}),
                           command=COMMAND + ["${unknown_macro}"]),
                      "command[6]: unknown macro ${unknown_macro} (wandb agent would drop it)"),
    "json_macro": (dict(sweep_cfg({"seed": {"values": [1, 2]}}),
                        command=COMMAND[:5] + ["${args_json_file}"]),
                   "command[5]: ${args_json_file}: train_fp8.py reads --key=value options"),
    "lower_case_envvar": (dict(sweep_cfg({"seed": {"values": [1, 2]}}),
                               command=COMMAND + ["${envvar:home}"]),
                          "command[6]: unknown macro ${envvar:home}"),
    "macro_inside_an_item": (dict(sweep_cfg({"seed": {"values": [1, 2]}}),
                                  command=COMMAND + ["--tag=${program}"]),
                             "command[6]: '--tag=${program}': a macro other than "
                             "${envvar:NAME} must be a whole list item"),
    "misplaced_launcher": (dict(sweep_cfg({"seed": {"values": [1, 2]}}),
                                command=["${env}", "${interpreter}"] + COMMAND[1:]),
                           "command: -S${envvar:FP8TRAIN_LAUNCHER} goes right after ${env}, at "
                           "the start"),
    "top_level_typo": ({**{k: v for k, v in sweep_cfg({}).items() if k != "parameters"},
                        "paramters": {"seed": {"values": [1]}}},
                       "paramters: unknown sweep key (did you mean parameters?)"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_sweep_files_are_one_line_exit_2(tmp_path, capsys, case):
    cfg, expected = BAD[case]
    path = write(tmp_path, cfg)
    with pytest.raises(S.SweepError) as e:
        S.validate_sweep(path)
    assert str(e.value).startswith(f"{path}: {expected}"), str(e.value)
    assert "\n" not in str(e.value)
    # every command validates the same way before doing anything
    for argv in (["validate", path], ["create", path], ["local", path, "--max-trials", "1"]):
        assert S.main(argv) == 2
        err = capsys.readouterr().err
        assert err == f"error: {e.value}\n"


def test_a_command_without_the_launcher_runs_python_only(tmp_path, monkeypatch, capsys):
    """A command without FP8TRAIN_LAUNCHER ([${env}, ${interpreter}, ...], or none: W&B's
    default) is still a valid sweep, and `local` runs it with python; a launcher option, or
    `agent`, needs the launcher in the command: exit 2, one line."""
    old = dict(sweep_cfg({"seed": {"values": [1, 2]}, "use_wandb": {"value": True}}),
               command=["${env}", "${interpreter}"] + COMMAND[2:])
    path = write(tmp_path, old)
    S.validate_sweep(path)
    S.validate_sweep(write(tmp_path, {k: v for k, v in old.items() if k != "command"}, "d.yaml"))
    started = []
    assert S.run_local(path, output_dir=str(tmp_path / "out"), out=lambda *a: None,
                       runner=lambda argv, env, cwd: started.append(argv) or 0) == 0
    assert [argv[:3] for argv in started] == [["/usr/bin/env", "python", "train_fp8.py"]] * 2
    needs = ("command: must start with ${env}, -S${envvar:FP8TRAIN_LAUNCHER} (the launcher) for ")
    assert S.main(["local", path, "--num_processes", "2", "--output_dir", str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}: {needs}--accelerate_config / --num_processes, e.g. [")
    assert err.count("\n") == 1
    monkeypatch.setattr(S.wandb_client, "fetch_sweep_config", lambda *a: old)
    assert S.main(["agent", "e/p/abc"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: sweep e/p/abc: {needs}run_sweep.py agent (`wandb agent` runs "
                          "the sweep as it is), e.g. [") and err.count("\n") == 1


def test_random_local_needs_a_trial_count(tmp_path, capsys):
    path = write(tmp_path, sweep_cfg({"seed": {"distribution": "int_uniform", "min": 0,
                                               "max": 9}}, method="random"))
    assert S.main(["local", path]) == 2
    assert "random needs --max-trials N (or run_cap" in capsys.readouterr().err


def test_a_failed_trial_is_never_best(tmp_path):
    cfg = sweep_cfg({"seed": {"values": [1, 2, 3]}})
    results = [dict(trial=f"trial_00{i}", params={"seed": i}, exit_code=rc, run_dir=f"t{i}",
                    val_loss=v, tokens_per_sec=100.0, metric=v)
               for i, rc, v in ((1, 0, 3.0), (2, 1, 1.0), (3, 0, float("nan")))]
    assert S.best_index(results, "minimize") == 0
    assert S.best_index(results, "maximize") == 0
    S.write_results(str(tmp_path), "s.yaml", cfg, results)
    md = (tmp_path / "results.md").read_text().splitlines()
    table = [line for line in md if line.startswith("| ") and "trial" not in line][1:]
    assert table[0].startswith("| **best** | 1 |") and sum("**best**" in t for t in table) == 1
    assert "failed" in next(t for t in table if "| t2 |" in t)


RANDOM_PARAMS = {
    "learning_rate": {"distribution": "log_uniform_values", "min": 1e-4, "max": 1e-2},
    "weight_decay": {"distribution": "uniform", "min": 0.0, "max": 0.2},
    "n_layer": {"distribution": "int_uniform", "min": 2, "max": 6},
    "batch_size": {"distribution": "q_uniform", "min": 8, "max": 64, "q": 8},
    "penalty_type": {"values": ["z_loss", "logit_l2"], "probabilities": [0.8, 0.2]},
    "penalty_weight": {"values": [0.0, 0.01]},
    "seed": {"value": 7},
    "dropout": {"distribution": "log_uniform", "min": -6.0, "max": -2.0},
}


def test_random_sampling_is_seeded_and_respects_bounds(tmp_path):
    cfg = sweep_cfg(RANDOM_PARAMS, method="random")
    S.validate_sweep(write(tmp_path, cfg))
    a = S.random_trials(cfg, 200, seed=3)
    assert a == S.random_trials(cfg, 200, seed=3)
    assert a != S.random_trials(cfg, 200, seed=4)
    assert S.random_trials(cfg, 5, seed=3) == a[:5]
    for t in a:
        assert 1e-4 <= t["learning_rate"] <= 1e-2 and 0.0 <= t["weight_decay"] <= 0.2
        assert isinstance(t["n_layer"], int) and 2 <= t["n_layer"] <= 6
        assert isinstance(t["batch_size"], int) and t["batch_size"] % 8 == 0 \
            and 8 <= t["batch_size"] <= 64
        assert t["penalty_type"] in ("z_loss", "logit_l2") and t["penalty_weight"] in (0.0, 0.01)
        assert t["seed"] == 7 and math.exp(-6) <= t["dropout"] <= math.exp(-2)
    # the draws cover the space: both ends of the log range, every integer, the probabilities
    lrs = [t["learning_rate"] for t in a]
    assert min(lrs) < 3e-4 and max(lrs) > 3e-3
    assert {t["n_layer"] for t in a} == {2, 3, 4, 5, 6}
    share = sum(t["penalty_type"] == "z_loss" for t in a) / len(a)
    assert 0.7 < share < 0.9
    # each drawn set is a valid train_fp8.py command line
    for t in a[:20]:
        S.check_trial_config(COMMAND, "train_fp8.py", t)


def test_grid_is_the_cartesian_product_in_file_order():
    cfg = sweep_cfg({"penalty_type": {"value": "z_loss"},
                     "penalty_weight": {"values": [0.0, 0.01]},
                     "n_layer": {"distribution": "int_uniform", "min": 1, "max": 3}})
    assert S.grid_trials(cfg) == [
        {"penalty_type": "z_loss", "penalty_weight": w, "n_layer": n}
        for w in (0.0, 0.01) for n in (1, 2, 3)]


AGENT_ARGS = {"penalty_weight": {"value": 0.005}, "penalty_type": {"value": "z_loss"},
              "use_wandb": {"value": True}, "compile": {"value": False},
              "learning_rate": {"value": 1e-05}, "n_layer": {"value": 3},
              "fp8_exclude": {"value": ["lm_head", "wte"]}, "wandb_run_name": {"value": None}}


VALUES = {k: v["value"] for k, v in AGENT_ARGS.items()}


@pytest.fixture
def agent_env(tmp_path, monkeypatch):
    """The environment a sweep agent runs in; monkeypatch restores whatever wandb sets."""
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SWEEP_ID", SWEEP_ID)
    monkeypatch.setenv("WANDB_RUN_ID", "placeholder")
    monkeypatch.setenv("WANDB_SWEEP_PARAM_PATH", "placeholder")
    monkeypatch.setenv("WANDB_SERVICE", "agent-service-token")
    monkeypatch.setenv("FP8TRAIN_SWEEP_TEST", "inherited")
    monkeypatch.setenv("FP8TRAIN_LAUNCHER", "python")
    return tmp_path


def cli_agent_command(monkeypatch, sweep_command, program, args):
    """What `wandb agent` (wandb/wandb_agent.py, Agent._command_run) would start for a `run`
    command from the server. Only the server is stubbed: the Agent gets a placeholder api
    object and AgentProcess (which would spawn the process) records what it was given."""
    import wandb.wandb_agent as wa

    started = {}

    class RecordingProcess:
        def __init__(self, env=None, command=None, function=None, **kw):
            started.update(command=command, env=dict(env))

    monkeypatch.setattr(wa, "AgentProcess", RecordingProcess)
    agent = wa.Agent(api=object(), queue=None, sweep_id=SWEEP_ID)
    agent._sweep_command = list(sweep_command) if sweep_command else []
    agent._command_run({"type": "run", "run_id": RUN_ID, "program": program,
                        "args": json.loads(json.dumps(args))})
    return started["command"], started["env"]


@pytest.mark.parametrize("command,launcher", [
    (COMMAND, "python"),
    (COMMAND, "accelerate launch --config_file '/configs/with space.yaml'"),
    (COMMAND, None),  # unset: W&B puts the variable's name (then /usr/bin/env cannot find it)
    (None, "python"),  # no command: W&B's default ${env} ${interpreter} ${program} ${args}
    (["${env}", "-S${envvar:FP8TRAIN_LAUNCHER}", "${program}", "--config=configs/test_fp8.yaml",
      "${args_no_boolean_flags}", "--tag=${envvar:FP8TRAIN_SWEEP_TEST}-${envvar:WANDB_RUN_ID}",
      "${envvar:HOME}", "${envvar:FP8TRAIN_NOT_SET}"], "python"),
    (["${interpreter}", "${program}", "--config", "configs/test_fp8.yaml", "${args_no_equals}"],
     "python"),
], ids=["shipped_form", "accelerate", "launcher_unset", "default", "no_boolean_flags_envvars",
        "no_equals_interpreter"])
def test_trial_command_equals_what_wandb_agent_runs(agent_env, monkeypatch, command, launcher):
    """`local` and validation build the command line with S.build_command; W&B's agent builds it
    with its own code. They agree for every macro train_fp8.py can read. (W&B fills in
    ${envvar:...} before it sets the new run's WANDB_RUN_ID, so ours is built first.)"""
    if launcher is None:
        monkeypatch.delenv("FP8TRAIN_LAUNCHER")
    else:
        monkeypatch.setenv("FP8TRAIN_LAUNCHER", launcher)
    ours = S.build_command(command, "train_fp8.py", VALUES)
    theirs, _ = cli_agent_command(monkeypatch, command, "train_fp8.py", AGENT_ARGS)
    assert ours == theirs
    if command == COMMAND:
        assert theirs[1] == "-S" + (launcher or "FP8TRAIN_LAUNCHER")


@pytest.mark.parametrize("item,expected", [
    ("${unknown_macro}", "command[6]: unknown macro ${unknown_macro} (wandb agent would drop "
     "it); known: ${env}, ${interpreter}, ${program}, ${args}, ${args_no_equals}, "
     "${args_no_boolean_flags}, ${envvar:NAME}"),
    ("${args_json_file}", "command[6]: ${args_json_file}: train_fp8.py reads --key=value "
     "options; use ${args}"),
    ("${envvar:lower_case}", "command[6]: unknown macro ${envvar:lower_case}"),
    ("--x=${args}", "command[6]: '--x=${args}': a macro other than ${envvar:NAME} must be a "
     "whole list item"),
])
def test_build_command_refuses_what_wandb_would_drop(item, expected):
    with pytest.raises(S.SweepError) as e:
        S.build_command(COMMAND + [item], "train_fp8.py", {"seed": 1})
    assert str(e.value).startswith(expected) and "\n" not in str(e.value)
    assert S.EXIT_BAD_INPUT == 2 and isinstance(e.value, S.SweepError)


def test_shipped_sweep_trial_command(agent_env, monkeypatch):
    cfg = S.validate_sweep(str(ROOT / "configs" / "sweeps" / "sweep_lambda.yaml"))
    args = {"penalty_weight": {"value": 0.02}, "penalty_type": {"value": "z_loss"},
            "use_wandb": {"value": True}}
    theirs, _ = cli_agent_command(monkeypatch, cfg["command"], cfg["program"], args)
    assert theirs == ["/usr/bin/env", "-Spython", "train_fp8.py", "--config",
                      "configs/test_fp8.yaml", "--penalty_weight=0.02", "--penalty_type=z_loss",
                      "--use_wandb=True"]
    assert S.build_command(cfg["command"], cfg["program"],
                           {k: v["value"] for k, v in args.items()}) == theirs
    # and train_fp8.py reads it as meant
    from fp8train.config.load import load_config
    run = load_config(S.config_argv(theirs, "train_fp8.py"))
    assert (run.penalty_weight, run.penalty_type, run.use_wandb) == (0.02, "z_loss", True)


@pytest.mark.parametrize("launcher,expected", [
    (S.launcher_for(accelerate_config="accelerate_configs/h200.yaml"),
     ["accelerate", "launch", "--config_file", "accelerate_configs/h200.yaml"]),
    (S.launcher_for(num_processes=8), ["accelerate", "launch", "--num_processes", "8"]),
    (S.launcher_for(), ["python"]),
])
def test_the_launcher_variable_replaces_only_the_launcher(agent_env, monkeypatch, launcher,
                                                         expected):
    assert launcher == expected
    cfg = S.validate_sweep(str(ROOT / "configs" / "sweeps" / "sweep_lambda_fineweb.yaml"))
    plain, _ = cli_agent_command(monkeypatch, cfg["command"], cfg["program"], AGENT_ARGS)
    monkeypatch.setenv(S.LAUNCHER_VAR, S.launcher_env(launcher)[S.LAUNCHER_VAR])
    theirs, _ = cli_agent_command(monkeypatch, cfg["command"], cfg["program"], AGENT_ARGS)
    assert plain[1] == "-Spython"
    assert theirs[:2] == ["/usr/bin/env", "-S" + " ".join(expected)]
    assert theirs[2:] == plain[2:]
    assert S.build_command(cfg["command"], cfg["program"], VALUES) == theirs


def test_bad_sweep_ids_are_one_line_exit_2(capsys):
    assert S.split_sweep_path("e/p/abc", None, "fp8train") == ("e", "p", "abc")
    assert S.split_sweep_path("p/abc", "me", None) == ("me", "p", "abc")
    assert S.split_sweep_path("abc", None, "fp8train") == (None, "fp8train", "abc")
    assert S.main(["agent", "a/b/c/d"]) == 2
    assert capsys.readouterr().err == ("error: sweep id 'a/b/c/d': expected SWEEP_ID, "
                                       "PROJECT/SWEEP_ID or ENTITY/PROJECT/SWEEP_ID\n")


def test_create_sends_the_validated_sweep_and_prints_its_id(monkeypatch, capsys):
    """wandb.sweep is the server boundary: stubbed, it records what it was given."""
    import wandb

    calls = []

    def fake_sweep(sweep, project=None, entity=None, **kw):
        calls.append(dict(sweep=sweep, project=project, entity=entity))
        return "sw33pid"

    monkeypatch.setattr(wandb, "sweep", fake_sweep)
    path = str(ROOT / "configs" / "sweeps" / "sweep_lambda.yaml")
    assert S.main(["create", path, "--project", "lam", "--entity", "team"]) == 0
    assert calls == [dict(sweep=yaml.safe_load(open(path)), project="lam", entity="team")]
    out = capsys.readouterr().out
    assert "sweep id: sw33pid" in out
    assert "python run_sweep.py agent team/lam/sw33pid" in out
    assert "wandb agent team/lam/sw33pid" in out
    # project and entity default to the base config's wandb_project / wandb_entity
    calls.clear()
    assert S.main(["create", path]) == 0
    assert calls[0]["project"] == "fp8train" and calls[0]["entity"] is None


def test_create_server_errors_are_one_line_exit_1(monkeypatch, capsys):
    import wandb

    def unreachable(*a, **kw):
        raise ConnectionError("could not reach api.wandb.ai\nretrying...")

    monkeypatch.setattr(wandb, "sweep", unreachable)
    path = str(ROOT / "configs" / "sweeps" / "sweep_lambda.yaml")
    assert S.main(["create", path, "--project", "p"]) == 1
    err = capsys.readouterr().err
    assert err == ("error: cannot create the sweep on W&B (project p): ConnectionError: could "
                   "not reach api.wandb.ai\n")


def test_agent_refuses_a_sweep_whose_trials_would_not_log(monkeypatch, capsys, tmp_path):
    """The sweep config comes from the server (stubbed): trials without use_wandb would never
    report the metric, so the agent stops before starting any."""
    cfg = sweep_cfg({"seed": {"values": [1, 2]}})
    monkeypatch.setattr(S.wandb_client, "fetch_sweep_config", lambda *a: cfg)
    assert S.main(["agent", "e/p/abc"]) == 2
    assert "the trials would not log to W&B" in capsys.readouterr().err


def test_local_trial_environment():
    env = S.trial_env({"PATH": "/usr/bin", "WANDB_SWEEP_ID": "x", "WANDB_RUN_ID": "y",
                       "WANDB_SERVICE": "s", "HOME": "/h"}, local=True)
    assert env["WANDB_MODE"] == "offline" and env["HOME"] == "/h"
    assert not {"WANDB_SWEEP_ID", "WANDB_RUN_ID", "WANDB_SERVICE"} & set(env)
    assert S.trial_env({"WANDB_MODE": "online"}, local=True)["WANDB_MODE"] == "online"
    agent = S.trial_env({"WANDB_SWEEP_ID": "x", "WANDB_RUN_ID": "y", "PATH": "/usr/bin"})
    assert agent["WANDB_SWEEP_ID"] == "x" and agent["WANDB_RUN_ID"] == "y"
    assert "WANDB_MODE" not in agent
