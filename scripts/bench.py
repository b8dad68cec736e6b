#!/usr/bin/env python3
"""Benchmark training speed: preset × precision backend × compile, each a real run of
train_fp8.py on the fixed synthetic stream (`dataset: synthetic`, GPT-2's vocabulary).

    python scripts/bench.py                                  # the GPU suite, results in bench/
    python scripts/bench.py --presets gpt2-124m --precisions bf16,native --compile both
    python scripts/bench.py --quick                          # a tiny CPU run: checks the harness

Each configuration runs in its own process (the numbers are what a user's run gets, from the
same code path): the micro-batch comes from the batch probe (cached in OUT/cache, so a rerun
skips it), then `--warmup` steps (compilation, allocator warm-up, FP8 scale start) and
`--steps` timed steps. Tokens/s, step time and MFU come from the trainer's own metrics over the
timed steps only: training time between two host-synchronised log points, which is what CUDA
events around those steps would measure, with evaluation and checkpoints excluded. The loss
after the last step is reported too, on the same token stream for every configuration, so a
speed-up that breaks numerics shows. Writes OUT/results.json and OUT/results.md, and prints the
table. A configuration that fails is reported with its error and the rest go on; `--budget-min`
bounds the whole command (a run still going then is stopped and reported, the rest skipped),
so that one command fits a time slot.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

GPU_SUITE = dict(presets="gpt2-124m,llama-350m,llama-1b", precisions="bf16,torchao,native,te",
                 compile="on", steps=30, warmup=10, seq_len=1024, max_batch=64)
QUICK = dict(presets="tiny", precisions="fp32,native,torchao", compile="off", steps=2,
             warmup=1, seq_len=64, max_batch=4)
FP8_BACKENDS = ("te", "torchao", "native")


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", help=f"comma-separated model presets [{GPU_SUITE['presets']}]")
    p.add_argument("--precisions", help="comma-separated: bf16, fp32, te, torchao, native "
                   f"(FP8 backends, bf16 elsewhere) [{GPU_SUITE['precisions']}]")
    p.add_argument("--compile", choices=("on", "off", "both"), help="[on]")
    p.add_argument("--steps", type=int, help="timed steps, a multiple of --warmup [30]")
    p.add_argument("--warmup", type=int, help="untimed steps first [10]")
    p.add_argument("--seq-len", type=int, help="[1024]")
    p.add_argument("--max-batch", type=int, help="ceiling of the probed micro-batch [64]")
    p.add_argument("--out", default="bench", help="results folder [bench]")
    p.add_argument("--budget-min", type=float, default=9.5,
                   help="the whole command's time limit: a configuration still running then is "
                   "stopped and reported, later ones are skipped [9.5]")
    p.add_argument("--run-timeout", type=float, default=600,
                   help="seconds per configuration at most [600]")
    p.add_argument("--keep-runs", action="store_true", help="keep each run directory")
    p.add_argument("--quick", action="store_true",
                   help="tiny model on CPU, 3 precisions, 3 steps: checks the harness, not speed")
    args = p.parse_args(argv)
    defaults = QUICK if args.quick else GPU_SUITE
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.steps < 1 or args.warmup < 1 or args.steps % args.warmup:
        p.error("--steps must be a positive multiple of --warmup (one log row per warm-up "
                "length: the first row is the warm-up, the others are timed)")
    return args


def configurations(args) -> list:
    compiles = {"on": [True], "off": [False], "both": [False, True]}[args.compile]
    return [dict(preset=p, precision=q, compile=c)
            for p in args.presets.split(",") for q in args.precisions.split(",")
            for c in compiles]


def train_args(conf: dict, args, run_dir: str) -> list:
    """The train_fp8.py command line of one configuration."""
    q = conf["precision"]
    fp8 = q in FP8_BACKENDS
    total = args.warmup + args.steps
    argv = [f"--model={conf['preset']}", "--dataset=synthetic", f"--seq_len={args.seq_len}",
            f"--output_dir={run_dir}", f"--max_steps={total}", "--num_epochs=null",
            f"--warmup_steps={min(args.warmup, total - 1)}", f"--log_interval={args.warmup}",
            f"--eval_interval={total}", "--eval_sequences=8", "--eval_samples=0",
            f"--checkpoint_interval={total}", "--keep_checkpoints=1",
            "--auto_batch_size", f"--target_effective_batch_size={args.max_batch}",
            f"--max_batch_size={args.max_batch}",
            f"--batch_cache_dir={os.path.join(args.out, 'cache')}",
            f"--compile={str(conf['compile']).lower()}", "--seed=1337"]
    if fp8:   # a backend that cannot run must say so, not quietly measure bf16
        argv += ["--use_fp8", f"--fp8_backend={q}", "--fp8_fallback=error",
                 "--precision=" + ("fp32" if args.quick else "bf16")]
    else:
        argv += ["--no_fp8", f"--precision={q}"]
    return argv


def summarise(conf: dict, run_dir: str, args) -> dict:
    """One result row from a finished run's metrics.jsonl and config.yaml."""
    import yaml
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    train = [r for r in rows if "train/loss" in r]
    timed = [r for r in train if r["step"] > args.warmup]
    with open(os.path.join(run_dir, "config.yaml")) as fh:
        derived = (yaml.safe_load(fh) or {}).get("derived", {})
    step_time = sum(r["train/step_time"] for r in timed) / len(timed)
    tokens_per_step = derived["tokens_per_step"]
    out = dict(conf, status="ok", micro_batch=derived["micro_batch_size"],
               tokens_per_sec=tokens_per_step / step_time, step_time_ms=step_time * 1000,
               loss=train[-1]["train/loss"], steps=train[-1]["step"],
               fp8_layers=derived.get("fp8_layers", 0), precision_used=derived.get("precision"),
               fp8_used=derived.get("fp8"), device=derived.get("device"))
    mfu = [r["train/mfu"] for r in timed if "train/mfu" in r]
    if mfu:
        out["mfu"] = sum(mfu) / len(mfu)
    peak = [r["system/gpu_memory_peak_gb"] for r in train if "system/gpu_memory_peak_gb" in r]
    if peak:
        out["peak_memory_gb"] = max(peak)
    out["environment"] = derived.get("environment", {})
    return out


def run_one(conf: dict, args, timeout: float) -> dict:
    name = f"{conf['preset']}-{conf['precision']}-{'compile' if conf['compile'] else 'eager'}"
    run_dir = os.path.join(args.out, "runs", name)
    shutil.rmtree(run_dir, ignore_errors=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    t0 = time.time()
    try:
        r = subprocess.run([sys.executable, os.path.join(ROOT, "train_fp8.py"),
                            *train_args(conf, args, run_dir)], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=timeout)
        code, err = r.returncode, r.stderr
    except subprocess.TimeoutExpired:
        code, err = None, f"timed out after {timeout:.0f} s (--run-timeout / --budget-min)"
    wall = time.time() - t0
    if code == 0:
        result = summarise(conf, run_dir, args)
    else:
        lines = [line for line in err.strip().splitlines() if line.strip()]
        why = next((line for line in reversed(lines) if line.startswith("error:")),
                   lines[-1] if lines else f"exit {code}")
        result = dict(conf, status="failed", error=why[:300])
        with open(os.path.join(args.out, f"{name}.log"), "w") as fh:
            fh.write(err)
    result["wall_s"] = round(wall, 1)
    if not args.keep_runs:   # checkpoints of a 1B model are ~12 GB each
        shutil.rmtree(run_dir, ignore_errors=True)
    return result


def table(results: list) -> str:
    head = ("| preset | precision | compile | micro | tokens/s | step ms | MFU | peak GB | "
            "FP8 layers | loss | wall s |")
    lines = [head, "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        c = "on" if r["compile"] else "off"
        if r["status"] != "ok":
            lines.append(f"| {r['preset']} | {r['precision']} | {c} | | | | | | | "
                         f"{r['status']}: {r.get('error', '')} | {r.get('wall_s', '')} |")
            continue
        mfu = f"{r['mfu']:.1%}" if "mfu" in r else "–"
        mem = f"{r['peak_memory_gb']:.1f}" if "peak_memory_gb" in r else "–"
        lines.append(f"| {r['preset']} | {r['precision']} | {c} | {r['micro_batch']} | "
                     f"{r['tokens_per_sec']:,.0f} | {r['step_time_ms']:.1f} | {mfu} | {mem} | "
                     f"{r['fp8_layers']} | {r['loss']:.4f} | {r['wall_s']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    os.makedirs(args.out, exist_ok=True)
    confs = configurations(args)
    results, t0 = [], time.time()
    print(f"bench: {len(confs)} configurations, {args.warmup} warm-up + {args.steps} timed "
          f"steps each, seq_len {args.seq_len}; results in {args.out}/", flush=True)
    for i, conf in enumerate(confs, 1):
        left = args.budget_min * 60 - (time.time() - t0)
        if left < 30:   # not enough for even a cached, compiled tiny run
            results.append(dict(conf, status="skipped", error=f"budget of {args.budget_min:g} "
                                "min used up"))
            continue
        print(f"[{i}/{len(confs)}] {conf['preset']} {conf['precision']} "
              f"compile={'on' if conf['compile'] else 'off'} ...", flush=True)
        r = run_one(conf, args, timeout=min(args.run_timeout, left))
        results.append(r)
        if r["status"] == "ok":
            print(f"    {r['tokens_per_sec']:,.0f} tok/s, {r['step_time_ms']:.1f} ms/step, micro "
                  f"{r['micro_batch']}, loss {r['loss']:.4f}"
                  + (f", MFU {r['mfu']:.1%}" if "mfu" in r else ""), flush=True)
        else:
            print(f"    {r['status']}: {r['error']}", flush=True)
    env = next((r["environment"] for r in results if r.get("environment")), {})
    for r in results:
        r.pop("environment", None)
    report = dict(date=time.strftime("%Y-%m-%d %H:%M"), command=" ".join(
        ["python scripts/bench.py", *(sys.argv[1:] if argv is None else argv)]),
        environment=env, warmup=args.warmup, steps=args.steps, seq_len=args.seq_len,
        results=results)
    with open(os.path.join(args.out, "results.json"), "w") as fh:
        json.dump(report, fh, indent=1)
    md = (f"# Benchmark {report['date']}\n\n`{report['command']}`\n\n"
          f"Environment: {json.dumps(env)}\n\n{table(results)}\n")
    with open(os.path.join(args.out, "results.md"), "w") as fh:
        fh.write(md)
    print("\n" + table(results))
    print(f"\nwrote {args.out}/results.json and {args.out}/results.md "
          f"({(time.time() - t0) / 60:.1f} min)")
    return 0 if all(r["status"] == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
