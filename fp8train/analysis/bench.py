"""Training speed benchmarks (scripts/bench.py): preset × precision backend × compile, each a
real run of train_fp8.py on the fixed synthetic stream (`dataset: synthetic`, GPT-2's
vocabulary).

Its three parts, in this order below: what runs (the suites: default, --full, --quick; the
configurations; the train_fp8.py command line of each probe and each run); running them (one
process per probe and per configuration, within the budget, and each finished run's result row
from its metrics.jsonl and config.yaml); the report (the table, results.json, results.md).

Each configuration runs in its own process (the numbers are what a user's run gets, from the
same code path). The micro-batch is probed once per preset and base precision, by the trainer's
own batch probe run eagerly (`--plan-only`, compile off: a compiled probe would compile the
model once per trial), cached in OUT/cache, and then used by every configuration of that
preset: FP8 and compiled runs need no more memory than the eager base-precision probe measured,
and the same micro-batch everywhere makes the rows comparable. `--micro-batch N` skips the probe.
Each run does `--warmup` steps (compilation, allocator warm-up, FP8 scale start) and then
`--steps` timed steps. Tokens/s, step time and MFU come from the trainer's own metrics over the
timed steps only: training time between two host-synchronised log points, which is what CUDA
events around those steps would measure, with evaluation and checkpoints excluded. The loss
after the last step is reported too, on the same token stream for every configuration, so a
speed-up that breaks numerics shows. FP8 runs convert every eligible Linear (`--fp8-layers
all`); `--fp8-layers auto` measures the run's default policy instead, which first times each
layer shape (cached in OUT/cache). Writes OUT/results.json and OUT/results.md, and prints the
table. A configuration that fails is reported with its error and the rest go on; `--budget-min`
bounds the whole command (a run still going then is stopped and reported, the rest skipped),
so that one command fits a time slot.

Only the standard library is imported here (PyYAML to read a finished run's config.yaml):
torch runs in the train_fp8.py processes, never in this one.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

from ..errors import EXIT_FAILED, EXIT_OK
from ..observe.metrics_file import read_rows


# --- what runs ------------------------------------------------------------------------------------

def default_fp8() -> str:
    """The default suite's FP8 backend: Transformer Engine where it is installed, else torchao
    (the FP8 most machines can install), else the native path, which needs no library."""
    import importlib.util
    for backend, module in (("te", "transformer_engine"), ("torchao", "torchao")):
        if importlib.util.find_spec(module) is not None:
            return backend
    return "native"


# The default: one probe and two compiled runs, bf16 and FP8 (docs/gpu.md, "Benchmark": about
# 3-4 min on an H200, within its 9.5-minute budget). --full is every preset × every precision,
# 32-55 minutes (estimated).
GPU_SUITE = dict(presets="gpt2-124m", precisions=f"bf16,{default_fp8()}", compile="on",
                 steps=20, warmup=10, seq_len=1024, max_batch=64, budget_min=9.5)
FULL = dict(GPU_SUITE, presets="gpt2-124m,llama-350m,llama-1b",
            precisions="bf16,torchao,native,te", budget_min=60.0)
QUICK = dict(presets="tiny", precisions="fp32,native,torchao", compile="off", steps=2,
             warmup=1, seq_len=64, max_batch=4, budget_min=9.5)
FP8_BACKENDS = ("te", "torchao", "native")


def fill_defaults(args) -> None:
    """The options left unset (None) take the values of the suite that args.quick or args.full
    picks, else the default GPU suite's."""
    defaults = QUICK if args.quick else FULL if args.full else GPU_SUITE
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def configurations(args) -> list:
    compiles = {"on": [True], "off": [False], "both": [False, True]}[args.compile]
    scopes = args.compile_scopes.split(",")
    return [dict(preset=p, precision=q, compile=c, compile_scope=scope, optimizer=o)
            for p in args.presets.split(",") for q in args.precisions.split(",")
            for c in compiles for scope in (scopes if c else ["-"])
            for o in args.optimizers.split(",")]


def base_precision(precision: str, args) -> str:
    """The precision of everything that is not an FP8 Linear: what the probe runs in."""
    if precision in FP8_BACKENDS:
        return "fp32" if args.quick else "bf16"
    return precision


def _common_args(preset: str, args, run_dir: str) -> list:
    total = args.warmup + args.steps
    return [f"--model={preset}", "--dataset=synthetic", f"--seq_len={args.seq_len}",
            f"--output_dir={run_dir}", f"--max_steps={total}", "--num_epochs=null",
            f"--warmup_steps={min(args.warmup, total - 1)}",
            f"--batch_cache_dir={os.path.join(args.out, 'cache')}", "--seed=1337"]


def probe_args(preset: str, precision: str, args, run_dir: str) -> list:
    """The train_fp8.py command line that probes the micro-batch of a preset, eagerly, in its
    base precision, and exits (--plan-only). The largest fit, untimed: every row runs at it, so
    that the precisions compare at one micro-batch."""
    return [*_common_args(preset, args, run_dir), "--auto_batch_size",
            f"--target_effective_batch_size={args.max_batch}",
            f"--max_batch_size={args.max_batch}", "--batch_timing_budget_s=0",
            "--compile=false", "--no_fp8",
            f"--precision={precision}", "--plan-only"]


def train_args(conf: dict, args, run_dir: str, micro: int) -> list:
    """The train_fp8.py command line of one configuration, at micro-batch `micro`."""
    q = conf["precision"]
    total = args.warmup + args.steps
    argv = [*_common_args(conf["preset"], args, run_dir), f"--log_interval={args.warmup}",
            f"--eval_interval={total}", "--eval_sequences=8", "--eval_samples=0",
            f"--checkpoint_interval={total}", "--keep_checkpoints=1",
            f"--batch_size={micro}", "--gradient_accumulation_steps=1",
            f"--compile={str(conf['compile']).lower()}", f"--optimizer={conf['optimizer']}"]
    if conf["compile"]:
        argv.append(f"--compile_scope={conf['compile_scope']}")
    if q in FP8_BACKENDS:   # a backend that cannot run must say so, not quietly measure bf16
        argv += ["--use_fp8", f"--fp8_backend={q}", "--fp8_fallback=error",
                 f"--fp8_layers={args.fp8_layers}", f"--precision={base_precision(q, args)}"]
    else:
        argv += ["--no_fp8", f"--precision={q}"]
    return argv


# --- running it -----------------------------------------------------------------------------------


# The repository root, where train_fp8.py is (fp8train is installed editable: pip install -e .).
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_FIT = re.compile(r"fitted micro (\d+) of max")


def _failure(err: str, code) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    why = next((line for line in reversed(lines) if line.startswith("error:")),
               lines[-1] if lines else f"exit {code}")
    return why[:300]


def _train_fp8(argv: list, timeout: float):
    """(exit code or None on timeout, stdout, stderr) of one train_fp8.py process."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        r = subprocess.run([sys.executable, os.path.join(ROOT, "train_fp8.py"), *argv],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        return r.returncode, r.stdout, r.stderr
    except subprocess.TimeoutExpired:
        return None, "", f"timed out after {timeout:.0f} s (--run-timeout / --budget-min)"


def probe(preset: str, precision: str, args, timeout: float) -> dict:
    """The micro-batch of `preset` in `precision`, from the trainer's batch probe (eager)."""
    name = f"probe-{preset}-{precision}"
    run_dir = os.path.join(args.out, "runs", name)
    t0 = time.time()
    code, out, err = _train_fp8(probe_args(preset, precision, args, run_dir), timeout)
    result = dict(preset=preset, precision=precision, wall_s=round(time.time() - t0, 1))
    fit = _FIT.search(out) if code == 0 else None
    if fit:
        result.update(status="ok", micro_batch=int(fit.group(1)),
                      cached="(cached in" in out)
    else:
        result.update(status="failed", error=_failure(err, code) if code != 0 else
                      "no 'fitted micro' line in the probe's output")
        with open(os.path.join(args.out, f"{name}.log"), "w") as fh:
            fh.write(out + err)
    shutil.rmtree(run_dir, ignore_errors=True)
    return result


def summarise(conf: dict, run_dir: str, args) -> dict:
    """One result row from a finished run's metrics.jsonl and config.yaml."""
    import yaml
    rows = read_rows(run_dir, strict=True)
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
    optimizer_ms = [r["train/optimizer_ms"] for r in timed if "train/optimizer_ms" in r]
    if optimizer_ms:
        out["optimizer_ms"] = sum(optimizer_ms) / len(optimizer_ms)
    summary_path = os.path.join(run_dir, "summary.json")
    if os.path.isfile(summary_path):
        with open(summary_path) as fh:
            out["first_step_s"] = json.load(fh).get("first_step_s")
    mfu = [r["train/mfu"] for r in timed if "train/mfu" in r]
    if mfu:
        out["mfu"] = sum(mfu) / len(mfu)
    peak = [r["system/gpu_memory_peak_gb"] for r in train if "system/gpu_memory_peak_gb" in r]
    if peak:
        out["peak_memory_gb"] = max(peak)
    out["environment"] = derived.get("environment", {})
    return out


def run_one(conf: dict, args, timeout: float, micro: int) -> dict:
    how = f"compile-{conf['compile_scope']}" if conf["compile"] else "eager"
    name = f"{conf['preset']}-{conf['precision']}-{how}-{conf['optimizer']}"
    run_dir = os.path.join(args.out, "runs", name)
    shutil.rmtree(run_dir, ignore_errors=True)
    t0 = time.time()
    code, _, err = _train_fp8(train_args(conf, args, run_dir, micro), timeout)
    wall = time.time() - t0
    if code == 0:
        result = summarise(conf, run_dir, args)
    else:
        result = dict(conf, status="failed", error=_failure(err, code))
        with open(os.path.join(args.out, f"{name}.log"), "w") as fh:
            fh.write(err)
    result["wall_s"] = round(wall, 1)
    if not args.keep_runs:   # checkpoints of a 1B model are ~12 GB each
        shutil.rmtree(run_dir, ignore_errors=True)
    return result


def run_bench(args, command: str) -> int:
    """Every configuration of `args` (scripts/bench.py's options, the suite's defaults filled
    in), the micro-batch probed first where --micro-batch does not give it; then the table,
    OUT/results.json and OUT/results.md, which show `command`. EXIT_FAILED when a configuration
    failed or was skipped."""
    os.makedirs(args.out, exist_ok=True)
    confs = configurations(args)
    results, probes, t0 = [], {}, time.time()
    print(f"bench: {len(confs)} configurations, {args.warmup} warm-up + {args.steps} timed "
          f"steps each, seq_len {args.seq_len}, budget {args.budget_min:g} min; micro-batch "
          + (f"{args.micro_batch} (--micro-batch)" if args.micro_batch else
             "probed once per preset (eager)") + f"; results in {args.out}/", flush=True)
    for i, conf in enumerate(confs, 1):
        left = args.budget_min * 60 - (time.time() - t0)
        if left < 30:   # not enough for even a cached, compiled tiny run
            results.append(dict(conf, status="skipped", error=f"budget of {args.budget_min:g} "
                                "min used up"))
            continue
        micro = args.micro_batch
        if micro is None:
            key = (conf["preset"], base_precision(conf["precision"], args))
            if key not in probes:
                print(f"[probe] {key[0]} {key[1]}: largest micro-batch up to {args.max_batch} "
                      "...", flush=True)
                probes[key] = probe(*key, args, timeout=min(args.run_timeout, left))
                print(f"    {probe_text(probes[key])}", flush=True)
                left = args.budget_min * 60 - (time.time() - t0)
            if probes[key]["status"] != "ok":
                results.append(dict(conf, status="failed", error="batch probe failed: "
                                    + probes[key]["error"]))
                continue
            micro = probes[key]["micro_batch"]
            if left < 30:
                results.append(dict(conf, status="skipped", error=f"budget of "
                                    f"{args.budget_min:g} min used up"))
                continue
        print(f"[{i}/{len(confs)}] {conf['preset']} {conf['precision']} "
              f"compile={_compile_text(conf)} {conf['optimizer']} micro {micro} ...",
              flush=True)
        r = run_one(conf, args, timeout=min(args.run_timeout, left), micro=micro)
        results.append(r)
        if r["status"] == "ok":
            print(f"    {r['tokens_per_sec']:,.0f} tok/s, {r['step_time_ms']:.1f} ms/step, micro "
                  f"{r['micro_batch']}, loss {r['loss']:.4f}"
                  + (f", MFU {r['mfu']:.1%}" if "mfu" in r else "")
                  + (f", first step {r['first_step_s']:.1f} s" if r.get("first_step_s") else "")
                  + (f", optimizer {r['optimizer_ms']:.2f} ms" if "optimizer_ms" in r else ""),
                  flush=True)
        else:
            print(f"    {r['status']}: {r['error']}", flush=True)
    write_results(args, command, list(probes.values()), results, t0)
    return EXIT_OK if all(r["status"] == "ok" for r in results) else EXIT_FAILED


# --- the report -----------------------------------------------------------------------------------

def probe_text(p: dict) -> str:
    """A probe's outcome in a few words: its micro-batch and how it was had, or its error."""
    if p["status"] != "ok":
        return f"{p['status']}: {p['error']}"
    how = "cached" if p["cached"] else f"probe process {p['wall_s']} s"
    return f"micro-batch {p['micro_batch']} ({how})"


def _compile_text(r: dict) -> str:
    return r.get("compile_scope", "on") if r["compile"] else "off"


def table(results: list) -> str:
    """The markdown table of the result rows, one per configuration (a failed or skipped one
    with its error). First step: the run's first optimizer step with its compiles (seconds);
    optimizer: the optimizer step alone, on the logged steps (milliseconds)."""
    head = ("| preset | precision | compile | optimizer | micro | tokens/s | step ms | "
            "optimizer ms | first step s | MFU | peak GB | FP8 layers | loss | wall s |")
    lines = [head, "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
                   "| ---: | ---: | ---: |"]
    for r in results:
        c, opt = _compile_text(r), r.get("optimizer", "adamw")
        if r["status"] != "ok":
            lines.append(f"| {r['preset']} | {r['precision']} | {c} | {opt} | | | | | | | | | "
                         f"{r['status']}: {r.get('error', '')} | {r.get('wall_s', '')} |")
            continue
        mfu = f"{r['mfu']:.1%}" if "mfu" in r else "–"
        mem = f"{r['peak_memory_gb']:.1f}" if "peak_memory_gb" in r else "–"
        opt_ms = f"{r['optimizer_ms']:.2f}" if "optimizer_ms" in r else "–"
        first = f"{r['first_step_s']:.1f}" if r.get("first_step_s") is not None else "–"
        lines.append(f"| {r['preset']} | {r['precision']} | {c} | {opt} | {r['micro_batch']} | "
                     f"{r['tokens_per_sec']:,.0f} | {r['step_time_ms']:.1f} | {opt_ms} | "
                     f"{first} | {mfu} | {mem} | {r['fp8_layers']} | {r['loss']:.4f} | "
                     f"{r['wall_s']} |")
    return "\n".join(lines)


def write_results(args, command: str, probes: list, results: list, t0: float) -> None:
    """OUT/results.json and OUT/results.md, then the table printed; `t0`: the bench's start.
    The environment of the first run that reported one stands for all (one machine)."""
    env = next((r["environment"] for r in results if r.get("environment")), {})
    for r in results:
        r.pop("environment", None)
    report = dict(date=time.strftime("%Y-%m-%d %H:%M"), command=command, environment=env,
                  warmup=args.warmup, steps=args.steps, seq_len=args.seq_len,
                  fp8_layers=args.fp8_layers, budget_min=args.budget_min, probes=probes,
                  results=results)
    with open(os.path.join(args.out, "results.json"), "w") as fh:
        json.dump(report, fh, indent=1)
    probe_lines = "".join(f"- probe {p['preset']} ({p['precision']}): {probe_text(p)}\n"
                          for p in probes)
    md = (f"# Benchmark {report['date']}\n\n`{report['command']}`\n\n"
          f"Environment: {json.dumps(env)}\n\n{table(results)}\n"
          + (f"\n{probe_lines}" if probe_lines else ""))
    with open(os.path.join(args.out, "results.md"), "w") as fh:
        fh.write(md)
    print("\n" + table(results))
    print(f"\nwrote {args.out}/results.json and {args.out}/results.md "
          f"({(time.time() - t0) / 60:.1f} min)")
