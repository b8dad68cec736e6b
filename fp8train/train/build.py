"""Assembly: everything a run needs, built once, in order, and handed to the loop as one `Run`.

Run directory and resume point -> precision and Accelerator -> data -> the run's plan, every
start-up decision (plan.py: the batch plan, fp8 auto's choice, the run's length and schedule)
-> model and optimizer (restored from the checkpoint on resume) -> config.yaml -> W&B and the
loop's components. Each component receives its own section of the config and the plan.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .. import ranks
from . import threads
from ..batch.decide import BatchDecision, new_model, written_plan
from ..batch.plan import BatchPlan
from ..checkpoint.checkpointer import Checkpointer
from ..checkpoint.manager import CheckpointManager
from ..checkpoint.resume import check_config_change, choose_checkpoint, warn_schedule_change
from ..checkpoint.saved_config import config_hash, saved_derived
from ..checkpoint.train_state import TrainState
from ..compile import compile_model, inner_model
from ..config.load import Config, dump_yaml, section, to_dict
from ..data.loader import load_splits
from ..data.tokenizers import build_tokenizer
from ..data.windows import BatchStream, RandomWindows, check_batch_fits, val_batches
from ..errors import BadInput
from ..evaluate.evaluator import EvalRecord, Evaluator
from ..evaluate.evaluator import missed as missed_eval
from ..evaluate.hellaswag import HellaSwag
from ..evaluate.samples import TextSampler
from ..io import writable_dir
from ..hf_model import fresh_weights, model_config
from ..observe.logger import Logger
from ..observe.metrics import Meter, WallClock, device_name, peak_note
from ..observe.profiling import StepProfiler
from ..observe.tracking import Tracker, environment, sweep_run_id
from ..precision import Precision, build_precision
from .fp8_check import LossGapCheck
from .health import Health
from .plan import RunLength, decide
from ..optim.optimizer import build_optimizer, check_distributed
from ..optim.optimizer import describe as describe_optimizer
from ..optim.optimizer import muon_flops_per_step
from .recovery import Recovery
from .signals import Stopper, StopRequests


@dataclass
class Net:
    """What one optimizer step updates, and how."""
    model: Any
    optimizer: Any
    prec: Precision
    health: Health
    loss: Any                 # the config's loss section
    max_norm: float           # gradient clipping (inf: off)
    distributed: Any          # accelerate's DistributedType (a str enum: "FSDP", "MULTI_GPU", ...)
    prepared: Any = None      # the model as Accelerate prepared it, before torch.compile

    @property
    def inner_optimizer(self):
        return getattr(self.optimizer, "optimizer", self.optimizer)

    @property
    def grads_to_none(self) -> bool:
        # DDP keeps gradients as views of its all-reduce buckets (gradient_as_bucket_view) only
        # while they exist: set to None, the next step's no_sync micro-steps would accumulate
        # into fresh tensors, a second copy of every gradient until the syncing micro-step.
        return self.distributed not in ("MULTI_GPU", "MULTI_CPU")

    def optimizer_context(self):
        return implicit_replication() if self.distributed == "FSDP" else \
            contextlib.nullcontext()


def implicit_replication():
    """FSDP2's parameters are DTensors; the fused AdamW's found_inf is a plain 0-d tensor (the
    same value on every rank), which DTensor takes as replicated inside this context."""
    from torch.distributed.tensor.experimental import implicit_replication as replicated
    return replicated()


@dataclass
class Feed:
    """This rank's training data, step by step, and the schedule it follows."""
    windows: RandomWindows    # the training sequences, by data position
    plan: BatchPlan
    sched: RunLength
    lr_args: dict             # lr_at's arguments but the step
    seq_len: int
    rank: int
    device: torch.device
    prefetch: int
    fp8_until_step: Optional[int] = None   # from this step on, the base precision (fp8_until)

    @property
    def tokens_per_step(self) -> int:
        return self.plan.effective * self.seq_len

    def stream(self, position: int) -> BatchStream:
        """Micro-batches from data position `position` (the train state's: bit-exact resume)."""
        plan = self.plan
        return BatchStream(self.windows, position, self.rank * plan.micro * plan.accum,
                           plan.micro, plan.accum, plan.effective,
                           pin=self.device.type == "cuda", depth=self.prefetch)


@dataclass
class Parts:
    """The loop's components, each deciding its own cadence."""
    evaluator: Evaluator
    checkpointer: Checkpointer
    recovery: Recovery
    stopper: Stopper
    meter: Meter
    wall: WallClock
    profiler: StepProfiler
    gap_check: LossGapCheck   # fp8_check_interval


@dataclass
class Run:
    acc: Any                  # the Accelerator
    net: Net
    feed: Feed
    state: TrainState
    log: Logger
    parts: Parts
    facts: dict               # what the end-of-run report needs from the start
    run_dir: str
    eval_pending: bool = False   # the checkpoint's evaluation was abandoned: it comes first


def build(cfg: Config, state, log: Logger, requests: StopRequests) -> Optional[Run]:
    """The assembled run; None when there is nothing to train (--plan_only, or the checkpoint
    already reaches the end). `state`: accelerate's PartialState; `log`: the run's logger (the
    caller writes what ends the run into its train.log); `requests`: the stop signals."""
    from accelerate.utils import set_seed

    written = written_plan(section(cfg, "batch"), state.num_processes)
    run_dir, resume = run_directory(cfg)
    manager = CheckpointManager(run_dir, cfg.keep_checkpoints)
    checkpoint = open_run(cfg, run_dir, resume, manager, log)
    prec, acc = _accelerator(cfg, state, run_dir, log)
    set_seed(cfg.seed)  # the same init on every rank
    splits = load_splits(section(cfg, "data"), log.msg, ranks.on_rank0)
    log.msg(f"data: {splits.source} ({cfg.tokenizer} tokenizer, vocab {splits.vocab_size:,}): "
            f"{len(splits.train):,} train / {len(splits.val):,} val tokens")
    check_batch_fits(cfg, written.effective if written else cfg.target_effective_batch_size,
                     len(splits.train))
    saved = saved_derived(checkpoint) if checkpoint else {}
    mcfg = model_config(cfg, splits.vocab_size, saved=saved)
    prec, run_plan = decide(cfg, prec, acc, mcfg, splits.train, written, saved, run_dir, log)
    batch, plan = run_plan.batch, run_plan.batch.plan
    acc.gradient_accumulation_steps = plan.accum
    feed = Feed(RandomWindows(splits.train, cfg.seq_len, cfg.seed), plan, run_plan.length,
                run_plan.lr_args, cfg.seq_len, acc.process_index, acc.device, cfg.data_prefetch,
                run_plan.fp8_until_step)
    if cfg.plan_only:
        log.msg("plan only (--plan_only): not training")
        return None
    data_id = dict(train_tokens=len(splits.train), val_tokens=len(splits.val),
                   vocab_size=splits.vocab_size)
    run_hash = config_hash({**to_dict(cfg), "data": data_id,
                            "effective_batch_size": plan.effective})
    if checkpoint is not None:
        check_config_change(checkpoint, run_hash, to_dict(cfg),
                            dict(data=data_id, effective_batch_size=plan.effective),
                            cfg.allow_config_change, cfg.where, log)
    net, n_params, flops_per_token = _net(cfg, mcfg, prec, acc, batch, saved, log)
    train_state = TrainState()
    # Same init everywhere (seeded above); from here on dropout masks differ per rank. A resume
    # then restores each rank's RNG state from the checkpoint.
    set_seed(cfg.seed + acc.process_index)
    # What the components carry across a checkpoint, besides the counters: each owns its state.
    components = {"precision": prec, "evaluator": EvalRecord(), "interval": net.health.carried}
    _restore(acc, manager, checkpoint, saved, train_state, components, feed, log)
    derived = _derived(prec, acc, feed, mcfg, n_params, flops_per_token, log)
    derived.update(data=data_id, **batch.derived(), environment=environment(acc.num_processes))
    resolved = dataclasses.replace(cfg, output_dir=run_dir, resume=resume,
                                   activation_checkpointing=batch.activation_checkpointing)
    config_text = write_config(resolved, derived, run_dir, acc.is_main_process)
    eval_pending = checkpoint is not None and ranks.on_rank0(lambda: missed_eval(
        run_dir, train_state.step, cfg.eval_interval, feed.sched.total_steps))
    if eval_pending:
        log.msg(f"the evaluation of step {train_state.step:,} was abandoned at a stop: it runs "
                "first")
    elif train_state.step >= feed.sched.total_steps:
        log.msg(f"nothing to do: step {train_state.step:,} already reaches the end "
                f"({feed.sched.total_steps:,} steps)")
        return None
    tracker = Tracker(acc, log)
    tracker.start(section(cfg, "wandb"), run_dir, {**to_dict(resolved), "derived": derived},
                  resuming=checkpoint is not None)
    log.attach(tracker)
    checkpointer = Checkpointer(section(cfg, "checkpoint"), manager, acc, log, config_text,
                                run_hash, resumed=checkpoint, model=net.prepared,
                                optimizer=net.optimizer, components=components)
    recovery = Recovery(section(cfg, "reliability"), checkpointer, acc, prec, net.health, log)
    parts = Parts(_evaluator(cfg, acc, prec, splits.val, plan.micro, mcfg, log,
                             components["evaluator"]), checkpointer,
                  recovery, Stopper(requests, cfg.max_hours, cfg.log_interval,
                                    acc.num_processes, acc.device),
                  Meter(cfg.log_interval, feed.tokens_per_step, plan.world, flops_per_token,
                        acc.device),
                  WallClock(train_state.wall_seconds),
                  StepProfiler(cfg.profile_steps, run_dir, acc.device, acc.process_index, log,
                               tracker), LossGapCheck(cfg, prec, log, acc.device))
    log.start_progress(feed.sched.total_steps, train_state.step,
                       mfu_label=" of bf16 peak" if prec.fp8 else "")
    facts = dict(derived, model=cfg.model, target_val_loss=cfg.target_val_loss,
                 peak_flops=parts.meter.peak)
    return Run(acc, net, feed, train_state, log, parts, facts, run_dir, eval_pending)


def write_config(resolved: Config, derived: dict, run_dir: str, is_main: bool) -> str:
    """config.yaml: the config as this run resolved it (a sweep trial's directory and resume
    mode, activation checkpointing as the probe decided: the validated config itself is frozen)
    and the values derived at start. Returns its text (every checkpoint keeps a copy)."""
    text = dump_yaml(resolved, derived)
    if is_main:
        with open(os.path.join(run_dir, "config.yaml"), "w", encoding="utf-8") as fh:
            fh.write(text)
    return text


def run_directory(cfg: Config) -> "tuple[str, str]":
    """The run's directory and resume mode. A sweep agent starts every trial with the same
    command line: each gets its own directory, named by its run id, and a trial started again
    after a preemption continues there rather than refuse."""
    trial = sweep_run_id()
    if not trial:
        return cfg.output_dir, cfg.resume
    run_dir = cfg.output_dir
    if os.path.basename(os.path.normpath(run_dir)) != trial:
        run_dir = os.path.join(run_dir, trial)
    return run_dir, "auto" if cfg.resume == "never" else cfg.resume


def open_run(cfg: Config, run_dir: str, resume: str, manager: CheckpointManager,
             log: Logger) -> Optional[str]:
    """The checkpoint to resume from (None: a fresh start), and the run directory made and
    checked, with train.log open."""
    found, notes = (None, []) if cfg.plan_only else choose_checkpoint(resume, manager, log,
                                                                      asked=cfg.resume)
    ensure_writable_dir(run_dir, cfg.source)
    if not cfg.plan_only:
        log.open(run_dir)
    for say, msg in notes:   # what resume verification found, now that train.log is open
        say(msg)
    return found


def ensure_writable_dir(path: str, source: str) -> None:
    why = writable_dir(path)
    if why:
        raise BadInput(f"{source}: key 'output_dir': {why}")


def fsdp2_plugin(mixed_precision: str):
    """Under an FSDP2 launch on CUDA in a reduced precision: Accelerate's FSDP plugin as the
    launch configured it (its FSDP_* variables), but with no cast of the model's outputs.
    Accelerate's own policy casts the root module's outputs to the compute dtype, and the
    model's output is its loss, an fp32 scalar that bf16 would round to about 0.02 (the logged
    loss, the spike check, the evaluation's sums). None otherwise: Accelerate builds its own."""
    if not torch.cuda.is_available() or mixed_precision not in ("bf16", "fp16", "fp8") or \
            os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true" or \
            os.environ.get("FSDP_VERSION", "1") != "2":
        return None
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import MixedPrecisionPolicy
    dtype = torch.float16 if mixed_precision == "fp16" else torch.bfloat16
    plugin = FullyShardedDataParallelPlugin()
    plugin.mixed_precision_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype,
                                                         output_dtype=None)
    return plugin


def _accelerator(cfg: Config, state, run_dir: str, log: Logger):
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs
    prec = build_precision(cfg, state.device, log.warn, run_dir)
    if torch.cuda.is_available() and cfg.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    # DDP: gradients live in the all-reduce buckets (no second copy of every gradient, which
    # the micro-batch probe does not model), and no broadcast of every buffer before every
    # forward: the model's buffers (RoPE tables) are the same on every rank, and the FP8
    # backends with state keep it in agreement themselves (TE and native reduce their amaxes).
    ddp = DistributedDataParallelKwargs(gradient_as_bucket_view=True, broadcast_buffers=False)
    acc = Accelerator(cpu=not torch.cuda.is_available(), step_scheduler_with_optimizer=False,
                      log_with=Tracker.log_with(section(cfg, "wandb")), kwargs_handlers=[ddp],
                      fsdp_plugin=fsdp2_plugin(prec.mixed_precision),
                      **prec.accelerator_kwargs())
    check_distributed(section(cfg, "optimizer"), acc.distributed_type)
    n = acc.num_processes
    log.msg(f"fp8train: {cfg.source} -> {run_dir} ({n} process{'es' if n > 1 else ''}, "
            f"{threads.device_text(acc.device)}, {prec.name})")
    return prec, acc


def _net(cfg: Config, mcfg, prec: Precision, acc, batch: BatchDecision, saved: dict,
         log: Logger) -> "tuple[Net, int, float]":
    """The model (FP8 layers converted, prepared, compiled) and its optimizer."""
    # Resuming: the checkpoint's weights replace the model's, so an hf: model's own are not read.
    model = new_model(fresh_weights(mcfg) if saved else mcfg, batch.activation_checkpointing)
    if hasattr(model, "check_logits"):   # an hf: model: our output layer is its own
        model.check_logits()
        if model.attention != "sdpa":
            log.warn(f"model '{cfg.model}': transformers has no SDPA attention for it; it runs "
                     f"its '{model.attention}' attention (the scores in memory: slower, and "
                     f"more memory at long seq_len)")
        if prec.fp8 and model.not_linear():
            raise BadInput(f"{cfg.where('model', 'use_fp8')}: model '{cfg.model}' computes its "
                           f"projections in layers that are not nn.Linear "
                           f"({', '.join(model.not_linear()[:3])}), which no FP8 backend "
                           f"converts; train it without use_fp8")
    n_params, flops_per_token = model.num_params(), model.flops_per_token()
    if cfg.optimizer == "muon":   # MFU counts the orthogonalisations too, per token of a step
        flops_per_token += muon_flops_per_step(model, section(cfg, "optimizer")) / \
            (batch.plan.effective * cfg.seq_len)
    log.msg(f"model: {cfg.model} ({mcfg.arch}, {mcfg.n_layer} layers, d={mcfg.n_embd}, "
            f"{mcfg.n_head} heads), {n_params / 1e6:.2f}M parameters "
            f"({model.num_params(exclude_embeddings=True) / 1e6:.2f}M non-embedding), "
            f"vocab {mcfg.vocab_size:,} padded to {mcfg.padded_vocab_size:,}")
    prec.set_tokens(batch.plan.micro * cfg.seq_len, log.msg)  # fp8_layers auto times this size
    if saved and prec.fp8:
        prec.resume_layers(saved)
    model = prec.convert(model.to(acc.device))
    if not getattr(model, "ties_kept", lambda: True)():
        raise BadInput(f"{cfg.where('fp8_exclude')}: model '{cfg.model}' ties its output layer "
                       f"to its embedding, and {prec.name} would make the output layer a layer "
                       f"of its own in FP8: keep lm_head in fp8_exclude")
    for line in prec.conversion():
        log.msg(line)
    for caution in prec.cautions():
        log.warn(caution)
    # Muon under DDP: each rank orthogonalises its share of the matrices (FSDP: refused).
    optimizer = build_optimizer(model, section(cfg, "optimizer"), rank=acc.process_index,
                                world=acc.num_processes, compiled=cfg.compile)
    log.msg(describe_optimizer(optimizer, section(cfg, "optimizer")))
    _shard_by_block(acc, model)
    model, optimizer = acc.prepare(model, optimizer)
    prec.after_prepare(acc)
    prepared, (model, how) = model, compile_model(model, section(cfg, "model"),
                                                  prec.eager_under_compile)
    log.msg(how)
    kinds = getattr(inner_model(model), "layer_kinds", [])
    if len(kinds) > 1 and how.startswith("compile: per block"):
        log.warn(f"model '{cfg.model}' alternates {len(kinds)} kinds of decoder layer "
                 f"({', '.join(kinds)}): per-block compile traces a graph for each, and past "
                 f"torch's limit of 8 graphs the layers run eagerly; compile_scope: model "
                 f"compiles the whole model as one graph")
    health = Health(acc.device, cfg.loss_spike_factor)
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
    net = Net(model, optimizer, prec, health, section(cfg, "loss"), max_norm,
              acc.distributed_type, prepared)
    return net, n_params, flops_per_token


def _shard_by_block(acc, model) -> None:
    """Under FSDP: one unit per block of this model (GPT's Block, an hf: model's decoder layer),
    whatever class the launch config names (accelerate_configs/fsdp_8xh100.yaml names Block)."""
    plugin = getattr(acc.state, "fsdp_plugin", None)
    if acc.distributed_type == "FSDP" and plugin is not None and len(model.blocks):
        plugin.transformer_cls_names_to_wrap = sorted({type(b).__name__ for b in model.blocks})


def _restore(acc, manager: CheckpointManager, checkpoint, saved: dict, st: TrainState,
             components: dict, feed: Feed, log: Logger) -> None:
    """Load the checkpoint into the model, optimizer, RNG, `st` and the `components` ({name:
    state owner}: the precision's remedies and hand-over, the evaluator's record, the log
    interval in progress); drop the rows logged after it (those steps are re-run)."""
    if checkpoint is None:
        if sum(log.truncate_after(0)):
            log.warn("metrics.jsonl held rows of an earlier run that left no checkpoint; "
                     "they were dropped")
        return
    try:
        manager.restore(acc, checkpoint, st, components)
    except BadInput:
        raise
    except Exception as e:  # torch, safetensors and pickle each raise their own kinds
        from ..errors import one_line
        raise BadInput(f"cannot resume from '{checkpoint}': it does not match this "
                          f"run's model or optimizer ({one_line(e)})") from None
    if st.rollbacks:
        log.msg(f"this run restored a checkpoint {st.rollbacks} time(s) after non-finite "
                f"steps; precision now: {components['precision'].describe()}")
    warn_schedule_change(saved, feed.lr_args, st.step, log.warn)
    dropped = log.truncate_after(st.step)[0]
    log.msg(f"resumed from {checkpoint} at step {st.step:,} ({st.tokens:,} tokens)"
            + (f"; dropped {dropped} metrics rows logged after it" if dropped else ""))


def _derived(prec: Precision, acc, feed: Feed, mcfg, n_params: int, flops_per_token: float,
             log: Logger) -> dict:
    """The values the run decided at start: config.yaml's `derived` section."""
    plan, sched, device = feed.plan, feed.sched, acc.device
    peak = peak_note(device_name(device), prec.fp8) if device.type == "cuda" else \
        "no MFU: not a GPU run"
    log.msg(peak)
    return dict(micro_batch_size=plan.micro, gradient_accumulation_steps=plan.accum,
                world_size=plan.world, effective_batch_size=plan.effective,
                tokens_per_step=feed.tokens_per_step, total_steps=sched.total_steps,
                lr_schedule_steps=sched.lr_steps, warmup_steps=sched.warmup_steps,
                steps_per_epoch=sched.steps_per_epoch,
                peak_learning_rate=feed.lr_args["max_lr"],
                **prec.derived(), device=device_name(device),
                n_params=n_params, vocab_size=mcfg.vocab_size,
                padded_vocab_size=mcfg.padded_vocab_size, flops_per_token=flops_per_token,
                mfu_peak=peak,
                # an hf: model's config.json as read: its checkpoints rebuild it from this
                **({"hf_config": mcfg.hf_config} if hasattr(mcfg, "hf_config") else {}))


def _evaluator(cfg: Config, acc, prec: Precision, val_tokens, micro: int, mcfg,
               log: Logger, record: EvalRecord) -> Evaluator:
    ev = section(cfg, "eval")
    eval_set = val_batches(val_tokens, cfg.seq_len, ev.sequences, micro, log.warn)
    samples = TextSampler(ev, cfg.tokenizer, cfg.seed, mcfg, prec, acc, log.warn) \
        if ev.samples and cfg.dataset != "synthetic" else None  # no text to show
    hellaswag = HellaSwag(ev, build_tokenizer(cfg.tokenizer), mcfg, prec, acc) \
        if ev.hellaswag_interval else None
    return Evaluator(ev, eval_set, acc, prec, log, samples, hellaswag, record)
