#!/usr/bin/env bash
# The production run: configs/fineweb_edu_fp8.yaml to the end (2 epochs of FineWeb-Edu
# sample-10BT, GPT-2 124M in FP8 through Transformer Engine) on 8×H100, through submit_fp8.sh:
# requeued after a checkpoint whenever the time limit comes near, until it is done.
#
#   sbatch scripts/train_h100_full.sh                    # from the repository root
#   sbatch --nodes=4 scripts/train_h100_full.sh          # 32 GPUs (multinode accelerate config)
#   bash scripts/train_h100_full.sh                      # on a GPU node you are logged into
#   sbatch scripts/train_h100_full.sh --learning_rate=2e-3   # extra keys go to train_fp8.py
#
# The run directory is fixed, runs/fineweb_edu_fp8_h100/ (OUTPUT_DIR overrides it), so that a
# requeued or resubmitted job continues it from its latest checkpoint. Run
# scripts/train_h100_fast.sh first. The environment of submit_fp8.sh applies.
#
#SBATCH --job-name=fp8train-full
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=24:00:00
#SBATCH --output=logs/fp8_train_%j.out
#SBATCH --error=logs/fp8_train_%j.err
#SBATCH --requeue
#SBATCH --signal=B:USR1@120
#SBATCH --open-mode=append

set -uo pipefail

# sbatch runs a spool copy of this file: the repository is the directory sbatch was called
# from (submit from the repository root), or this file's parent when run with bash.
ROOT=${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
if [ ! -f "$ROOT/submit_fp8.sh" ]; then
  echo "error: no submit_fp8.sh in '$ROOT': submit from the repository root" >&2
  exit 2
fi

export CONFIG=${CONFIG:-configs/fineweb_edu_fp8.yaml}
# exec: submit_fp8.sh becomes the batch shell, so SLURM's USR1 reaches its trap
exec bash "$ROOT/submit_fp8.sh" "$@" --output_dir="${OUTPUT_DIR:-runs/fineweb_edu_fp8_h100}"
