#!/usr/bin/env bash
# fp8train on SLURM: one node of 8 GPUs by default, several with --nodes; requeued after a
# checkpoint when the time limit comes near. Extra arguments go to train_fp8.py.
#
#   sbatch submit_fp8.sh                                            # configs/fineweb_edu_fp8.yaml
#   sbatch submit_fp8.sh --max_steps=5000 --output_dir=runs/fw_5k   # any config key
#   sbatch --export=ALL,CONFIG=configs/fineweb_edu_bf16.yaml submit_fp8.sh
#   sbatch --nodes=4 submit_fp8.sh                                  # 32 GPUs
#   sbatch --export=ALL,SWEEP_ID=entity/project/abc123 submit_fp8.sh   # a W&B sweep agent
#   bash submit_fp8.sh --max_steps=100                              # no SLURM: this machine's GPUs
#   GPUS_PER_NODE=0 CONFIG=configs/test_fp8.yaml bash submit_fp8.sh # CPU, one process (laptop, CI)
#
# Submit from the repository root (logs/ is relative to it). Environment (all optional):
#   CONFIG         run config (configs/fineweb_edu_fp8.yaml)
#   ACCEL_CONFIG   accelerate config (accelerate_configs/8xh100.yaml; multinode_8xh100.yaml on
#                  several nodes; cpu.yaml when GPUS_PER_NODE=0)
#   GPUS_PER_NODE  training processes per node (the GPUs SLURM allocated, else 8); 0 = CPU
#   MASTER_ADDR    rendezvous host, several nodes (the job's first node, as SLURM names it)
#   MASTER_PORT    rendezvous port on it (derived from the job id)
#   MAX_REQUEUES   how often a job may requeue itself (20)
#   SWEEP_ID       run `run_sweep.py agent SWEEP_ID` instead of one training run;
#   SWEEP_COUNT    ... for at most this many trials
#   PYTHON         interpreter with fp8train installed (python3)
#
# Preemption: SLURM sends USR1 120 s before the time limit (--signal=B:USR1@120), or by hand:
# `scancel --signal=USR1 --batch JOBID` (use --batch: it signals this script only). The script
# passes USR1 once to each training process (not to the launchers, which would die of it); the
# trainer finishes its step, saves a checkpoint and exits 3; the job then requeues itself and
# the next run continues from that checkpoint (--resume=auto). Exit 0 (done) or a failure is
# never requeued, nor is a job that has requeued MAX_REQUEUES times.
#
#SBATCH --job-name=fp8train
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
# Site-specific (remove one '#' to use): partition, account, whole nodes with all their memory.
##SBATCH --partition=gpu
##SBATCH --account=myproject
##SBATCH --exclusive
##SBATCH --mem=0

set -uo pipefail   # not -e: the exit codes of training and of `wait` are handled below

# --- site setup (uncomment what your cluster needs) -------------------------------------------
# module load cuda/12.4 nccl
# source "$HOME/venvs/fp8train/bin/activate"     # or: conda activate fp8train
#
# NCCL / PyTorch distributed (NCCL's "Environment Variables" and PyTorch's "ProcessGroupNCCL
# Environment Variables" pages). System configuration:
# export NCCL_SOCKET_IFNAME=ib0     # interface for bootstrap/socket traffic (default: no lo/docker)
# export NCCL_IB_HCA=mlx5           # InfiniBand adapters to use (`ibv_devices` lists them)
# export NCCL_IB_DISABLE=1          # no InfiniBand between the nodes: TCP sockets
# export TORCH_NCCL_ASYNC_ERROR_HANDLING=1   # a failed or timed-out collective aborts NCCL and
#                                            # ends the process (default 3: ends it, no abort)
# Debugging only (remove once solved):
# export NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET   # a hang at start: topology, transports
# export TORCH_NCCL_TRACE_BUFFER_SIZE=2000 TORCH_NCCL_DUMP_ON_TIMEOUT=1   # flight recorder dump
# export TORCH_DISTRIBUTED_DEBUG=DETAIL   # check that all ranks call the same collectives (slow)

log() { echo "[submit_fp8 $(date '+%F %T')] $*" >&2; }

# --- where things are --------------------------------------------------------------------------
# Under sbatch this file runs from a copy in SLURM's spool directory: the repository is then
# where the submitted script is (the job's Command), else the directory sbatch was called from.
mkdir -p logs   # --output/--error are relative to the job's working directory
submitted=""
if [ -n "${SLURM_JOB_ID:-}" ]; then
  submitted=$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null |
              sed -n 's/^ *Command=\([^ ]*\).*/\1/p')
fi
ROOT=""
for dir in "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)" "${submitted%/*}" \
           "${SLURM_SUBMIT_DIR:-}" "$PWD"; do
  if [ -n "$dir" ] && [ -f "$dir/train_fp8.py" ]; then ROOT=$(cd "$dir" && pwd); break; fi
done
if [ -z "$ROOT" ]; then
  log "error: cannot find the repository (train_fp8.py): submit from the repository root"
  exit 2
fi
cd "$ROOT" || exit 2

NNODES=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
RESTARTS=${SLURM_RESTART_COUNT:-0}
MAX_REQUEUES=${MAX_REQUEUES:-20}
CONFIG=${CONFIG:-configs/fineweb_edu_fp8.yaml}
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
PYTHON=${PYTHON:-python3}
if [ -z "${ACCEL_CONFIG:-}" ]; then
  if [ "$GPUS_PER_NODE" = 0 ]; then ACCEL_CONFIG=accelerate_configs/cpu.yaml
  elif [ "$NNODES" -gt 1 ]; then ACCEL_CONFIG=accelerate_configs/multinode_8xh100.yaml
  else ACCEL_CONFIG=accelerate_configs/8xh100.yaml
  fi
fi
MASTER_PORT=${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-9500} % 10000))}
export PYTHONUNBUFFERED=1   # log lines reach logs/*.out as they are printed

case $GPUS_PER_NODE in
  '' | *[!0-9]*) log "error: GPUS_PER_NODE must be a number, not '$GPUS_PER_NODE'"; exit 2 ;;
esac
if [ ! -f "$ACCEL_CONFIG" ] || { [ -z "${SWEEP_ID:-}" ] && [ ! -f "$CONFIG" ]; }; then
  log "error: $CONFIG or $ACCEL_CONFIG not found (relative to $ROOT)"
  exit 2
fi
if [ "$GPUS_PER_NODE" = 0 ] && [ "$NNODES" -gt 1 ]; then
  log "error: CPU mode (GPUS_PER_NODE=0) runs one process on one node, not $NNODES nodes"
  exit 2
fi
if [ -n "${SWEEP_ID:-}" ] && [ "$NNODES" -gt 1 ]; then
  log "error: a sweep agent runs its trials on one node: submit one single-node job per agent"
  exit 2
fi

# The environment, checked once here: a package missing would otherwise end every training
# process (on every node) in a traceback.
if ! command -v "$PYTHON" >/dev/null 2>&1; then
  log "error: PYTHON=$PYTHON not found: set PYTHON to the interpreter of the environment" \
      "where fp8train is installed (pip install -e .)"
  exit 2
fi
need=(torch accelerate yaml numpy safetensors fp8train)
[ -n "${SWEEP_ID:-}" ] && need+=(wandb)
# shellcheck disable=SC2016
if ! missing=$("$PYTHON" -c '
import importlib, sys
missing = []
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception as e:  # not installed, or installed but broken
        missing.append(name if isinstance(e, ImportError) else f"{name} ({type(e).__name__})")
print(", ".join(missing))
sys.exit(1 if missing else 0)' "${need[@]}" 2>/dev/null); then
  log "error: $PYTHON cannot import ${missing:-its packages}: run \`pip install -e .\` from" \
      "$ROOT in the environment training should use, or set PYTHON to that environment's" \
      "python (e.g. PYTHON=\$HOME/venvs/fp8train/bin/python)"
  exit 2
fi

# Every process this script starts carries this tag in its environment: the stop signal goes to
# the training processes that have it, on every node, and to nothing else.
FP8TRAIN_LAUNCH_TAG="${SLURM_JOB_ID:-local}.${RESTARTS}.$$.$(date +%s)"

# --- the launcher ---------------------------------------------------------------------------------
# `accelerate launch`, with one difference: the training processes' exit code comes back.
# accelerate itself exits 1 whenever training exits non-zero, so 3 (stopped after a checkpoint)
# would look like a crash. Any process exiting 3 means the checkpoint is complete (the trainer
# exits only after the save's final barrier); torchrun may SIGTERM the others as it tears down.
read -r -d '' LAUNCH_PY <<'PY'
import subprocess, sys
from accelerate.commands.launch import launch_command, launch_command_parser
args = launch_command_parser().parse_args(sys.argv[1:])
try:
    launch_command(args)
except subprocess.CalledProcessError as e:  # one process: its own exit code
    code = e.returncode
except Exception as e:  # torch.distributed.elastic ChildFailedError: one code per process
    failures = getattr(e, "failures", None)
    if not failures:
        raise
    codes = sorted({f.exitcode for f in failures.values()})
    print(f"launcher: training processes exited with {codes}", file=sys.stderr)
    code = 3 if 3 in codes else next((c for c in codes if c > 0), codes[0])
else:
    code = 0
sys.exit(code if code >= 0 else 128 - code)  # killed by signal N: 128 + N, as a shell says
PY

accel_args=(--config_file "$ACCEL_CONFIG" --main_process_port "$MASTER_PORT")
if [ "$GPUS_PER_NODE" = 0 ]; then
  accel_args+=(--cpu --num_processes 1)
  # torch's CPU threads: OMP_NUM_THREADS if set, else the CPUs SLURM gave the task
  threads=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-}}
  [ -n "$threads" ] && accel_args+=(--num_cpu_threads_per_process "$threads")
elif [ "$NNODES" -gt 1 ]; then
  MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}
  accel_args+=(--num_machines "$NNODES" --num_processes "$((NNODES * GPUS_PER_NODE))"
               --main_process_ip "$MASTER_ADDR" --rdzv_backend c10d)
else
  accel_args+=(--num_machines 1 --num_processes "$GPUS_PER_NODE")
fi

# A requeued run always continues from the latest checkpoint; the first run starts fresh in an
# empty output_dir (auto finds nothing) and lets an explicit --resume in the arguments win.
if [ "$RESTARTS" -gt 0 ]; then
  train_args=(--config "$CONFIG" "$@" --resume=auto)
else
  train_args=(--config "$CONFIG" --resume=auto "$@")
fi

# --- the processes on each node -------------------------------------------------------------------
# One node's share of the run: this node's accelerate launcher, with machine_rank = the node's
# own SLURM_NODEID (so it is read here, inside the srun task; node 0 is the first of the list).
# If this node's training fails (anything but 0, or 3 = stopped after a checkpoint), the other
# nodes would wait in their next collective until it times out: cancel the step on every node
# instead. (srun's --kill-on-bad-exit would also fire when the first node exits 3 while the
# others are still finishing a clean stop.) Self-contained: it runs on every node through srun.
fp8_node_task() {
  local py=$1 code=$2 rc
  shift 2
  if [ "${SLURM_NNODES:-1}" -gt 1 ]; then
    # node 0 hosts the rendezvous store (at MASTER_ADDR:MASTER_PORT); the others only connect,
    # and wait for it if they start first
    set -- --machine_rank "$SLURM_NODEID" \
      --rdzv_conf "is_host=$([ "$SLURM_NODEID" = 0 ] && echo 1 || echo 0)" "$@"
  fi
  "$py" -c "$code" "$@"
  rc=$?
  if [ "$rc" != 0 ] && [ "$rc" != 3 ] && [ "${SLURM_NNODES:-1}" -gt 1 ]; then
    echo "[submit_fp8] ${SLURMD_NODENAME:-$(hostname -s)}: training failed here (exit $rc):" \
         "ending step $SLURM_JOB_ID.$SLURM_STEP_ID on every node" >&2
    scancel "$SLURM_JOB_ID.$SLURM_STEP_ID"
  fi
  return "$rc"
}

# --- stop signals ---------------------------------------------------------------------------------
# Send signal $1 exactly once to every training process on this node (this SLURM node, when
# SLURMD_NODENAME is set) whose environment carries tag $2: a python process running
# train_fp8.py -- not accelerate, torchrun or a sweep agent, which would die of USR1, and not the
# trainer's own forked children. A process gets it only once it catches it (SigCgt in
# /proc/PID/status): one still starting up would be killed by it, so it is waited for. A
# second signal would make the trainer exit at once without a checkpoint: never sent. Gives up
# after $3 seconds. Self-contained: it runs on every node through srun.
fp8_signal_trainers() {
  local sig=$1 tag=$2 timeout=$3 signum bit deadline p pid ppid arg i mask found pending
  local -A sent=() match=() parent=()
  local -a argv
  signum=$(kill -l "$sig") || return 2
  bit=$((1 << (signum - 1)))
  deadline=$((SECONDS + timeout))
  while :; do
    match=() parent=()
    for p in /proc/[0-9]*; do
      pid=${p#/proc/}
      grep -qzxF "FP8TRAIN_LAUNCH_TAG=$tag" "$p/environ" 2>/dev/null || continue
      if [ -n "${SLURMD_NODENAME:-}" ]; then
        grep -qzxF "SLURMD_NODENAME=$SLURMD_NODENAME" "$p/environ" 2>/dev/null || continue
      fi
      mapfile -d '' -t argv < "$p/cmdline" 2>/dev/null || continue
      [[ ${#argv[@]} -ge 2 && ${argv[0]##*/} == python* ]] || continue
      i=1
      while [[ $i -lt ${#argv[@]} && ${argv[i]} == -* ]]; do
        arg=${argv[i]}
        [[ $arg == -c || $arg == -m ]] && continue 2           # code or module: not the trainer
        [[ $arg == -X || $arg == -W ]] && i=$((i + 1))          # options with a value
        i=$((i + 1))
      done
      [[ $i -lt ${#argv[@]} && ${argv[i]##*/} == train_fp8.py ]] || continue
      ppid=$(awk '/^PPid:/ {print $2}' "$p/status" 2>/dev/null) || continue
      match[$pid]=1
      parent[$pid]=$ppid
    done
    found=0 pending=0
    for pid in "${!match[@]}"; do
      [[ -n ${match[${parent[$pid]}]:-} ]] && continue   # a fork of a trainer, not a trainer
      found=1
      [[ -n ${sent[$pid]:-} ]] && continue
      mask=$(awk '/^SigCgt:/ {print $2}' "/proc/$pid/status" 2>/dev/null) || mask=""
      if [[ -n $mask ]] && (( 16#$mask & bit )); then
        kill -s "$sig" "$pid" 2>/dev/null &&
          echo "[submit_fp8] ${SLURMD_NODENAME:-$(hostname -s)}: sent SIG$sig to training" \
               "process $pid" >&2
        sent[$pid]=1
      else
        pending=1
      fi
    done
    if [[ $found == 1 && $pending == 0 ]]; then return 0; fi
    if (( SECONDS >= deadline )); then
      echo "[submit_fp8] ${SLURMD_NODENAME:-$(hostname -s)}: no training process took SIG$sig" \
           "within ${timeout}s" >&2
      return 1
    fi
    sleep 1
  done
}

got_usr1=0 got_term=0 train_pid="" forward_pid="" sweep_mode=0 in_slurm=0
[ -n "${SWEEP_ID:-}" ] && sweep_mode=1
[ -n "${SLURM_JOB_ID:-}" ] && in_slurm=1

# Pass a stop on, in the background (the training processes may still be starting).
forward_stop() {
  local sig=$1
  [ -n "$train_pid" ] || return 0   # not started yet: the launch below passes it on
  if [ "$sweep_mode" = 1 ]; then
    # A stopped trial would only make the agent start the next one: stop the agent itself
    # (on SIGTERM it stops its running trial, whose trainer saves a checkpoint, and exits 130).
    kill -TERM "$train_pid" 2>/dev/null
    return 0
  fi
  if [ "$in_slurm" = 1 ]; then
    # one task on every node of the job, sharing the training step's resources
    # shellcheck disable=SC2016
    srun --overlap --nodes="$NNODES" --ntasks-per-node=1 --cpus-per-task=1 --kill-on-bad-exit=0 \
      bash -c "$(declare -f fp8_signal_trainers)"'; fp8_signal_trainers "$@"' fp8_signal_trainers \
      "$sig" "$FP8TRAIN_LAUNCH_TAG" 600 &
  else
    fp8_signal_trainers "$sig" "$FP8TRAIN_LAUNCH_TAG" 600 &
  fi
  forward_pid=$!
}

# shellcheck disable=SC2317  # trap handlers: shellcheck 0.9 takes them for unreachable code
on_usr1() {
  if [ "$got_usr1" = 1 ]; then log "USR1 again: already stopping"; return; fi
  got_usr1=1
  log "USR1: asking training to save a checkpoint and stop"
  forward_stop USR1
}
# shellcheck disable=SC2317
on_term() {
  got_term=1
  if [ "$in_slurm" = 1 ]; then
    # SLURM signals every process of the job itself (time limit, scancel, preemption)
    log "SIG$1: SLURM is ending the job; waiting for training to exit"
  elif [ "$1" = INT ]; then
    # Ctrl-C: the terminal has sent SIGINT to the trainer as well
    log "SIGINT: waiting for training to save a checkpoint and exit"
  else
    log "SIG$1: passing it to training"
    forward_stop "$1"
  fi
}
trap on_usr1 USR1
trap 'on_term TERM' TERM
trap 'on_term INT' INT

# --- run ------------------------------------------------------------------------------------------
log "job ${SLURM_JOB_ID:-(no SLURM)} restart $RESTARTS on $NNODES node(s)" \
    "${SLURM_JOB_NODELIST:+($SLURM_JOB_NODELIST) }from $ROOT"
export FP8TRAIN_LAUNCH_TAG
if [ "$sweep_mode" = 1 ]; then
  cmd=("$PYTHON" run_sweep.py agent "$SWEEP_ID")
  if [ -n "${SWEEP_COUNT:-}" ]; then cmd+=(--count "$SWEEP_COUNT"); fi
  if [ "$GPUS_PER_NODE" -gt 1 ]; then cmd+=(--accelerate_config "$ACCEL_CONFIG"); fi
  cmd+=("$@")
  log "sweep agent: ${cmd[*]}"
  "${cmd[@]}" &
elif [ "$in_slurm" = 1 ]; then
  log "accelerate launch ${accel_args[*]} train_fp8.py ${train_args[*]}" \
      "(on each node, through srun)"
  # shellcheck disable=SC2016
  srun --nodes="$NNODES" --ntasks-per-node=1 --kill-on-bad-exit=0 \
    ${SLURM_CPUS_PER_TASK:+--cpus-per-task="$SLURM_CPUS_PER_TASK"} \
    bash -c "$(declare -f fp8_node_task)"'; fp8_node_task "$@"' fp8_node_task \
    "$PYTHON" "$LAUNCH_PY" "${accel_args[@]}" train_fp8.py "${train_args[@]}" &
else
  log "accelerate launch ${accel_args[*]} train_fp8.py ${train_args[*]}"
  fp8_node_task "$PYTHON" "$LAUNCH_PY" "${accel_args[@]}" train_fp8.py "${train_args[@]}" &
fi
train_pid=$!
[ "$got_usr1" = 1 ] && forward_stop USR1   # a signal that came before the launch

# A trapped signal interrupts `wait` (status > 128) while training goes on: wait again.
while :; do
  wait "$train_pid"
  rc=$?
  if [ "$rc" -gt 128 ] && kill -0 "$train_pid" 2>/dev/null; then continue; fi
  break
done
if [ "$rc" -gt 128 ]; then   # wait may have been interrupted just as training ended
  wait "$train_pid" 2>/dev/null
  r=$?
  [ "$r" = 127 ] || rc=$r
fi
train_pid=""   # from here on a late USR1 has nothing to stop
if [ -n "$forward_pid" ] && kill -0 "$forward_pid" 2>/dev/null; then
  kill "$forward_pid" 2>/dev/null
fi
wait 2>/dev/null   # the forwarder, if any

# --- requeue --------------------------------------------------------------------------------------
stopped_rc=3
[ "$sweep_mode" = 1 ] && stopped_rc=130   # the agent, interrupted by our SIGTERM
if [ "$got_usr1" = 1 ] && [ "$rc" = "$stopped_rc" ] && [ "$got_term" = 0 ]; then
  if [ "$in_slurm" = 0 ]; then
    log "stopped after a checkpoint (exit $rc): run the same command again to continue"
    exit 3
  fi
  if [ "$RESTARTS" -ge "$MAX_REQUEUES" ]; then
    log "stopped after a checkpoint (exit $rc); NOT requeued: $RESTARTS requeues done" \
        "(MAX_REQUEUES=$MAX_REQUEUES). Resubmit to continue."
    exit 3
  fi
  log "stopped after a checkpoint (exit $rc): requeueing job $SLURM_JOB_ID" \
      "(restart $((RESTARTS + 1)) of at most $MAX_REQUEUES)"
  if scontrol requeue "$SLURM_JOB_ID"; then
    exit 0
  fi
  log "error: scontrol requeue failed; resubmit to continue"
  exit 3
fi
if [ "$got_usr1" = 1 ]; then
  case $rc in
    0) log "training finished (exit 0) before it could stop: not requeued" ;;
    *) log "training exited $rc after USR1 (a clean stop is $stopped_rc): not requeued" ;;
  esac
else
  log "training exited $rc"
fi
exit "$rc"
