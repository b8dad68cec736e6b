"""The batch plan, decided once at start: as written, discovered by the probe (the micro-batch
that fits, the fastest of those), or the resumed checkpoint's (train/plan.py puts it in the
run's plan)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from ..config.schema import Config
from ..config.sections import section
from ..hf_model import fresh_weights
from ..precision import Precision
from ..optim.optimizer import build_optimizer
from .fit import (DoesNotFit, cache_key, cache_path, check_target, choose_speed, discover,
                  make_trial, plan_from_fit)
from .plan import BatchPlan, manual_plan
from .sharded import as_sharded, fsdp_dtypes, sharding
from .speed import describe_speed, speed_table


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


def new_model(mcfg, activation_checkpointing: bool) -> nn.Module:
    """The model `mcfg` describes (a preset's GPT, or an hf: model), fresh."""
    model = mcfg.build()
    model.activation_checkpointing = activation_checkpointing
    return model


def written_plan(batch, world: int) -> "BatchPlan | None":
    """The batch plan as written (None with auto_batch_size: discovered once the model is
    known). Checked before anything is built, as is the target a discovered plan must meet.
    `batch`: the config's batch section."""
    if batch.auto:
        check_target(batch, world)
        return None
    return manual_plan(batch, world)


def decide_batch(cfg: Config, written: "BatchPlan | None", mcfg, prec: Precision, accelerator,
                 saved: dict, run_dir: str, log) -> BatchDecision:
    """The batch plan as written, or (auto_batch_size) the resumed checkpoint's micro-batch
    (`saved`: its derived values, {} for a fresh run), or the micro-batch that fits (the
    fastest of those that divide the target, timed), probed (or read from the cache) and
    agreed."""
    world = accelerator.num_processes
    if written is not None:
        return BatchDecision(written, "", cfg.activation_checkpointing)
    micro = saved_micro_batch(saved, world)
    if micro is not None:
        plan = plan_from_fit(section(cfg, "batch"), world, micro)
        return BatchDecision(plan, f"micro-batch {plan.micro} as in the checkpoint",
                             cfg.activation_checkpointing)
    return _discover(cfg, mcfg, prec, accelerator, run_dir, log)


def saved_micro_batch(saved: dict, world: int) -> "int | None":
    """The micro-batch the resumed checkpoint's run used (`saved`: its derived values), when it
    ran on as many processes: the resumed run then takes the same steps (auto_batch_size probes
    nothing)."""
    if saved.get("world_size") != world or not saved.get("micro_batch_size"):
        return None
    return int(saved["micro_batch_size"])


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

    opt = section(cfg, "optimizer")

    def trial(act: bool):
        return as_sharded(sharded, make_trial(
            build_model=lambda: new_model(fresh_weights(mcfg), act),  # the memory, not the weights
            build_precision=lambda: prec.fresh(device),
            build_optimizer=lambda m: build_optimizer(m, opt),
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
        plan = plan_from_fit(section(cfg, "batch"), accelerator.num_processes, fit.micro)
        return BatchDecision(plan, note, act)
    for line in describe_speed(speed, cfg.batch_speed_tolerance):
        log.msg(line)
    plan = plan_from_fit(section(cfg, "batch"), accelerator.num_processes, speed.micro)
    largest = speed.candidates[0]
    chosen = f"micro {speed.micro} the fastest of {len(speed.timings)} timed" + (
        f" (the largest, {largest}, is slower)" if speed.micro != largest else "")
    return BatchDecision(plan, f"{note}; {chosen}", act, tuple(speed_table(speed)))
