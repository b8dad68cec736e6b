#!/usr/bin/env python3
"""The README demo against nanoGPT's CPU recipe on this machine, one after the other: val loss
against wall-clock time, and whether the demo is no worse at nanoGPT's finishing time.

    git clone https://github.com/karpathy/nanoGPT /tmp/nanoGPT
    python scripts/race_nanogpt.py --nanogpt /tmp/nanoGPT --out runs/race

nanoGPT is given by its path and never copied into this project; its shakespeare_char data is
prepared from our tinyshakespeare.txt (no download). Writes OUT/race.json and OUT/race.md. What
is measured and how: fp8train/analysis/race.py. Exit 0: raced; 2: bad input.
"""
import argparse
import os
import sys

from fp8train.errors import BadInput, run_reported


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nanogpt", required=True, help="a checkout of karpathy/nanoGPT")
    p.add_argument("--config", default="configs/test_fp8.yaml", help="fp8train's side")
    p.add_argument("--data_dir", default=os.environ.get("FP8TRAIN_DATA_DIR", "data"),
                   help="where tinyshakespeare.txt is (default $FP8TRAIN_DATA_DIR, else ./data)")
    p.add_argument("--out", default="race", help="output folder (default ./race)")
    a, extra = p.parse_known_args(argv)   # the rest goes to train_fp8.py

    def body():
        from fp8train.analysis.race import race
        corpus = os.path.abspath(os.path.join(a.data_dir, "tinyshakespeare.txt"))
        if not os.path.isfile(corpus):
            raise BadInput(f"--data_dir: no tinyshakespeare.txt in '{a.data_dir}'")
        r = race(os.path.abspath(a.nanogpt), a.config, a.out, corpus, extra=extra)
        return 0 if r["verdict"]["no_worse_at_equal_time"] else 1
    return run_reported(body)


if __name__ == "__main__":
    from fp8train.observe.console import run_main  # a closed stdout (| head): no traceback
    sys.exit(run_main(main))
