#!/usr/bin/env python3
"""Benchmark training speed: preset × precision backend × compile, each a real run of
train_fp8.py on the fixed synthetic stream (`dataset: synthetic`, GPT-2's vocabulary).

    python scripts/bench.py                                  # the default GPU suite, bench/
    python scripts/bench.py --full                           # 3 presets × 4 precisions
    python scripts/bench.py --presets llama-1b --precisions bf16,te
    python scripts/bench.py --quick                          # a tiny CPU run: checks the harness

The micro-batch is probed once per preset (eagerly, in the base precision) and used by every
configuration of it; each run does --warmup steps, then --steps timed ones. Writes
OUT/results.json and OUT/results.md and prints the table; exit 1 when a configuration failed or
was skipped. How it measures: fp8train/analysis/bench.py.
"""
import argparse
import sys

from fp8train.analysis.bench import GPU_SUITE, fill_defaults, run_bench


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", help=f"comma-separated model presets [{GPU_SUITE['presets']}]")
    p.add_argument("--precisions", help="comma-separated: bf16, fp32, te, torchao, native "
                   f"(FP8 backends, bf16 elsewhere) [bf16 and te; torchao where TE is not "
                   f"installed: here {GPU_SUITE['precisions']}]")
    p.add_argument("--compile", choices=("on", "off", "both"), help="[on]")
    p.add_argument("--compile-scopes", default="auto",
                   help="comma-separated compile_scope values to compare under compile: auto, "
                   "blocks, model [auto]")
    p.add_argument("--optimizers", default="adamw",
                   help="comma-separated: adamw, muon (each row reports its optimizer step's "
                   "milliseconds) [adamw]")
    p.add_argument("--steps", type=int, help="timed steps, a multiple of --warmup [20]")
    p.add_argument("--warmup", type=int, help="untimed steps first [10]")
    p.add_argument("--seq-len", type=int, help="[1024]")
    p.add_argument("--max-batch", type=int, help="ceiling of the probed micro-batch [64]")
    p.add_argument("--micro-batch", type=int,
                   help="use this micro-batch for every configuration instead of probing")
    p.add_argument("--fp8-layers", choices=("all", "auto"), default="all",
                   help="FP8 runs: every eligible Linear (all), or the run's default policy, "
                   "which times each layer shape first (auto) [all]")
    p.add_argument("--out", default="bench", help="results folder [bench]")
    p.add_argument("--budget-min", type=float,
                   help="the whole command's time limit: a configuration still running then is "
                   "stopped and reported, later ones are skipped [9.5; 60 with --full]")
    p.add_argument("--run-timeout", type=float, default=600,
                   help="seconds per configuration at most [600]")
    p.add_argument("--keep-runs", action="store_true", help="keep each run directory")
    p.add_argument("--full", action="store_true",
                   help="gpt2-124m, llama-350m, llama-1b × bf16, torchao, native, te "
                   "(32-55 min, estimated; budget 60)")
    p.add_argument("--quick", action="store_true",
                   help="tiny model on CPU, 3 precisions, 3 steps: checks the harness, not speed")
    args = p.parse_args(argv)
    if args.quick and args.full:
        p.error("--quick and --full are exclusive")
    for name, allowed, values in (("--compile-scopes", ("auto", "blocks", "model"),
                                   args.compile_scopes), ("--optimizers", ("adamw", "muon"),
                                                          args.optimizers)):
        bad = [v for v in values.split(",") if v not in allowed]
        if bad:
            p.error(f"{name}: {', '.join(bad)} is not one of {', '.join(allowed)}")
    if args.micro_batch is not None and args.micro_batch < 1:
        p.error("--micro-batch must be at least 1")
    fill_defaults(args)
    if args.steps < 1 or args.warmup < 1 or args.steps % args.warmup:
        p.error("--steps must be a positive multiple of --warmup (one log row per warm-up "
                "length: the first row is the warm-up, the others are timed)")
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return run_bench(parse(argv), " ".join(["python scripts/bench.py", *argv]))


if __name__ == "__main__":
    from fp8train.observe.console import run_main  # a closed stdout (| head): no traceback
    sys.exit(run_main(main))
