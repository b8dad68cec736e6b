#!/usr/bin/env python3
"""Data pipeline throughput, printed as numbers.

  python scripts/bench_data.py                      # loader on a 1-GB shard + prepare speed
  python scripts/bench_data.py --loader_tokens 100000000 --prepare_mb 20

Loader: one shard of --loader_tokens uint16 tokens (500M = 1 GB) written to a temporary
directory, memory-mapped, and read as training windows (seq_len 1024, micro-batch 64, the same
sampler and window gather as training) by one process, then by 2 worker processes at once.
Prepare: scripts/prepare_data.py's pipeline on --prepare_mb of synthetic .jsonl documents with
the byte tokenizer (and gpt2 via tiktoken when installed), 1 and 2 processes.
"""
import argparse
import json
import multiprocessing as mp
import os
import tempfile
import time

import numpy as np


def _read(path, seq_len, micro, seconds, seed, out):
    from fp8train.data.shards import open_shard
    from fp8train.data.windows import RandomWindows, ShardedTokens
    sampler = RandomWindows(ShardedTokens([open_shard(path)]), seq_len, seed)
    sampler.batch(0, micro)
    n, pos, t0 = 0, 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        x, _ = sampler.batch(pos, micro)
        n += x.numel()
        pos += micro
    out.put(n / (time.perf_counter() - t0))


def bench_loader(tokens, seq_len, micro, seconds, workdir):
    from fp8train.data.shards import write_shard
    path = os.path.join(workdir, "bench_000000.bin")
    rng = np.random.default_rng(0)
    chunk = 50_000_000
    arr = np.empty(tokens, dtype=np.uint16)
    for i in range(0, tokens, chunk):
        arr[i:i + chunk] = rng.integers(0, 50257, size=min(chunk, tokens - i), dtype=np.uint16)
    write_shard(path, arr, 50257, "gpt2")
    del arr
    size_gb = os.path.getsize(path) / 1e9
    for workers in (1, 2):
        q = mp.get_context("spawn").Queue()
        procs = [mp.get_context("spawn").Process(target=_read, args=(path, seq_len, micro,
                                                                     seconds, w, q))
                 for w in range(workers)]
        for p in procs:
            p.start()
        rates = [q.get() for _ in procs]
        for p in procs:
            p.join()
        print(f"loader: {workers} process{'es' if workers > 1 else ''}, shard {size_gb:.2f} GB, "
              f"seq_len {seq_len}, micro {micro}: {sum(rates) / 1e6:,.1f} M tokens/s "
              f"({', '.join(f'{r / 1e6:,.1f}' for r in rates)} per process)")


def bench_prepare(mb, workdir):
    from fp8train.data.prepare import PrepareArgs, prepare
    src = os.path.join(workdir, "docs.jsonl")
    rng = np.random.default_rng(0)
    words = np.array("the of and to in a is that for it as was with be by on not he this "
                     "are or his from at which but have an they you were her she there "
                     "one all we can their has been if more when will would who so no".split())
    written = 0
    with open(src, "w") as fh:
        while written < mb * 1e6:
            line = json.dumps({"text": " ".join(rng.choice(words, size=int(rng.integers(50,
                                                                                         800))))})
            fh.write(line + "\n")
            written += len(line) + 1
    tokenizers = ["byte"]
    try:
        import tiktoken
        tiktoken.get_encoding("gpt2")
        tokenizers.append("gpt2")
    except Exception:
        print("prepare: gpt2 via tiktoken not available here (no tiktoken or no BPE file); "
              "byte tokenizer only")
    for tok in tokenizers:
        for procs in (1, 2):
            out = os.path.join(workdir, f"out_{tok}_{procs}")
            t0 = time.perf_counter()
            meta = prepare(PrepareArgs(dataset=src, output_dir=out, tokenizer=tok,
                                       num_proc=procs, val_tokens=100_000), log=lambda m: None)
            dt = time.perf_counter() - t0
            n = meta["splits"]["train"]["tokens"] + meta["splits"]["val"]["tokens"]
            print(f"prepare: {mb} MB of .jsonl, tokenizer {tok}, {procs} process"
                  f"{'es' if procs > 1 else ''}: {n / dt / 1e6:,.2f} M tokens/s "
                  f"({n / dt / procs / 1e6:,.2f} M per process), {dt:.1f} s end to end")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--loader_tokens", type=int, default=500_000_000)
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--micro", type=int, default=64)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--prepare_mb", type=float, default=50)
    p.add_argument("--skip_prepare", action="store_true")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        bench_loader(a.loader_tokens, a.seq_len, a.micro, a.seconds, d)
    if not a.skip_prepare:
        with tempfile.TemporaryDirectory() as d:
            bench_prepare(a.prepare_mb, d)


if __name__ == "__main__":
    import sys

    from fp8train.observe.console import run_main  # a closed stdout (| head): no traceback
    sys.exit(run_main(main))
