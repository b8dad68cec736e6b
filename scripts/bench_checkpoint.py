#!/usr/bin/env python3
"""Checkpoint save time, synchronous against background (`checkpoint_async: true`), for a model
preset's parameter count on this machine: fp32 weights and AdamW's two moments, written by the
trainer's own CheckpointManager (manifest with SHA-256s, fsync, rename, `latest`) into --out.

    python scripts/bench_checkpoint.py                                 # llama-350m, 2 saves each
    python scripts/bench_checkpoint.py --preset llama-1b --out /scratch/ckpt-bench --repeats 3

For each save: `blocked_s`, how long training waits (sync: the whole save; async: the copy into
host memory and the small files), and `save_s`, from the start to the published checkpoint (for
async, the background thread's end). The first async save allocates its host buffers (pinned on
CUDA), later ones reuse them: both are shown. Nothing trains meanwhile, so the background write
has the machine to itself; during training it shares the CPU (hashing, copying) with the loop.
Writes OUT/results.json and prints a table; the checkpoints are removed unless --keep.
"""
import argparse
import json
import os
import platform
import shutil
import sys
import time


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama-350m", help="model preset [llama-350m]")
    p.add_argument("--vocab", type=int, default=50257, help="vocabulary (GPT-2's) [50257]")
    p.add_argument("--repeats", type=int, default=2, help="saves per mode [2]")
    p.add_argument("--out", default="bench/checkpoint", help="where the checkpoints are "
                   "written (the filesystem measured) [bench/checkpoint]")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    return args


def build(preset: str, vocab: int):
    """The preset's model and a fused AdamW with its state (one step on zero gradients),
    prepared by Accelerate as the trainer prepares them."""
    import torch
    from accelerate import Accelerator

    from fp8train.config.load import Config, section
    from fp8train.model import GPT, model_config_from
    from fp8train.optim.optimizer import build_optimizer
    acc = Accelerator(cpu=not torch.cuda.is_available())
    model = GPT(model_config_from(preset, vocab, 1024)).to(acc.device)
    opt = build_optimizer(model, section(Config(weight_decay=0.1, learning_rate=1e-4, beta1=0.9,
                                                beta2=0.95, adam_eps=1e-8), "optimizer"))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    n_params = model.num_params()
    model, opt = acc.prepare(model, opt)
    return acc, model, opt, n_params


def measure(acc, model, opt, out: str, repeats: int) -> list:
    from fp8train.checkpoint.files import directory_bytes
    from fp8train.checkpoint.host_copy import HostCopy
    from fp8train.checkpoint.manager import CheckpointManager
    from fp8train.checkpoint.train_state import TrainState
    rows, copier = [], HostCopy()
    for mode in ("sync", "async"):
        manager = CheckpointManager(os.path.join(out, mode), keep=1)
        for i in range(1, repeats + 1):
            st = TrainState()
            st.step = i
            t0 = time.perf_counter()
            if mode == "sync":
                path = manager.save(acc, st, "bench\n", {}, started=t0)
                save_s = blocked_s = time.perf_counter() - t0
            else:
                job = manager.save_in_background(acc, st, "bench\n", {}, copier, t0, model,
                                                 opt)
                blocked_s = time.perf_counter() - t0
                error = job.wait()
                if error:
                    raise RuntimeError(error)
                path, save_s = job.path, job.save_s
            size_gb = round(directory_bytes(path) / 1e9, 3)
            rows.append(dict(mode=mode, save=i, blocked_s=round(blocked_s, 2),
                             save_s=round(save_s, 2), size_gb=size_gb))
            print(f"{mode:5} save {i}: training blocked {blocked_s:6.2f} s, published after "
                  f"{save_s:6.2f} s, {rows[-1]['size_gb']:.2f} GB", flush=True)
    return rows


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    import accelerate
    import safetensors
    import torch
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    acc, model, opt, n_params = build(args.preset, args.vocab)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else \
        f"CPU ({os.cpu_count()} cores, {platform.processor() or platform.machine()})"
    print(f"{args.preset}: {n_params / 1e6:.1f}M parameters, fp32 + AdamW state, on {device}; "
          f"checkpoints under {args.out}/", flush=True)
    rows = measure(acc, model, opt, args.out, args.repeats)
    report = dict(date=time.strftime("%Y-%m-%d %H:%M %Z"), preset=args.preset,
                  n_params=n_params, device=device, out=os.path.abspath(args.out),
                  versions=dict(python=platform.python_version(), torch=torch.__version__,
                                accelerate=accelerate.__version__,
                                safetensors=safetensors.__version__),
                  results=rows, minutes=round((time.time() - t0) / 60, 1))
    with open(os.path.join(args.out, "results.json"), "w") as fh:
        json.dump(report, fh, indent=1)
    print("\n| mode | save | training blocked (s) | published after (s) | size (GB) |\n"
          "| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['mode']} | {r['save']} | {r['blocked_s']:.2f} | {r['save_s']:.2f} | "
              f"{r['size_gb']:.2f} |")
    if not args.keep:
        for mode in ("sync", "async"):
            shutil.rmtree(os.path.join(args.out, mode), ignore_errors=True)
    print(f"\nwrote {args.out}/results.json ({report['minutes']} min)")
    return 0


if __name__ == "__main__":
    from fp8train.observe.console import run_main  # a closed stdout (| head): no traceback
    sys.exit(run_main(main))
