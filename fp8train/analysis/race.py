"""The README demo against nanoGPT's documented CPU recipe, on the same machine, one after the
other (scripts/race_nanogpt.py): each one's validation loss against wall-clock time.

nanoGPT (a checkout of github.com/karpathy/nanoGPT, given by its path: it is never part of
fp8train) trains shakespeare_char with the command of its README for a CPU: 4 layers, 4 heads,
d=128, block 64, batch 12, 2,000 iterations, LR 1e-3 with warmup and cosine decay, AdamW, fp32,
no dropout, no compile. Its corpus is our tinyshakespeare.txt (prepare.py does not download
when input.txt is there), and both split it the same way: the last 10% of the characters (bytes:
the text is ASCII) for validation. fp8train trains the demo config as the README runs it.

Time runs from each process's start and is read off its own output lines as they arrive (an
evaluation line is stamped when it is printed, so its time includes the evaluations and
checkpoints before it, as a user waiting for the number experiences it). Each tool reports its
own validation loss (nanoGPT: 20 random batches; fp8train: eval_sequences fixed windows); both
final models are also scored on the same windows, every non-overlapping block of 64 bytes of the
validation split, by `whole_val_loss` here (nanoGPT's model through its own model.py). The
verdict: fp8train's last evaluation at or before the time nanoGPT finished, against nanoGPT's
final loss, on the whole-split scores of the two final models when both finished."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

from ..errors import BadInput

NANOGPT_ARGS = ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False",
                "--eval_iters=20", "--log_interval=1", "--block_size=64", "--batch_size=12",
                "--n_layer=4", "--n_head=4", "--n_embd=128", "--max_iters=2000",
                "--lr_decay_iters=2000", "--dropout=0.0", "--always_save_checkpoint=True"]
NANOGPT_EVAL = re.compile(r"^step (\d+): train loss ([\d.]+), val loss ([\d.]+)")
OURS_EVAL = re.compile(r"eval step ([\d,]+): val/loss ([\d.]+)")
WINDOW = 64

# Run inside nanoGPT's checkout with its model.py: the mean loss of its checkpoint over every
# non-overlapping window of WINDOW + 1 tokens of val.bin (argv: checkpoint, val.bin, window).
NANOGPT_WHOLE_VAL = r"""
import sys, numpy as np, torch
from model import GPT, GPTConfig
ck = torch.load(sys.argv[1], map_location="cpu", weights_only=False)
m = GPT(GPTConfig(**ck["model_args"]))
sd = {k.removeprefix("_orig_mod."): v for k, v in ck["model"].items()}
m.load_state_dict(sd); m.eval()
data = np.fromfile(sys.argv[2], dtype=np.uint16).astype(np.int64)
w = int(sys.argv[3]); n = (len(data) - 1) // w
x = torch.from_numpy(data[:n * w]).view(n, w); y = torch.from_numpy(data[1:n * w + 1]).view(n, w)
tot = 0.0
with torch.no_grad():
    for i in range(0, n, 64):
        logits, _ = m(x[i:i + 64], y[i:i + 64])
        tot += torch.nn.functional.cross_entropy(logits.flatten(0, 1), y[i:i + 64].flatten(),
                                                 reduction="sum").item()
print(tot / (n * w))
"""


def timed_run(cmd: list, cwd: str, pattern: re.Pattern, log, env=None) -> dict:
    """Run `cmd`; (seconds since start, step, val loss) of each evaluation line matching
    `pattern`, the total seconds and the exit code."""
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)
    points, tail = [], []
    for line in proc.stdout:
        tail = (tail + [line])[-20:]
        m = pattern.search(line)
        if m:
            points.append((round(time.time() - t0, 2), int(m.group(1).replace(",", "")),
                           float(m.group(m.lastindex))))
            log(f"  {points[-1][0]:7.1f} s  step {points[-1][1]:>5}  val loss {points[-1][2]:.4f}")
    code = proc.wait()
    return {"points": points, "seconds": round(time.time() - t0, 2), "exit_code": code,
            "tail": "".join(tail)}


def prepare_nanogpt(nanogpt: str, corpus: str, log) -> str:
    """nanoGPT's shakespeare_char data from our corpus; returns its val.bin."""
    if not os.path.isfile(os.path.join(nanogpt, "train.py")):
        raise BadInput(f"--nanogpt: '{nanogpt}' is not a nanoGPT checkout (no train.py)")
    data = os.path.join(nanogpt, "data", "shakespeare_char")
    if not os.path.isfile(os.path.join(data, "input.txt")):
        shutil.copyfile(corpus, os.path.join(data, "input.txt"))
    if not os.path.isfile(os.path.join(data, "val.bin")):
        log("nanoGPT: preparing shakespeare_char from tinyshakespeare.txt")
        subprocess.run([sys.executable, "prepare.py"], cwd=data, check=True,
                       capture_output=True, text=True)
    return os.path.join(data, "val.bin")


def at_time(points: list, seconds: float):
    """The last (seconds, step, loss) at or before `seconds`, or None."""
    before = [p for p in points if p[0] <= seconds]
    return before[-1] if before else None


def race(nanogpt: str, config: str, out: str, corpus: str, log=print, extra=()) -> dict:
    """Both runs, one after the other, and the verdict; writes OUT/race.json and race.md."""
    os.makedirs(out, exist_ok=True)
    val_bin = prepare_nanogpt(nanogpt, corpus, log)
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    n_out = os.path.abspath(os.path.join(out, "nanogpt"))
    log(f"nanoGPT: python train.py {' '.join(NANOGPT_ARGS)}")
    theirs = timed_run([sys.executable, "train.py", *NANOGPT_ARGS, f"--out_dir={n_out}"],
                       nanogpt, NANOGPT_EVAL, log)
    o_out = os.path.abspath(os.path.join(out, "fp8train"))
    shutil.rmtree(o_out, ignore_errors=True)
    cmd = [sys.executable, "train_fp8.py", "--config", config, "--output_dir", o_out, *extra]
    log(f"fp8train: {' '.join(cmd[1:])}")
    ours = timed_run(cmd, here, OURS_EVAL, log,
                     env=dict(os.environ, FP8TRAIN_DATA_DIR=os.path.dirname(corpus)))
    result = {"nanogpt": theirs, "fp8train": ours, "window": WINDOW}
    for name, r in (("nanogpt", theirs), ("fp8train", ours)):
        if r["exit_code"] != 0:
            raise BadInput(f"{name} failed (exit {r['exit_code']}):\n{r['tail']}")
    result["whole_val"] = {
        "nanogpt": float(subprocess.run(
            [sys.executable, "-c", NANOGPT_WHOLE_VAL, os.path.join(n_out, "ckpt.pt"), val_bin,
             str(WINDOW)], cwd=nanogpt, check=True, capture_output=True,
            text=True).stdout.split()[-1]),
        "fp8train": whole_val_loss(o_out, corpus)}
    end = theirs["seconds"]
    mine = at_time(ours["points"], end)
    result["verdict"] = {
        "nanogpt_seconds": end, "nanogpt_val_loss": theirs["points"][-1][2],
        "fp8train_at_that_time": mine, "fp8train_seconds": ours["seconds"],
        "fp8train_val_loss": ours["points"][-1][2],
        "no_worse_at_equal_time": bool(mine and ours["seconds"] <= end and
                                       result["whole_val"]["fp8train"] <=
                                       result["whole_val"]["nanogpt"])}
    with open(os.path.join(out, "race.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    with open(os.path.join(out, "race.md"), "w") as fh:
        fh.write(report(result))
    log(report(result))
    return result


def whole_val_loss(run_dir: str, corpus: str) -> float:
    """The run's final model over every non-overlapping window of WINDOW + 1 bytes of the last
    10% of `corpus` (nanoGPT's validation split), in fp32."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from ..evaluate import trained
    t = trained.load(run_dir, "cpu", warn=lambda m: None, info=lambda m: None)
    data = np.frombuffer(open(corpus, "rb").read(), dtype=np.uint8).astype(np.int64)
    data = data[int(len(data) * 0.9):]
    n = (len(data) - 1) // WINDOW
    x = torch.from_numpy(data[:n * WINDOW]).view(n, WINDOW)
    y = torch.from_numpy(data[1:n * WINDOW + 1]).view(n, WINDOW)
    total = 0.0
    with torch.no_grad():
        for i in range(0, n, 64):
            logits = t.model(x[i:i + 64])[..., :t.mcfg.vocab_size].float()
            total += F.cross_entropy(logits.flatten(0, 1), y[i:i + 64].flatten(),
                                     reduction="sum").item()
    return total / (n * WINDOW)


def report(r: dict) -> str:
    v = r["verdict"]
    mine = v["fp8train_at_that_time"]
    lines = ["| | nanoGPT (CPU recipe) | fp8train demo |", "| --- | --- | --- |",
             f"| wall clock, start to exit | {v['nanogpt_seconds']:.0f} s | "
             f"{v['fp8train_seconds']:.0f} s |",
             f"| own final val loss | {v['nanogpt_val_loss']:.4f} | {v['fp8train_val_loss']:.4f} |",
             f"| val loss, every {r['window']}-byte window of the split | "
             f"{r['whole_val']['nanogpt']:.4f} | {r['whole_val']['fp8train']:.4f} |",
             f"| fp8train at nanoGPT's finish ({v['nanogpt_seconds']:.0f} s) | | " +
             (f"{mine[2]:.4f} (step {mine[1]}, {mine[0]:.0f} s) |" if mine else "no eval yet |"),
             "", "Curves (seconds from start, step, val loss):", ""]
    for name in ("nanogpt", "fp8train"):
        lines.append(f"- {name}: " + ", ".join(f"{s:.0f} s {loss:.3f}"
                                               for s, _, loss in r[name]["points"]))
    verdict = "no worse" if v["no_worse_at_equal_time"] else "WORSE"
    lines += ["", f"fp8train {verdict} than nanoGPT at equal wall time."]
    return "\n".join(lines) + "\n"
