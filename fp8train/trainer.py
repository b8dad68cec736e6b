"""The training loop on Accelerate: build everything once, then a short hot loop."""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import sys
import time
from dataclasses import dataclass

import torch

from . import autobatch
from . import config as config_mod
from .batching import BatchPlan, manual_plan
from .checkpoint import (CheckpointManager, CheckpointWriteError, TrainState, changed_on_resume,
                         config_hash, read_manifest, resolve_resume, saved_derived)
from .config import Config, ConfigError
from .evaluation import token_loss_sums
from .faults import Faults
from .health import Health
from .data import BatchStream, RandomWindows, load_splits, val_batches
from .loss import lm_loss
from .metrics import MetricsWriter, peak_flops, peak_note, throughput
from .model import GPT, compiled, model_config_from
from .precision import Precision, build_precision
from .runlog import RunLog
from .samples import Sampler
from .schedule import lr_at, scaled_lr
from .signals import EXIT_STOPPED, StopRequests
from .tracking import Tracker, environment, sweep_run_id

STOP_SIGNAL_BASE = 100   # agreed stop value: 1 = max_hours, BASE + signum = a signal


class RunFailed(Exception):
    """Training cannot go on (diverged, or a required checkpoint could not be written): one
    line on stderr, exit 1."""


def build_optimizer(model: torch.nn.Module, cfg: Config) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices and embeddings only: decaying norms' gains and
    biases toward zero hurts and saves nothing. Fused (CPU and CUDA): one kernel for the whole
    update, and it can skip a non-finite step on the device (see health.py)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2),
                             eps=cfg.adam_eps, fused=True)


@dataclass
class Schedule:
    total_steps: int        # when training stops (epochs / max_steps)
    lr_steps: int           # length of the LR schedule
    steps_per_epoch: int


def plan_steps(cfg: Config, train_tokens: int, plan: BatchPlan) -> Schedule:
    tokens_per_step = plan.effective * cfg.seq_len
    steps_per_epoch = max(1, math.ceil(train_tokens / tokens_per_step))
    candidates = [s for s in (
        math.ceil(cfg.num_epochs * steps_per_epoch) if cfg.num_epochs else None,
        cfg.max_steps) if s is not None]
    total = min(candidates)
    lr_steps = cfg.lr_decay_steps or total
    if cfg.warmup_steps >= lr_steps:
        what = "lr_decay_steps" if cfg.lr_decay_steps else \
            f"the run's total steps (num_epochs {cfg.num_epochs} × {steps_per_epoch} steps/epoch)"
        raise ConfigError(f"{cfg.source}: key 'warmup_steps' ({cfg.warmup_steps}) must be "
                          f"smaller than {what} = {lr_steps}")
    return Schedule(total, lr_steps, steps_per_epoch)


def train(cfg: Config) -> int:
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedDataParallelKwargs, set_seed

    # Without CUDA, say so up front: under torchrun that selects gloo (multi-process CPU).
    cpu = not torch.cuda.is_available()
    state = PartialState(cpu=cpu)
    log = RunLog(state.is_main_process)
    if cfg.auto_batch_size:   # discovered once the model is known; the target is checked now
        plan = None
        autobatch.check_target(cfg, state.num_processes)
    else:
        plan = manual_plan(cfg, state.num_processes)

    # --- run directory and resume point ---------------------------------------------------------
    trial = sweep_run_id()
    if trial and os.path.basename(os.path.normpath(cfg.output_dir)) != trial:
        # A sweep agent starts every trial with the same command line: one directory each.
        cfg.output_dir = os.path.join(cfg.output_dir, trial)
    if trial and cfg.resume == "never":
        # The directory is this trial's own (named by its run id): checkpoints there are from
        # this trial, started again after a preemption. Continue it rather than refuse.
        cfg.resume = "auto"
    faults = Faults.from_env(state.process_index)   # tests only: FP8TRAIN_FAULTS
    ckpt = CheckpointManager(cfg.output_dir, cfg.keep_checkpoints, faults)
    notes: list = []
    try:
        resume_from = None if cfg.plan_only else _choose_checkpoint(cfg, ckpt, state, notes)
    except ConfigError:
        for level, msg in notes:   # why each checkpoint was refused, before the error itself
            if level == "warn":
                log.warn(msg)
        raise
    _ensure_writable_dir(cfg.output_dir, cfg.source)
    if not cfg.plan_only:
        log.open(os.path.join(cfg.output_dir, "train.log"))
    for level, msg in notes:   # what resume verification found, now that train.log is open
        (log.warn if level == "warn" else log.info)(msg)

    # --- precision and accelerator -------------------------------------------------------------
    prec = build_precision(cfg, state.device, log.warn)
    if torch.cuda.is_available() and cfg.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    # DDP: gradients live in the all-reduce buckets (no second copy of every gradient, which
    # the micro-batch probe does not model), and no broadcast of every buffer before every
    # forward: the model's buffers (RoPE tables) are the same on every rank, and the FP8
    # backends with state keep it in agreement themselves (TE and native reduce their amaxes).
    ddp = DistributedDataParallelKwargs(gradient_as_bucket_view=True, broadcast_buffers=False)
    accelerator = Accelerator(
        cpu=cpu,
        gradient_accumulation_steps=plan.accum if plan else 1,
        step_scheduler_with_optimizer=False,
        log_with=Tracker.log_with(cfg),
        kwargs_handlers=[ddp],
        **prec.accelerator_kwargs())
    device = accelerator.device

    log.info(f"fp8train: {cfg.source} -> {cfg.output_dir} "
             f"({accelerator.num_processes} process{'es' if state.num_processes > 1 else ''}, "
             f"{_device_name(device)}, {prec.name})")

    # --- data -----------------------------------------------------------------------------------
    set_seed(cfg.seed)  # the same init on every rank
    splits = load_splits(cfg, log.info, lambda fetch: _on_rank0(accelerator, fetch))
    log.info(f"data: {splits.source} ({cfg.tokenizer} tokenizer, vocab {splits.vocab_size:,}): "
             f"{len(splits.train):,} train / {len(splits.val):,} val tokens")
    try:
        mcfg = model_config_from(
            cfg.model, splits.vocab_size, cfg.seq_len, n_layer=cfg.n_layer, n_head=cfg.n_head,
            n_kv_head=cfg.n_kv_head, n_embd=cfg.n_embd, ffn_hidden_size=cfg.ffn_hidden_size,
            dropout=cfg.dropout, pad_vocab_multiple=cfg.pad_vocab_multiple)
    except ValueError as e:
        raise ConfigError(f"{cfg.source}: model '{cfg.model}': {e}") from None

    # --- batch plan, schedule -------------------------------------------------------------------
    batch_note = ""
    if plan is None and resume_from is not None:
        plan, batch_note = _plan_from_checkpoint(cfg, resume_from, accelerator.num_processes)
    if plan is None:
        plan, batch_note = _discover_plan(cfg, mcfg, prec, accelerator, log)
    accelerator.gradient_accumulation_steps = plan.accum
    max_lr, lr_note = scaled_lr(cfg.learning_rate, cfg.lr_scaling, plan.effective,
                                cfg.lr_reference_batch_size)
    sched = plan_steps(cfg, len(splits.train), plan)
    log.info(plan.describe(cfg.seq_len) + (f"; {batch_note}" if batch_note else ""))
    if lr_note:
        log.info(lr_note)
    log.info(f"schedule: {sched.total_steps:,} steps ({sched.steps_per_epoch:,} per epoch), "
             f"warmup {cfg.warmup_steps}, cosine to {cfg.min_lr_ratio:g} × "
             f"{max_lr:g} at step {sched.lr_steps:,}")
    if cfg.plan_only:
        log.info("plan only (--plan_only): not training")
        return 0
    data_id = dict(train_tokens=len(splits.train), val_tokens=len(splits.val),
                   vocab_size=splits.vocab_size)
    run_hash = config_hash({**config_mod.to_dict(cfg), "data": data_id,
                            "effective_batch_size": plan.effective})
    if resume_from is not None and read_manifest(resume_from).get("config_hash") != run_hash:
        changed = changed_on_resume(resume_from, config_mod.to_dict(cfg),
                                    dict(data=data_id, effective_batch_size=plan.effective))
        if changed and not cfg.allow_config_change:
            raise ConfigError(
                f"{cfg.source}: resuming '{resume_from}' with settings that change training: "
                f"{', '.join(changed)}; put them back, pass --allow_config_change to continue "
                f"with the new values, or start a new run with another --output_dir")
        if changed:
            log.warn("resuming with settings that differ from the checkpoint's "
                     "(--allow_config_change; training continues with the new values): "
                     + ", ".join(changed))
    sampler = RandomWindows(splits.train, cfg.seq_len, cfg.seed)
    eval_set = val_batches(splits.val, cfg.seq_len, cfg.eval_sequences, plan.micro)

    # --- model and optimizer --------------------------------------------------------------------
    model = new_model(mcfg, cfg)
    n_params = model.num_params()
    flops_per_token = model.flops_per_token()
    log.info(f"model: {cfg.model} ({mcfg.arch}, {mcfg.n_layer} layers, d={mcfg.n_embd}, "
             f"{mcfg.n_head} heads), {n_params / 1e6:.2f}M parameters "
             f"({model.num_params(exclude_embeddings=True) / 1e6:.2f}M non-embedding), "
             f"vocab {mcfg.vocab_size:,} padded to {mcfg.padded_vocab_size:,}")
    prec.set_tokens(plan.micro * cfg.seq_len, log.info)  # fp8_layers auto times at this size
    if resume_from is not None and prec.fp8:
        prec.resume_layers(saved_derived(resume_from))
    model = prec.convert(model.to(device))
    if prec.fp8:
        log.info(prec.selection.describe())
        log.info(prec.describe())
    for caution in prec.cautions():
        log.warn(caution)
    optimizer = build_optimizer(model, cfg)
    model, optimizer = accelerator.prepare(model, optimizer)
    prec.after_prepare(accelerator)
    model = compiled(model, cfg)
    train_state = TrainState()
    accelerator.register_for_checkpointing(train_state)

    # Same init everywhere (seeded above); from here on dropout masks differ per rank. A resume
    # then restores each rank's RNG state from the checkpoint.
    set_seed(cfg.seed + accelerator.process_index)
    metrics = MetricsWriter(os.path.join(cfg.output_dir, "metrics.jsonl"),
                            accelerator.is_main_process, log.warn)
    samples_file = MetricsWriter(os.path.join(cfg.output_dir, "samples.jsonl"),
                                 accelerator.is_main_process, log.warn)
    if resume_from is not None:
        try:
            accelerator.load_state(resume_from)
        except Exception as e:  # torch, safetensors and pickle each raise their own kinds
            first = " ".join(str(e).split())[:300] or type(e).__name__
            raise ConfigError(f"cannot resume from '{resume_from}': it does not match this "
                              f"run's model or optimizer ({first})") from None
        prec.reapply(train_state.fp8_margin_added, train_state.fp8_off)
        if train_state.rollbacks:
            log.info(f"this run restored a checkpoint {train_state.rollbacks} time(s) after "
                     f"non-finite steps; precision now: {prec.describe()}")
        _warn_schedule_change(cfg, saved_derived(resume_from), sched, max_lr, train_state.step,
                              log.warn)
        dropped = metrics.truncate_after(train_state.step)
        samples_file.truncate_after(train_state.step)
        log.info(f"resumed from {resume_from} at step {train_state.step:,} "
                 f"({train_state.tokens:,} tokens)"
                 + (f"; dropped {dropped} metrics rows logged after it" if dropped else ""))
    elif metrics.truncate_after(0) + samples_file.truncate_after(0):
        log.warn("metrics.jsonl held rows of an earlier run that left no checkpoint; "
                 "they were dropped")

    peak = peak_note(_device_name(device), prec.fp8) if device.type == "cuda" else \
        "no MFU: not a GPU run"
    log.info(peak)
    derived = dict(micro_batch_size=plan.micro, gradient_accumulation_steps=plan.accum,
                   world_size=plan.world, effective_batch_size=plan.effective,
                   tokens_per_step=plan.effective * cfg.seq_len, total_steps=sched.total_steps,
                   lr_schedule_steps=sched.lr_steps, steps_per_epoch=sched.steps_per_epoch,
                   peak_learning_rate=max_lr,
                   **prec.derived(), device=_device_name(device),
                   n_params=n_params, vocab_size=mcfg.vocab_size,
                   padded_vocab_size=mcfg.padded_vocab_size, flops_per_token=flops_per_token,
                   mfu_peak=peak, data=data_id)
    if batch_note:
        derived["batch_discovery"] = batch_note
    derived["environment"] = environment(accelerator.num_processes)
    config_text = config_mod.dump_yaml(cfg, derived)
    if accelerator.is_main_process:
        with open(os.path.join(cfg.output_dir, "config.yaml"), "w", encoding="utf-8") as fh:
            fh.write(config_text)

    if train_state.step >= sched.total_steps:
        log.info(f"nothing to do: step {train_state.step:,} already reaches the end "
                 f"({sched.total_steps:,} steps)")
        log.close()
        return 0

    tracker = Tracker(accelerator, log.warn, log.info)
    tracker.start(cfg, {**config_mod.to_dict(cfg), "derived": derived},
                  resuming=resume_from is not None)
    samples = Sampler(cfg, mcfg, prec, accelerator, samples_file, log.warn) \
        if cfg.eval_samples and cfg.dataset != "synthetic" else None  # no text to show
    loop = Loop(cfg, accelerator, prec, model, optimizer, sampler, eval_set, sched, plan,
                train_state, ckpt, metrics, log, flops_per_token, config_text, max_lr, tracker,
                samples, run_hash, faults, samples_file)
    loop.n_params = n_params
    try:
        code = loop.run()
    except BaseException:
        tracker.finish(failed=True)
        raise
    finally:
        tracker.finish()  # a no-op after a failure
        log.close()
    return code


def _warn_schedule_change(cfg: Config, saved: dict, sched: Schedule, max_lr: float, step: int,
                          warn) -> None:
    """The cosine follows the run's length (unless lr_decay_steps is set), and the run's length
    may change on resume: say so, with the jump in LR it causes, rather than let it pass."""
    before = saved.get("lr_schedule_steps")
    if not isinstance(before, int) or before == sched.lr_steps:
        return
    args = dict(warmup_steps=cfg.warmup_steps, min_lr_ratio=cfg.min_lr_ratio)
    old = lr_at(step, max_lr=saved.get("peak_learning_rate", max_lr), total_steps=before, **args)
    new = lr_at(step, max_lr=max_lr, total_steps=sched.lr_steps, **args)
    warn(f"the LR schedule is now {sched.lr_steps:,} steps long, the checkpoint's run had "
         f"{before:,} (the cosine follows the run's length, which changed): the "
         f"LR at step {step + 1:,} is {new:.3g} instead of {old:.3g}; set lr_decay_steps to "
         f"keep a schedule fixed across changes of length")


def _choose_checkpoint(cfg: Config, ckpt: CheckpointManager, state, notes: list) -> str | None:
    """The verified checkpoint to resume from, chosen by rank 0, which reads and checksums the
    files once."""
    return _on_rank0(state, lambda: resolve_resume(
        cfg.resume, ckpt, warn=lambda m: notes.append(("warn", m)),
        info=lambda m: notes.append(("info", m))))


def _plan_from_checkpoint(cfg: Config, checkpoint: str, world: int):
    """On resume with auto_batch_size, the micro-batch the checkpoint's run used (no probe), as
    long as the number of processes is the same: the resumed run then takes the same steps."""
    saved = saved_derived(checkpoint)
    if saved.get("world_size") != world or not saved.get("micro_batch_size"):
        return None, ""
    plan = autobatch.plan_from_fit(cfg, world, int(saved["micro_batch_size"]))
    return plan, f"micro-batch {plan.micro} as in the checkpoint"


def new_model(mcfg, cfg: Config) -> GPT:
    model = GPT(mcfg)
    model.activation_checkpointing = cfg.activation_checkpointing
    return model


def _discover_plan(cfg: Config, mcfg, prec: Precision, accelerator, log):
    """Probe (or read from the cache) the largest micro-batch that fits, agreed over ranks, and
    plan micro × accumulation × world == target from it."""
    device = accelerator.device
    trial = autobatch.make_trial(
        build_model=lambda: new_model(mcfg, cfg),
        build_precision=lambda: build_precision(cfg, device, warn=lambda _: None),
        build_optimizer=lambda m: build_optimizer(m, cfg),
        loss_fn=lambda logits, x: lm_loss(logits, x, cfg.penalty_type, cfg.penalty_weight)[0],
        cfg=cfg, vocab_size=mcfg.vocab_size, device=device, autocast=accelerator.autocast)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        device_desc = f"{props.name}, {props.total_memory / 2**30:.1f} GiB"
    else:
        device_desc = device.type
    key = autobatch.cache_key(cfg, dataclasses.asdict(mcfg), prec.name, device_desc,
                              accelerator.num_processes)
    note = ""
    if accelerator.distributed_type == "FSDP":
        log.warn("batch discovery under FSDP probes an unsharded copy of the model on each rank: "
                 "it counts every parameter, gradient and optimizer moment whole, so the "
                 "micro-batch it finds is a lower bound (set batch_size and "
                 "gradient_accumulation_steps by hand to use more memory)")
    try:
        fit = autobatch.discover(cfg, trial, key, device, accelerator.process_index,
                                 accelerator.num_processes, accelerator.is_main_process, log.info)
    except autobatch.DoesNotFit as e:
        if cfg.activation_checkpointing:
            raise
        # Recomputing activations costs ~30% more compute: worth it only when nothing fits
        # without it. The cache key includes the setting, so this probes (or reads) anew.
        log.warn(f"{e}; trying again with activation_checkpointing on")
        cfg.activation_checkpointing = True
        key = dict(key, activation_checkpointing=True)
        fit = autobatch.discover(cfg, trial, key, device, accelerator.process_index,
                                 accelerator.num_processes, accelerator.is_main_process, log.info)
        note = "; activation_checkpointing turned on: micro-batch 1 did not fit without it"
    plan = autobatch.plan_from_fit(cfg, accelerator.num_processes, fit.micro)
    how = f"cached in {autobatch.cache_path(cfg)}" if fit.cached else \
        f"probe {fit.seconds:.1f} s"
    return plan, f"fitted micro {fit.micro} of max {cfg.max_batch_size} ({how}){note}"


def _ensure_writable_dir(path: str, source: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{source}: key 'output_dir': cannot create '{path}': "
                          f"{e.strerror or e}") from None
    if not os.access(path, os.W_OK):
        raise ConfigError(f"{source}: key 'output_dir': '{path}' is not writable")


def _on_rank0(state, compute):
    """`compute()` on rank 0 alone (a download, a checksum pass) while the other ranks wait;
    every rank gets its result, or raises its ConfigError, so that all of them stop with the
    same message instead of waiting forever at a barrier rank 0 never reaches."""
    value, error = None, None
    if state.is_main_process:
        try:
            value = compute()
        except ConfigError as e:
            error = str(e)
    if state.num_processes > 1:
        from accelerate.utils import broadcast_object_list
        value, error = broadcast_object_list([value, error])
    if error is not None:
        raise ConfigError(error)
    return value


class Loop:
    """The hot loop and what runs at its intervals (log, eval, checkpoint, health)."""

    def __init__(self, cfg, accelerator, prec: Precision, model, optimizer, sampler, eval_set,
                 sched, plan, train_state, ckpt, metrics, log, flops_per_token, config_text,
                 max_lr, tracker: Tracker, samples: "Sampler | None", run_hash: str,
                 faults: "Faults | None", samples_file: MetricsWriter):
        self.cfg, self.acc, self.prec, self.model, self.opt = cfg, accelerator, prec, model, \
            optimizer
        self.sampler, self.eval_set, self.sched, self.plan = sampler, eval_set, sched, plan
        self.st, self.ckpt, self.metrics, self.log = train_state, ckpt, metrics, log
        self.flops_per_token, self.config_text = flops_per_token, config_text
        self.tracker, self.samples, self.samples_file = tracker, samples, samples_file
        self.run_hash, self.faults = run_hash, faults
        self.device = accelerator.device
        self.peak = peak_flops(_device_name(self.device)) if self.device.type == "cuda" else None
        self.tokens_per_step = plan.effective * cfg.seq_len
        self.rank_offset = accelerator.process_index * plan.micro * plan.accum
        self.lr_args = dict(max_lr=max_lr, warmup_steps=cfg.warmup_steps,
                            total_steps=sched.lr_steps, min_lr_ratio=cfg.min_lr_ratio)
        self.max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
        # Under FP8 the MFU is against the bf16 peak (see metrics.peak_note): say so where shown.
        self.progress = _Progress(log, sched.total_steps, train_state.step,
                                  mfu_label=" of bf16 peak" if prec.fp8 else "")
        self.stops = StopRequests()
        self.exit_code = 0
        # Stop requests are agreed across ranks (one small all-reduce and host sync) every few
        # steps, at most 10 apart: soon enough for SLURM's warning, never a sync per step.
        self.stop_check_every = 1 if accelerator.num_processes == 1 else \
            min(cfg.log_interval, 10)
        self.health = Health(self.device, cfg.loss_spike_factor)
        self.optimizer_inner = getattr(optimizer, "optimizer", optimizer)
        # FSDP2's parameters are DTensors; the fused kernel's found_inf is a plain 0-d tensor (the
        # same value on every rank), which DTensor takes as replicated inside this context.
        self.optimizer_context = _implicit_replication if \
            accelerator.distributed_type == "FSDP" else contextlib.nullcontext
        # DDP keeps gradients as views of its all-reduce buckets (gradient_as_bucket_view) only
        # while they exist: set to None, the next step's no_sync micro-steps would accumulate
        # into fresh tensors, a second copy of every gradient until the syncing micro-step.
        self.grads_to_none = accelerator.distributed_type not in ("MULTI_GPU", "MULTI_CPU")
        self.recovering_since = None  # the step of the last rollback until a checkpoint passes it
        self.last_remedy = ""
        self.batches = None
        self.final_val = None      # (step, val/loss) of the latest evaluation
        self.status = "running"
        self.n_params = 0          # set by train(): counted before any sharding

    def run(self) -> int:
        """Train to the end or to a stop; returns the exit code (3: stopped by a signal)."""
        self.stops.install()
        try:
            self._run()
        finally:
            self.stops.restore()
        return self.exit_code

    def _stream(self) -> BatchStream:
        return BatchStream(self.sampler, self.st.data_position, self.rank_offset, self.plan.micro,
                           self.plan.accum, self.plan.effective,
                           pin=self.device.type == "cuda", depth=self.cfg.data_prefetch)

    def _run(self) -> None:
        cfg, st = self.cfg, self.st
        start_time = time.time()
        self.started, self.wall_base = start_time, st.wall_seconds
        self.first_interval = True   # compile and warm-up: left out of the steady state
        if cfg.target_val_loss is not None and cfg.stop_at_target and \
                st.target == cfg.target_val_loss and st.target_step is not None:
            self.log.info(f"nothing to do: target val/loss {cfg.target_val_loss:g} was reached "
                          f"at step {st.target_step:,} (stop_at_target: false trains on)")
            return   # the run's summary.json, written when it stopped there, stands
        interval_steps = 0
        data_wait = 0.0   # host seconds spent waiting for the next micro-batch
        clock = _TrainClock(self.device)  # training time only: eval and checkpoints excluded
        self.model.train()
        stop_reason, at_target = None, False
        self.batches = self._stream()
        try:
            while st.step < self.sched.total_steps:
                lr = lr_at(st.step, **self.lr_args)
                for group in self.opt.param_groups:
                    group["lr"] = lr
                last = st.step + 1 == self.sched.total_steps
                logged = (st.step + 1) % cfg.log_interval == 0 or last
                if logged:
                    self.prec.watch(True)  # scale statistics on logged steps only
                nan = self.faults is not None and self.faults.nan_loss(st.step + 1)
                step_ce = step_penalty = 0.0
                # This rank's slice of the step's sequences, one micro-batch at a time.
                for _ in range(self.plan.accum):
                    t_wait = time.perf_counter()
                    x, y = self.batches.next()
                    data_wait += time.perf_counter() - t_wait
                    x = x.to(self.device, non_blocking=True)
                    y = y.to(self.device, non_blocking=True)
                    with self.acc.accumulate(self.model):  # no_sync except on the last micro-step
                        with self.prec.forward_context(training=True):
                            logits = self.model(x)
                        loss, ce, penalty = lm_loss(logits, y, cfg.penalty_type, cfg.penalty_weight)
                        if nan:
                            loss = loss * float("nan")
                            ce = ce * float("nan")
                        self.acc.backward(loss)            # divides by the accumulation steps
                    self.prec.after_backward()
                    step_ce = step_ce + ce.detach()
                    step_penalty = step_penalty + penalty.detach()
                if self.faults is not None:
                    self.faults.in_step(st.step + 1)
                grad_norm = self.acc.clip_grad_norm_(self.model.parameters(), self.max_norm)
                skip = self.health.step(grad_norm, step_ce / self.plan.accum,
                                        step_penalty / self.plan.accum)
                self.optimizer_inner.found_inf = skip   # the fused kernel skips it: no host sync
                with self.optimizer_context():
                    self.opt.step()
                self.opt.zero_grad(set_to_none=self.grads_to_none)
                st.step += 1
                st.tokens += self.tokens_per_step
                st.data_position += self.plan.effective
                interval_steps += 1

                if logged:  # decided before the step, so that the step was watched
                    vals = self.acc.reduce(self.health.interval(), "mean").tolist()  # host sync
                    loss_val, penalty_val, bad, loss_max, worst_streak = vals
                    elapsed = clock.take()
                    st.train_seconds += elapsed
                    if not self.first_interval:
                        st.steady_tokens += self.tokens_per_step * interval_steps
                        st.steady_seconds += elapsed
                    self.first_interval = False
                    st.skipped_steps += int(bad)
                    extra = self.prec.stats()             # rank 0's scales, read in one go
                    self.prec.watch(False)
                    if extra:
                        extra = dict(zip(extra, torch.stack(list(extra.values())).tolist()))
                    extra["train/skipped_steps"] = int(bad)
                    extra["train/loss_max"] = loss_max
                    self._log_train(loss_val, penalty_val, lr, float(grad_norm), interval_steps,
                                    elapsed, data_wait, extra)
                    if bad:
                        self.progress.message(f"step {st.step:,}: {int(bad)} step(s) of the last "
                                              f"{interval_steps} had non-finite gradients; their "
                                              f"updates were skipped ({st.skipped_steps:,} so far)")
                    spike = self.health.spike(loss_val, loss_max)
                    if spike:
                        self.log.warn(f"loss spike in steps {st.step - interval_steps + 1:,}-"
                                      f"{st.step:,}: {spike}")
                    data_wait = 0.0
                    interval_steps = 0
                if cfg.max_bad_steps and logged and worst_streak >= cfg.max_bad_steps:
                    clock.pause()
                    self._roll_back()
                    clock.resume()
                    interval_steps = 0
                    continue
                if not last and (logged or st.step % self.stop_check_every == 0):
                    over_time = cfg.max_hours is not None and \
                        time.time() - start_time > cfg.max_hours * 3600
                    # The signal number itself is agreed (offset past the max_hours flag), so
                    # every rank names the same signal, whichever rank it reached first.
                    why = self._agreed_max(STOP_SIGNAL_BASE + self.stops.received
                                           if self.stops.received else int(over_time))
                    if why > STOP_SIGNAL_BASE:
                        name = signal.Signals(why - STOP_SIGNAL_BASE).name
                        stop_reason = f"{name} received" + \
                            ("" if self.stops.received else " by another rank")
                        self.exit_code = EXIT_STOPPED
                        self.tracker.preempting()
                    elif why == 1:
                        stop_reason = f"max_hours ({cfg.max_hours:g}) reached"
                # A signal is a deadline (SLURM's warning, a preemption): checkpoint, skip eval.
                do_eval = st.step % cfg.eval_interval == 0 or last or \
                    (stop_reason and self.exit_code != EXIT_STOPPED)
                do_ckpt = st.step % cfg.checkpoint_interval == 0 or last or stop_reason
                at_target = False
                if do_eval or do_ckpt:
                    clock.pause()
                    # A target reached is saved, and with stop_at_target ends the run here.
                    if do_eval and self._evaluate(st.train_seconds + clock.banked):
                        do_ckpt = True
                        at_target = cfg.stop_at_target and not last and not stop_reason
                    if do_ckpt:
                        final = bool(last or stop_reason or at_target)
                        if final:   # the steps since the last log line count too
                            st.train_seconds += clock.collect()
                        self._checkpoint(final=final)
                    clock.resume()
                if stop_reason or at_target:
                    break
        finally:
            self.batches.close()
        self.progress.close()
        done = f"stopped early: {stop_reason}; resume with --resume" if stop_reason else \
            "stopped at the target (stop_at_target)" if at_target else "done"
        self.status = "target reached" if at_target else \
            f"stopped: {stop_reason}" if stop_reason else "completed"
        if self.exit_code == EXIT_STOPPED:
            done += f" (exit {EXIT_STOPPED})"
        skipped = f", {st.skipped_steps:,} non-finite steps skipped" if st.skipped_steps else ""
        rolled = f", {st.rollbacks} rollback(s)" if st.rollbacks else ""
        self.log.info(f"{done} at step {st.step:,} ({st.tokens:,} tokens, "
                      f"{st.train_seconds / 60:.1f} min of training{skipped}{rolled}); "
                      f"checkpoint {self.ckpt.latest()}")
        self._report()

    def _report(self) -> None:
        """The end-of-run report: log lines, summary.json, the W&B summary."""
        from . import summary
        st = self.st
        st.wall_seconds = self.wall_base + time.time() - self.started
        peak_mem = torch.cuda.max_memory_allocated(self.device) / 1e9 \
            if self.device.type == "cuda" else None
        report = summary.build(self.cfg, st, self.status, self.exit_code, self.plan,
                               self.prec.derived(), self.flops_per_token, self.peak, peak_mem,
                               self.final_val, self.ckpt.latest(), self.sched.total_steps,
                               self.n_params)
        for line in summary.describe(report):
            self.log.info(line)
        if self.acc.is_main_process:
            try:
                summary.write(self.cfg.output_dir, report)
            except OSError as e:
                self.log.warn(f"summary.json could not be written ({e})")
        self.tracker.summary(report)

    def _checkpoint(self, final: bool) -> None:
        """Save at an interval, at a stop or at the end. A periodic checkpoint is not taken in
        the middle of a streak of non-finite steps (FP8 scale state may be poisoned: a rollback
        must never land there). A write that fails leaves the previous checkpoint as it was;
        the run warns and goes on, unless this was its last chance or checkpoint_required."""
        st = self.st
        if not final and self.cfg.max_bad_steps and self.health.in_streak():
            self.log.warn(f"no checkpoint at step {st.step:,}: the latest steps had non-finite "
                          "gradients; the next interval will try again")
            return
        st.checkpoints_written += 1      # counted inside the checkpoint it describes
        st.wall_seconds = self.wall_base + time.time() - self.started
        try:
            path = self.ckpt.save(self.acc, st.step, self.config_text,
                                  dict(tokens=st.tokens, config_hash=self.run_hash))
        except CheckpointWriteError as e:
            st.checkpoints_written -= 1
            prev = self.ckpt.latest()
            intact = f"the previous checkpoint '{prev}' is intact" if prev else \
                "there is no earlier checkpoint"
            if final or self.cfg.checkpoint_required:
                why = "checkpoint_required is true" if not final else \
                    "it was the run's last checkpoint: the steps after the previous one are lost"
                raise RunFailed(f"{e}; {intact}; stopping because {why}") from None
            self.log.warn(f"{e}; {intact}; training goes on (checkpoint_required: true stops "
                          "instead)")
            return
        self.log.file_only(f"checkpoint: {path}")
        if self.recovering_since is not None and st.step > self.recovering_since:
            self.recovering_since = None   # the remedy carried the run past the trouble

    def _roll_back(self) -> None:
        """max_bad_steps non-finite steps in a row: restore the last checkpoint, apply the
        remedy (FP8: a larger margin, or bf16), and skip the training sequences drawn since
        that checkpoint (the data that led here is not replayed). A second time before a new
        checkpoint is passed, stop."""
        cfg, st = self.cfg, self.st
        what = (f"{cfg.max_bad_steps} or more consecutive steps with non-finite gradients (their "
                f"updates were skipped), up to step {st.step:,}")
        found = self.ckpt.latest()
        hint = "lower learning_rate, raise warmup_steps" + (", raise fp8_margin or train without "
                                                              "FP8" if self.prec.fp8 else "")
        if self.recovering_since is not None:
            raise RunFailed(f"{what}, again after restoring a checkpoint at step "
                            f"{self.restored_step:,} (the rollback at step "
                            f"{self.recovering_since:,}) and {self.last_remedy}: training "
                            f"diverges; {hint}")
        if found is None:
            raise RunFailed(f"{what}, before the first checkpoint: nothing to restore; {hint}")
        keep = dict(skipped_steps=st.skipped_steps, rollbacks=st.rollbacks + 1,
                    data_position=st.data_position)
        detected = st.step
        self.batches.close()
        self.acc.load_state(found)       # model, optimizer, FP8 state, RNG, counters
        skipped_data = keep["data_position"] - st.data_position
        for k, v in keep.items():        # counted over the whole run, not reset by the restore
            setattr(st, k, v)
        remedy = self.prec.recover(cfg.fp8_recovery)
        st.fp8_margin_added, st.fp8_off = self.prec.margin_added, self.prec.disabled
        self.last_remedy = remedy or "skipping the data"
        self.health.reset()
        self.metrics.truncate_after(st.step)
        self.samples_file.truncate_after(st.step)
        self.recovering_since, self.restored_step = detected, st.step
        self.log.warn(f"ROLLBACK: {what}; restored {found} (step {st.step:,}); "
                      f"{remedy + '; ' if remedy else ''}skipping the {skipped_data:,} training "
                      f"sequences drawn since that checkpoint")
        row = {"step": st.step, "tokens": st.tokens, "recovery/rollbacks": st.rollbacks,
               "recovery/detected_at_step": detected, "recovery/skipped_sequences": skipped_data}
        if self.prec.fp8:
            row["recovery/fp8_margin"] = self.prec.margin()
            row["recovery/fp8_on"] = int(not self.prec.disabled)
        self.metrics.write(row)
        self.tracker.log(row)
        self.batches = self._stream()

    def _agreed_max(self, value: int) -> int:
        """The largest of the ranks' values on every rank: any rank's stop request stops all of
        them at the same step, so no rank leaves the loop alone."""
        if self.acc.num_processes == 1:
            return value
        import torch.distributed as dist
        t = torch.tensor([value], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def _log_train(self, loss, penalty, lr, grad_norm, steps, elapsed, data_wait,
                   extra) -> None:
        st = self.st
        row = {"step": st.step, "tokens": st.tokens, "train/loss": loss,
               "train/penalty": penalty, "train/total_loss": loss + penalty, "train/lr": lr,
               "train/grad_norm": grad_norm,
               **throughput(self.tokens_per_step, steps, elapsed, self.plan.world,
                            self.flops_per_token, self.peak),
               "train/data_wait_fraction": min(1.0, data_wait / elapsed) if elapsed > 0 else 0.0}
        if self.device.type == "cuda":
            row["system/gpu_memory_allocated_gb"] = torch.cuda.memory_allocated() / 1e9
            row["system/gpu_memory_peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
            row["system/gpu_memory_reserved_gb"] = torch.cuda.memory_reserved() / 1e9
        row.update(extra or {})
        self.metrics.write(row)
        self.tracker.log(row)
        self.progress.update(st.step, row)

    @torch.no_grad()
    def _evaluate(self, train_seconds: float) -> bool:
        """Evaluate and log; True when this evaluation reached target_val_loss for the first
        time (`train_seconds`: the training time so far, for val/time_to_target_s)."""
        self.model.eval()
        total = token_loss_sums(self.model, self.eval_set, self.device,
                                lambda: self.prec.forward_context(training=False),
                                self.acc.process_index, self.acc.num_processes)
        total = self.acc.reduce(total, "sum")
        val_loss = (total[0] / total[1]).item()
        self.model.train()
        # Time stamps for plots of loss against time (scripts/compare_runs.py): training time
        # (evaluation and checkpoints excluded) and wall time, resumes included.
        st = self.st
        row = {"step": st.step, "tokens": st.tokens, "val/loss": val_loss,
               "val/ppl": math.exp(min(val_loss, 50.0)), "time/train_s": train_seconds,
               "time/wall_s": self.wall_base + time.time() - self.started}
        self.final_val = (st.step, val_loss)
        if st.best_val_loss is None or val_loss < st.best_val_loss:
            st.best_val_loss, st.best_val_step = val_loss, st.step
        reached = self._reached_target(val_loss, train_seconds)
        if reached:   # in the same row: one evaluation, one row
            row.update({"val/time_to_target_s": train_seconds, "val/tokens_to_target": st.tokens})
        self.metrics.write(row)
        self.tracker.log(row)
        self.progress.message(f"eval step {st.step:,}: val/loss {val_loss:.4f}, "
                              f"val/ppl {row['val/ppl']:.2f}")
        if reached:
            self.progress.message(f"target val/loss {self.cfg.target_val_loss:g} reached at step "
                                  f"{st.step:,}: val/loss {val_loss:.4f} after "
                                  f"{_hms(train_seconds)} of training ({st.tokens:,} tokens)")
        if self.samples is not None:
            try:  # on rank 0 alone: an error must not leave the other ranks at a barrier
                texts = self.samples.take(self.model, self.eval_set, self.st.step)
            except Exception as e:
                self.log.warn(f"text samples failed ({type(e).__name__}: "
                              f"{' '.join(str(e).split())[:200]}); no more samples this run")
                self.samples, texts = None, []
            self.tracker.log_samples(self.st.step, texts)
            for s in texts[:1]:
                self.progress.message(f"sample: {(s['prompt'] + s['sample'])[:200]!r}")
        return reached

    def _reached_target(self, val_loss: float, train_seconds: float) -> bool:
        """Record the first evaluation at or below target_val_loss (logged with it as
        val/time_to_target_s, val/tokens_to_target). Training time, not wall time: evaluations
        and checkpoints are left out, so runs evaluating at different intervals compare fairly."""
        cfg, st = self.cfg, self.st
        if cfg.target_val_loss is None or not val_loss <= cfg.target_val_loss or \
                (st.target == cfg.target_val_loss and st.target_step is not None):
            return False
        st.target, st.target_step = cfg.target_val_loss, st.step
        st.time_to_target_s, st.tokens_to_target = train_seconds, st.tokens
        return True


class _Progress:
    """A tqdm bar on an interactive terminal; plain log lines otherwise (files, CI, SLURM)."""

    def __init__(self, log: RunLog, total: int, initial: int, mfu_label: str = ""):
        self.log, self.total, self.t0, self.initial = log, total, time.time(), initial
        self.mfu_label = mfu_label
        self.bar = None
        if log.is_main and sys.stdout.isatty():
            from tqdm.auto import tqdm
            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)

    def update(self, step: int, row: dict) -> None:
        stats = (f"loss {row['train/loss']:.4f} | lr {row['train/lr']:.2e} | "
                 f"grad {row['train/grad_norm']:.2f} | {row['train/tokens_per_sec']:,.0f} tok/s | "
                 f"{row['train/step_time'] * 1000:.0f} ms/step"
                 + (f" | mfu {row['train/mfu']:.1%}{self.mfu_label}" if "train/mfu" in row
                    else ""))
        done = step - self.initial
        eta = (time.time() - self.t0) / done * (self.total - step) if done > 0 else 0.0
        line = f"step {step:,}/{self.total:,} | {stats} | ETA {_hms(eta)}"
        if self.bar is not None:  # the bar shows step, total and ETA itself
            self.bar.n = step
            self.bar.set_postfix_str(stats, refresh=True)
            self.log.file_only(line)
        else:
            self.log.info(line)

    def message(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(msg)
            self.log.file_only(msg)
        else:
            self.log.info(msg)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class _TrainClock:
    """Wall time spent in training steps. Paused around evaluation and checkpoints so that
    tokens/s and MFU describe training alone. Pausing waits for queued GPU work first (once per
    eval or checkpoint, never in the hot loop) so that it is billed to training."""

    def __init__(self, device: torch.device):
        self.device = device
        self.banked, self.t0 = 0.0, time.perf_counter()

    def pause(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.banked += time.perf_counter() - self.t0

    def resume(self) -> None:
        self.t0 = time.perf_counter()

    def collect(self) -> float:
        """While paused: the training seconds not yet taken, handed over (the run is ending)."""
        banked, self.banked = self.banked, 0.0
        return banked

    def take(self) -> float:
        """Training seconds since the last take(); call after a host sync."""
        now = time.perf_counter()
        elapsed, self.banked, self.t0 = self.banked + now - self.t0, 0.0, now
        return elapsed


def _implicit_replication():
    from torch.distributed.tensor.experimental import implicit_replication
    return implicit_replication()


def _hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type
