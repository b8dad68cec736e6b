#!/usr/bin/env bash
# A short validation run on one 8×H100 node before a long one (a new cluster, new drivers or
# libraries): 200 steps of configs/fineweb_edu_fp8.yaml (GPT-2 124M, FP8 through Transformer
# Engine) through submit_fp8.sh, then a check of its metrics.jsonl: the loss fell, every gradient
# norm is finite, tokens/s was measured, the validation loss is finite. Exit 0 only if all hold.
#
#   sbatch scripts/train_h100_fast.sh                    # from the repository root
#   bash scripts/train_h100_fast.sh                      # on a GPU node you are logged into
#   bash scripts/train_h100_fast.sh --fp8_backend native # extra keys go to train_fp8.py
#   CONFIG=configs/fineweb_edu_bf16.yaml sbatch scripts/train_h100_fast.sh
#
# Each run writes a new directory, runs/h100_fast_<job id or time>/ (OUTPUT_DIR overrides it).
# The environment of submit_fp8.sh (ACCEL_CONFIG, GPUS_PER_NODE, PYTHON, ...) applies.
#
#SBATCH --job-name=fp8train-fast
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=00:30:00
#SBATCH --output=logs/fp8_fast_%j.out
#SBATCH --error=logs/fp8_fast_%j.err

set -uo pipefail

# sbatch runs a spool copy of this file: the repository is the directory sbatch was called
# from (submit from the repository root), or this file's parent when run with bash.
ROOT=${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
if [ ! -f "$ROOT/submit_fp8.sh" ]; then
  echo "error: no submit_fp8.sh in '$ROOT': submit from the repository root" >&2
  exit 2
fi
mkdir -p logs
cd "$ROOT" || exit 2

export CONFIG=${CONFIG:-configs/fineweb_edu_fp8.yaml}
OUTPUT_DIR=${OUTPUT_DIR:-runs/h100_fast_${SLURM_JOB_ID:-$(date +%Y%m%d_%H%M%S)}}
PYTHON=${PYTHON:-python3}

bash "$ROOT/submit_fp8.sh" --max_steps=200 --warmup_steps=20 --eval_interval=100 --log_interval=10 \
  --checkpoint_interval=200 "$@" --output_dir="$OUTPUT_DIR"
rc=$?
if [ "$rc" != 0 ]; then
  echo "FAILED: training exited $rc (see above)" >&2
  exit "$rc"
fi

"$PYTHON" - "$OUTPUT_DIR/metrics.jsonl" <<'PY'
import json, math, statistics, sys

path = sys.argv[1]
rows = []
with open(path, encoding="utf-8") as fh:
    for line in fh:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
train = [r for r in rows if "train/loss" in r]
val = [r for r in rows if "val/loss" in r]
problems = []
if len(train) < 2:
    problems.append(f"only {len(train)} training rows in {path}")
else:
    first, last = train[0]["train/loss"], train[-1]["train/loss"]
    print(f"train/loss: {first:.4f} at step {train[0]['step']} -> {last:.4f} at step "
          f"{train[-1]['step']}")
    if not last < 0.9 * first:
        problems.append(f"the loss did not fall by 10% ({first:.4f} -> {last:.4f})")
bad = [r["step"] for r in train if not math.isfinite(r.get("train/grad_norm", float("nan")))]
if bad:
    problems.append(f"gradient norm not finite (or missing) at steps {bad[:10]}")
tps = [r.get("train/tokens_per_sec") for r in train]
if not tps or any(t is None or not t > 0 for t in tps):
    problems.append("train/tokens_per_sec missing or not positive")
else:
    mfu = [r["train/mfu"] for r in train if "train/mfu" in r]
    print(f"tokens/s: median {statistics.median(tps):,.0f}"
          + (f", MFU median {statistics.median(mfu):.1%}" if mfu else ""))
if not val or not all(math.isfinite(r["val/loss"]) for r in val):
    problems.append("no finite val/loss")
else:
    print("val/loss: " + ", ".join(f"{r['val/loss']:.4f} (step {r['step']})" for r in val))
for p in problems:
    print(f"FAILED: {p}", file=sys.stderr)
if not problems:
    print(f"OK: {path}")
sys.exit(1 if problems else 0)
PY
