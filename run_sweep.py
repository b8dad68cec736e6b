#!/usr/bin/env python3
"""W&B sweeps of train_fp8.py.

    python run_sweep.py create configs/sweeps/sweep_lambda.yaml [--project P --entity E]
    python run_sweep.py agent ENTITY/PROJECT/SWEEP_ID [--count N] [--accelerate_config FILE]
    python run_sweep.py local configs/sweeps/sweep_lambda.yaml [--max-trials N] [-- --key=value]

`python run_sweep.py COMMAND --help` describes each command. The logic is in fp8train/sweep/.
"""
import sys

from fp8train.observe.console import run_main
from fp8train.sweep import main

if __name__ == "__main__":
    sys.exit(run_main(main))
