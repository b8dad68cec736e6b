"""The run's plan, decided once at start: the batch plan (written, discovered by the probe, or
the checkpoint's) and the run's length in optimizer steps."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from ..checkpoint.resume import saved_micro_batch
from ..config.schema import Config
from ..config.validate import set_with_or_after
from ..errors import BadInput
from ..model import GPT
from ..precision import Precision, build_precision
from ..optim.optimizer import build_optimizer
from ..optim.schedule import fp8_until_step
from .fit import (DoesNotFit, cache_key, cache_path, check_target, choose_speed, discover,
                  make_trial, plan_from_fit)
from .plan import BatchPlan, manual_plan
from .sharded import as_sharded, fsdp_dtypes, sharding
from .speed import describe_speed, speed_table


@dataclass(frozen=True)
class RunLength:
    total_steps: int        # when training stops (epochs / max_steps)
    lr_steps: int           # length of the LR schedule
    steps_per_epoch: int
    warmup_steps: int       # the warmup the schedule uses: the config's, or shortened
    warmup_note: str = ""   # why it was shortened (a warning), or ""
    fp8_until_note: str = ""  # fp8_until at or past the last step, or an old run's 1 (a warning)


# A warmup not shorter than its schedule becomes this fraction of it: a short run of a longer
# config (`--max_steps=20` over a warmup of 30) still warms up, and still decays.
SHORTENED_WARMUP = 0.1


def run_length(cfg: Config, train_tokens: int, plan: BatchPlan) -> RunLength:
    tokens_per_step = plan.effective * cfg.seq_len
    steps_per_epoch = max(1, math.ceil(train_tokens / tokens_per_step))
    candidates = [s for s in (
        math.ceil(cfg.num_epochs * steps_per_epoch) if cfg.num_epochs else None,
        cfg.max_steps) if s is not None]
    total = min(candidates)
    lr_steps = cfg.lr_decay_steps or total
    warmup, note = cfg.warmup_steps, ""
    by_epochs = not cfg.lr_decay_steps and lr_steps != cfg.max_steps
    if warmup >= lr_steps and by_epochs and set_with_or_after(cfg, "warmup_steps", "num_epochs"):
        # As for max_steps (config/validate.py): a length set with the warmup, or after it, means
        # both, and they contradict each other. Epochs become steps only now, with the data.
        raise BadInput(f"{cfg.where('warmup_steps', 'num_epochs')}: key 'warmup_steps' "
                          f"({cfg.warmup_steps}) must be smaller than the run's total steps "
                          f"(num_epochs {cfg.num_epochs} × {steps_per_epoch} steps/epoch = "
                          f"{lr_steps}): the LR would never decay")
    if warmup >= lr_steps:     # the contradictions above, and in config/validate.py, were refused
        warmup = int(lr_steps * SHORTENED_WARMUP)
        what = "lr_decay_steps" if cfg.lr_decay_steps else "the run's"
        note = (f"warmup_steps ({cfg.warmup_steps}, "
                f"{cfg.origins.get('warmup_steps', 'the default')}) is not shorter "
                f"than {what} {lr_steps} steps: warming up for {warmup} steps instead "
                f"({SHORTENED_WARMUP:.0%} of the schedule)")
    return RunLength(total, lr_steps, steps_per_epoch, warmup, note,
                     _fp8_until_note(cfg, total, lr_steps, steps_per_epoch))


def _fp8_until_note(cfg: Config, total: int, lr_steps: int, per_epoch: int) -> str:
    """fp8_until's hand-over at or after the run's last step would leave FP8 on to the end:
    refused when fp8_until was set with the run's length or after it (config/validate.py
    refuses what the config alone shows; a length from num_epochs is known only now), a
    warning when the length was set later (a short run of a config with a cool-down). Also the
    warning for `fp8_until: 1` in a run's own config.yaml, kept as the step it meant then."""
    step = fp8_until_step(cfg.fp8_until, lr_steps) if cfg.use_fp8 else None
    if step == 1 and cfg.fp8_until == 1:   # only from a run's own config.yaml: validate.py
        return ("key 'fp8_until' is 1 in the run's own config.yaml, written by an fp8train that "
                "read it as step 1: kept, so FP8 runs for the first step only, then the base "
                "precision; remove the line for FP8 to the end")
    if step is None or step < total:
        return ""
    lengths = [k for k in ("num_epochs", "max_steps", "lr_decay_steps")
               if getattr(cfg, k) is not None]
    what = (f"num_epochs {cfg.num_epochs:g} × {per_epoch:,} steps/epoch" if total != cfg.max_steps
            else "max_steps") + (f"; {cfg.fp8_until:g} of lr_decay_steps {lr_steps:,}"
                                 if cfg.fp8_until < 1 and cfg.lr_decay_steps else "")
    said = (f"key 'fp8_until' ({cfg.fp8_until:g}) hands FP8 over at step {step:,}, but the run "
            f"ends at step {total:,} ({what}), so FP8 runs to the end")
    if set_with_or_after(cfg, "fp8_until", *lengths):
        raise BadInput(f"{cfg.where('fp8_until', *lengths)}: {said}; remove fp8_until, or give "
                       f"a step below {total:,} or a fraction below 1")
    return f"{said} ({cfg.origins.get('fp8_until')} set it before the run's length)"


@dataclass(frozen=True)
class BatchDecision:
    plan: BatchPlan
    note: str = ""                          # how it was decided, for the log and config.yaml
    activation_checkpointing: bool = False  # the run's setting: the config's, or the probe's
    timings: tuple = ()                     # the timed micro-batches (speed.speed_table)

    def derived(self) -> dict:
        """config.yaml's derived keys of the decision."""
        return {**({"batch_discovery": self.note} if self.note else {}),
                **({"batch_timings": list(self.timings)} if self.timings else {})}


def new_model(mcfg, activation_checkpointing: bool) -> GPT:
    model = GPT(mcfg)
    model.activation_checkpointing = activation_checkpointing
    return model


def written_plan(cfg: Config, world: int) -> "BatchPlan | None":
    """The batch plan as written (None with auto_batch_size: discovered once the model is
    known). Checked before anything is built, as is the target a discovered plan must meet."""
    if cfg.auto_batch_size:
        check_target(cfg, world)
        return None
    return manual_plan(cfg, world)


def decide_batch(cfg: Config, written: "BatchPlan | None", mcfg, prec: Precision, accelerator,
                 checkpoint, run_dir: str, log) -> BatchDecision:
    """The batch plan as written, or (auto_batch_size) the checkpoint's micro-batch on resume,
    or the micro-batch that fits (the fastest of those that divide the target, timed), probed
    (or read from the cache) and agreed."""
    world = accelerator.num_processes
    if written is not None:
        return BatchDecision(written, "", cfg.activation_checkpointing)
    micro = saved_micro_batch(checkpoint, world) if checkpoint else None
    if micro is not None:
        plan = plan_from_fit(cfg, world, micro)
        return BatchDecision(plan, f"micro-batch {plan.micro} as in the checkpoint",
                             cfg.activation_checkpointing)
    return _discover(cfg, mcfg, prec, accelerator, run_dir, log)


def probe_config(cfg: Config, prec: Precision) -> Config:
    """The config the probe's trials build their precision from: the run's FP8 backend and
    recipe as `prec` has them (fp8 auto's choice, when the plan is probed again for it; a
    trial built from `fp8_recipe: auto` would measure the provisional backend)."""
    return prec.cfg if prec.fp8 else cfg


def _discover(cfg: Config, mcfg, prec: Precision, accelerator, run_dir: str,
              log) -> BatchDecision:
    device = accelerator.device
    act = cfg.activation_checkpointing
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        device_desc = f"{props.name}, {props.total_memory / 2**30:.1f} GiB"
    else:
        device_desc = device.type
    key = cache_key(cfg, dataclasses.asdict(mcfg), prec.name, device_desc,
                    accelerator.num_processes)
    sharded = None
    if accelerator.distributed_type == "FSDP":   # each trial's peak counted as sharded
        with torch.device("meta"):
            shapes_only = new_model(mcfg, act)
        sharded = sharding(shapes_only, accelerator.num_processes,
                           *fsdp_dtypes(prec.mixed_precision, device.type == "cuda"))
        log.msg(sharded.describe())
        key = dict(key, sharded=True)

    trial_cfg = probe_config(cfg, prec)

    def trial(act: bool):
        return as_sharded(sharded, make_trial(
            build_model=lambda: new_model(mcfg, act),
            build_precision=lambda: build_precision(trial_cfg, device, warn=lambda _: None,
                                                    run_dir=run_dir),
            build_optimizer=lambda m: build_optimizer(m, cfg),
            loss_fn=lambda model, x: model(x, x, penalty_type=cfg.penalty_type,
                                           penalty_weight=cfg.penalty_weight)[0],
            cfg=cfg, vocab_size=mcfg.vocab_size, device=device, autocast=accelerator.autocast,
            keep_grads=accelerator.distributed_type in ("MULTI_GPU", "MULTI_CPU", "FSDP")))

    def probe(act: bool, key: dict):
        return discover(cfg, trial(act), key, device, accelerator.process_index,
                        accelerator.num_processes, accelerator.is_main_process, log.msg, run_dir)

    note = ""
    try:
        fit = probe(act, key)
    except DoesNotFit as e:
        if act:
            raise
        # Recomputing activations costs ~30% more compute: worth it only when nothing fits
        # without it. The cache key includes the setting, so this probes (or reads) anew.
        log.warn(f"{e}; trying again with activation_checkpointing on")
        act = True
        key = dict(key, activation_checkpointing=True)
        fit = probe(act, key)
        note = "; activation_checkpointing turned on: micro-batch 1 did not fit without it"
    how = f"cached in {cache_path(cfg, run_dir)}" if fit.cached else \
        f"probe {fit.seconds:.1f} s"
    note = f"fitted micro {fit.micro} of max {cfg.max_batch_size} ({how}){note}"
    speed = choose_speed(cfg, trial(act), key, fit.micro, device, accelerator.num_processes,
                         accelerator.is_main_process, log.msg, run_dir)
    if speed is None:
        plan = plan_from_fit(cfg, accelerator.num_processes, fit.micro)
        return BatchDecision(plan, note, act)
    for line in describe_speed(speed, cfg.batch_speed_tolerance):
        log.msg(line)
    plan = plan_from_fit(cfg, accelerator.num_processes, speed.micro)
    largest = speed.candidates[0]
    chosen = f"micro {speed.micro} the fastest of {len(speed.timings)} timed" + (
        f" (the largest, {largest}, is slower)" if speed.micro != largest else "")
    return BatchDecision(plan, f"{note}; {chosen}", act, tuple(speed_table(speed)))
