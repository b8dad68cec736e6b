"""What tests/unit/test_sweep.py and tests/e2e/test_sweep.py share."""


import yaml

GRID = [0.0, 0.005, 0.01, 0.02, 0.05]


COMMAND = ["${env}", "-S${envvar:FP8TRAIN_LAUNCHER}", "${program}", "--config",
           "configs/test_fp8.yaml", "${args}"]


def write(tmp_path, cfg, name="s.yaml"):
    p = tmp_path / name
    p.write_text(cfg if isinstance(cfg, str) else yaml.safe_dump(cfg, sort_keys=False))
    return str(p)


def sweep_cfg(parameters, method="grid", **extra):
    return dict(program="train_fp8.py", method=method,
                metric={"name": "val/loss", "goal": "minimize"}, parameters=parameters,
                command=list(COMMAND), **extra)


SWEEP_ID, RUN_ID = "abc123xy", "run9q8w7e"
