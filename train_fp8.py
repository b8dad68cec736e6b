#!/usr/bin/env python3
"""Train a GPT-style model from a YAML run config.

    python train_fp8.py --config configs/test_fp8.yaml
    accelerate launch --config_file accelerate_configs/h200.yaml train_fp8.py --config ...

`python train_fp8.py --help` lists every config key.
"""
import sys

from fp8train.train.cli import main
from fp8train.observe.console import run_main

if __name__ == "__main__":
    sys.exit(run_main(main))
