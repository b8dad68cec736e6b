"""Micro-batch discovery: the largest micro-batch that really fits, agreed by every rank.

Each rank runs real training steps (forward, backward, optimizer step, which allocates the
optimizer state) of a throw-away copy of the model at the real seq_len, precision and compile
mode, on synthetic tokens. The micro-batch doubles from 1 until a step runs out of memory, goes
over the budget (device memory minus `memory_headroom`) or reaches `max_batch_size`; a binary
search between the last fit and the first failure follows. Only out-of-memory errors count as
"does not fit" (torch's, and the plain RuntimeErrors that libraries with their own C++ raise for
an allocation failure); anything else is a bug and stops the run. Each trial runs without
collectives across ranks (Precision.for_trials), and what it leaves in process-wide state
(Transformer Engine's amax buffers, compiled graphs and CUDA graph pools) is cleared before the
next; after the search the peak-memory statistics start afresh.

The ranks then agree on the smallest fit with one all-gather, which also carries errors: a rank
whose probe failed makes every rank stop with its message instead of leaving the others waiting
in a collective. The result is cached (batch_probe.json) under a key of everything that changes
memory use, so reruns and requeued jobs skip the probe.

The largest fit is not always the fastest: `choose_speed` then times the micro-batches up to it
that divide the rank's share of the target and takes the fastest (the rule, the budget and the
table: speed.py); its table is cached beside the fit.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ..config.schema import Config
from ..config.sections import section
from ..errors import BadInput, is_out_of_memory, one_line
from ..io import read_entry, write_entry
from ..memory import release_memory
from ..compile import compile_model
from ..ranks import RankFailed, gather
from .plan import BatchPlan, nearest_valid_targets
from .speed import (TIMED_STEPS, Speed, StepTimes, Timing, agree_speed, cached_speed, fastest,
                    speed_candidates, speed_table, step_tokens_per_sec, time_candidates)

CACHE_FILE = "batch_probe.json"


# --- the search ---------------------------------------------------------------------------------

def search_max_batch(fits: Callable[[int], bool], maximum: int) -> int:
    """Largest b in [1, maximum] with fits(b), assuming fits is monotone (True up to some N).
    Doubling from 1, then bisection: about 2·log2(N) calls. 0 when even 1 does not fit."""
    lo, hi, b = 0, None, 1
    while True:
        if fits(b):
            lo = b
            if b >= maximum:
                break
            b = min(2 * b, maximum)
        else:
            hi = b
            break
    while hi is not None and hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


@dataclass
class Probe:
    """fits(micro) for the search: run `trial(micro)` (returns the peak bytes it used) and
    compare with the budget. A real out-of-memory error means "does not fit"."""
    trial: Callable[[int], int]
    budget_bytes: float
    trials: list = field(default_factory=list)   # (micro, fitted, peak bytes or None)

    def fits(self, micro: int) -> bool:
        try:
            peak = self.trial(micro)
        except Exception as e:
            if not is_out_of_memory(e):
                raise
            peak = None
        finally:
            release_memory()
        ok = peak is not None and peak <= self.budget_bytes
        self.trials.append((micro, ok, peak))
        return ok


# --- one real training step, measured -----------------------------------------------------------

class _SavedTensorBytes:
    """CPU has no allocator statistics: count the bytes autograd keeps for backward (the
    activations), each storage once. With parameters, gradients and optimizer state this is the
    step's peak up to short-lived temporaries."""

    def __init__(self):
        self.bytes, self.seen = 0, set()

    def pack(self, t: torch.Tensor):
        st = t.untyped_storage()
        if st.data_ptr() not in self.seen:
            self.seen.add(st.data_ptr())
            self.bytes += st.nbytes()
        return t

    @staticmethod
    def unpack(t):
        return t


def make_trial(build_model: Callable[[], torch.nn.Module], build_precision, build_optimizer,
               loss_fn, cfg: Config, vocab_size: int, device: torch.device, autocast,
               keep_grads: bool = False):
    """A function micro -> peak bytes of one full training step at that micro-batch, with the
    optimizer state already allocated (as from the run's second step on). `keep_grads`: the
    gradients stay allocated between steps, as in a run whose gradients never go back to None
    (DDP's live in its all-reduce buckets; FSDP2's sharded ones are counted so by sharded.py):
    the peak at the start of backward then holds them too. Its `timed(micro,
    steps)` also times `steps` more micro-steps and one more optimizer step (StepTimes).
    `loss_fn(model, x)`: the loss of the (compiled) model on tokens x, as the run computes it
    (the model's own loss, inside its compiled forward)."""

    model_section = section(cfg, "model")

    def run(micro: int, timed_steps: int) -> StepTimes:
        prec = build_precision().for_trials()
        try:
            return _step(prec, micro, timed_steps)
        finally:
            prec.reset_trials()
            if cfg.compile and (timed_steps or uses_cuda_graphs(cfg.compile_mode)):
                # CUDA graph pools hold this trial's memory until dynamo forgets them: the next
                # trial must start from an empty device. A timed trial is forgotten too, so that
                # the next micro-batch compiles with static shapes, as the run will (dynamo
                # would mark the batch dimension dynamic on its second size).
                torch.compiler.reset()

    def _step(prec, micro: int, timed_steps: int) -> StepTimes:
        model = prec.convert(build_model().to(device))
        model.train()
        step_model, _ = compile_model(model, model_section)   # as the run compiles it
        opt = build_optimizer(model)
        x = torch.randint(0, vocab_size, (micro, cfg.seq_len), device=device)
        # AdamW allocates its two moments at its first step, after that step's activations are
        # freed; in the run they are held through every later forward and backward. Allocate
        # them first, so that the step measured is a steady-state one.
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=not keep_grads)
        cuda = device.type == "cuda"
        sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        counter = _SavedTensorBytes()
        # Weights saved for backward are counted with the parameters, not as activations.
        counter.seen.update(p.untyped_storage().data_ptr() for p in model.parameters())

        def micro_step():
            with autocast(), prec.forward_context(training=True):
                loss = loss_fn(step_model, x)
            loss.backward()

        with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
            micro_step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        if cuda:
            peak = torch.cuda.max_memory_reserved(device)
        else:   # parameters + gradients + AdamW's two moments, and the activations
            peak = 4 * sum(p.numel() * p.element_size() for p in model.parameters()) + \
                counter.bytes
        if not timed_steps:
            return StepTimes(peak)
        # The step above was the warm-up (first calls, compilation, allocator growth); one more
        # untimed micro-step is where CUDA graph trees record (reduce-overhead, max-autotune).
        # These run without the counting hooks, as the run's steps do.
        micro_step()
        sync()
        t0 = time.perf_counter()
        for _ in range(timed_steps):
            micro_step()
        sync()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        return StepTimes(peak, (t1 - t0) / timed_steps, time.perf_counter() - t1)

    def trial(micro: int) -> int:
        return run(micro, 0).peak

    trial.timed = run
    return trial


def uses_cuda_graphs(compile_mode: str) -> bool:
    """torch.compile modes that capture CUDA graphs (each keeps a private memory pool)."""
    return compile_mode in ("reduce-overhead", "max-autotune")


def device_budget(cfg: Config, device: torch.device, rank: int) -> float:
    """Bytes a micro-batch may use on `rank`'s device: (1 - memory_headroom) × the device's
    memory, or × probe_memory_limit_gb when it is set (the same on every rank)."""
    limit_gb = cfg.probe_memory_limit_gb
    if limit_gb is not None:
        total = limit_gb * 1e9
    elif device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
    else:
        total = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return total * (1.0 - cfg.memory_headroom)


# --- the cache ----------------------------------------------------------------------------------

def cache_key(cfg: Config, model_desc: dict, precision: str, device_desc: str, world: int) -> dict:
    """Everything that changes how much memory a micro-batch takes (or how much there is)."""
    return dict(model=model_desc, seq_len=cfg.seq_len, precision=precision,
                compile=cfg.compile, compile_mode=cfg.compile_mode,
                activation_checkpointing=cfg.activation_checkpointing,
                device=device_desc, world_size=world, torch=torch.__version__,
                max_batch_size=cfg.max_batch_size, memory_headroom=cfg.memory_headroom,
                memory_limit=cfg.probe_memory_limit_gb)


def cache_path(cfg: Config, run_dir: Optional[str] = None) -> str:
    """batch_probe.json in batch_cache_dir, else in the run's directory (`run_dir`: a sweep
    trial's own; default output_dir)."""
    return os.path.join(cfg.cache_dir(run_dir), CACHE_FILE)


def read_cache(path: str, key: dict) -> Optional[dict]:
    return read_entry(path, key)


def write_cache(path: str, key: dict, fitted: int, seconds: float, trials: list) -> None:
    write_entry(path, key, dict(
        fitted_micro_batch=fitted, probe_seconds=round(seconds, 2),
        trials=[dict(micro=m, fits=ok, peak_gb=None if peak is None else round(peak / 1e9, 4))
                for m, ok, peak in trials]))


# --- agreement ----------------------------------------------------------------------------------

@dataclass
class Fit:
    micro: int              # agreed fitted micro-batch (the minimum over ranks)
    seconds: float          # probe time (the slowest rank); 0 when every rank used the cache
    cached: bool


class DoesNotFit(BadInput):
    """Micro-batch 1 does not fit the memory budget (on some rank)."""


def agree(local_micro: Optional[int], seconds: float, cached: bool, error: Optional[str],
          not_fitting: Optional[str], world: int) -> Fit:
    """One all-gather: every rank learns every rank's result or error, so a failure anywhere
    stops every rank with the same message, and no rank waits for one that left."""
    gathered = gather((local_micro, seconds, cached, error, not_fitting))
    for rank, (_, _, _, err, _) in enumerate(gathered):
        if err:
            raise RankFailed(f"batch discovery failed on rank {rank}: {err}")
    for rank, (_, _, _, _, nf) in enumerate(gathered):
        if nf:
            raise DoesNotFit(nf if world == 1 else f"rank {rank}: {nf}")
    return Fit(micro=min(g[0] for g in gathered), seconds=max(g[1] for g in gathered),
               cached=all(g[2] for g in gathered))


def discover(cfg: Config, trial: Callable[[int], int], key: dict, device: torch.device,
             rank: int, world: int, is_main: bool, info: Callable[[str], None],
             run_dir: Optional[str] = None) -> Fit:
    """Cached or probed fitted micro-batch, agreed over ranks."""
    path = cache_path(cfg, run_dir)
    hit = None if cfg.reprobe else read_cache(path, key)
    micro, seconds, error, not_fitting, probe = cached_fit(hit), 0.0, None, None, None
    if micro is None:   # no entry, or one without a usable fit (edited, or half written)
        hit = None
        t0 = time.perf_counter()
        try:  # everything a rank can fail on stays inside: the others wait in agree()
            budget = device_budget(cfg, device, rank)
            info(f"batch discovery: probing micro-batches up to {cfg.max_batch_size} within "
                 f"{budget / 1e9:.2f} GB ({1 - cfg.memory_headroom:.0%} of the memory budget)")
            probe = Probe(trial, budget)
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                micro = search_max_batch(probe.fits, cfg.max_batch_size)
        except Exception as e:  # not an OOM: report it on every rank, then stop
            error = one_line(e, with_type=True)
        seconds = time.perf_counter() - t0
        after_trials(cfg, device)
        if error is None and micro == 0:
            peak = probe.trials[0][2]
            used = f"{peak / 1e9:.2f} GB" if peak else "out of memory"
            not_fitting = (f"{cfg.source}: the model does not fit with micro-batch 1 at seq_len "
                           f"{cfg.seq_len} ({used}; budget {budget / 1e9:.2f} GB with "
                           f"memory_headroom {cfg.memory_headroom}); use a smaller model or "
                           "seq_len, activation_checkpointing, or a larger memory budget")
    fit = agree(micro, seconds, hit is not None, error, not_fitting, world)
    if is_main and probe is not None:
        write_quietly(lambda: write_cache(path, key, fit.micro, fit.seconds, probe.trials),
                      path, info)
    return fit


def cached_fit(entry: Optional[dict]) -> Optional[int]:
    """The fitted micro-batch a cache entry holds; None when it holds none that can be used."""
    value = (entry or {}).get("fitted_micro_batch")
    return value if type(value) is int and value >= 1 else None


def write_quietly(write: Callable[[], None], path: str, info: Callable[[str], None]) -> None:
    """A cache write (rank 0, after the ranks agreed) that cannot fail the run: a cache that
    cannot be written only means the next run measures again."""
    try:
        write()
    except OSError as e:
        info(f"batch discovery: could not write the cache '{path}' ({one_line(e)}): the next "
             "run measures again")


def after_trials(cfg: Config, device: torch.device) -> None:
    """The run starts afresh after a series of trials: its peak memory counted from here, not
    from the last trial; compiled anew (the trials' micro-batches differ, so dynamo marked the
    batch dimension dynamic: the run's model, at one fixed micro-batch, compiles with static
    shapes)."""
    release_memory(device)
    if cfg.compile:
        torch.compiler.reset()


# --- the fastest micro-batch (the rule and the table: speed.py) ---------------------------------

def measure_with(trial, per_rank: int, seq_len: int) -> Callable[[int], Optional[Timing]]:
    """measure(micro) for time_candidates over a make_trial trial (None: out of memory); its
    `timed_s` is the trial's timed steps alone (what the budget is charged with)."""
    def measure(micro: int) -> Optional[Timing]:
        try:
            times = trial.timed(micro, TIMED_STEPS)
        except Exception as e:
            if not is_out_of_memory(e):
                raise
            return None
        finally:
            release_memory()
        return Timing(micro, step_tokens_per_sec(times, micro, per_rank, seq_len), times.peak,
                      timed_s=TIMED_STEPS * times.micro_s + times.optimizer_s)
    return measure


def choose_speed(cfg: Config, trial, key: dict, fitted: int, device: torch.device, world: int,
                 is_main: bool, info: Callable[[str], None], run_dir: Optional[str] = None,
                 clock: Callable[[], float] = time.perf_counter) -> Optional[Speed]:
    """The fastest micro-batch up to `fitted` that divides this rank's share of the target,
    timed (or read from the cache beside the fit) and agreed; None when there is nothing to
    choose (batch_timing_budget_s 0, or one candidate: said in one line)."""
    per_rank = cfg.target_effective_batch_size // world
    candidates = speed_candidates(per_rank, fitted, cfg.max_batch_size)
    if cfg.batch_timing_budget_s <= 0:
        return None
    if len(candidates) < 2:
        info(f"batch timing: skipped, nothing to compare: {candidates[0]} is the only "
             f"micro-batch up to the fit ({fitted}) that divides the {per_rank} sequences per "
             "rank")
        return None
    path = cache_path(cfg, run_dir)
    entry = read_cache(path, key) or {}
    hit = None if cfg.reprobe else cached_speed(entry.get("speed"), per_rank, candidates,
                                                 cfg.batch_timing_budget_s)
    local, stopped, error, timed, warmup = None, "", None, 0.0, 0.0
    if hit is not None:
        local, stopped = hit
    else:
        info(f"batch timing: micro-batches {', '.join(map(str, candidates))} (they divide the "
             f"{per_rank} sequences per rank), largest first, within "
             f"{cfg.batch_timing_budget_s:g} s of timed steps" +
             (" (each size compiles first, not counted)" if cfg.compile else ""))
        t0 = clock()
        try:   # as in discover: a failure on one rank is reported on every rank by agree_speed
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                local, stopped = time_candidates(measure_with(trial, per_rank, cfg.seq_len),
                                                 candidates, cfg.batch_timing_budget_s, clock)
        except Exception as e:
            error = one_line(e, with_type=True)
        timed = sum(t.timed_s for t in local or [])
        warmup = max(0.0, clock() - t0 - timed)
        after_trials(cfg, device)
    timings, timed, warmup = agree_speed(local, timed, warmup, error)
    if not timings:   # every candidate ran out of memory while timed: the fit decides
        info("batch timing: no micro-batch could be timed (out of memory); keeping the largest")
        return None
    speed = Speed(fastest(timings, cfg.batch_speed_tolerance), tuple(timings),
                  tuple(candidates), stopped, timed, hit is not None, per_rank, warmup,
                  cfg.compile)
    if is_main and hit is None:
        kept = {k: v for k, v in entry.items() if k not in ("key", "date")}
        table = dict(per_rank=per_rank, candidates=candidates, stopped=stopped,
                     budget_s=cfg.batch_timing_budget_s, seconds=round(timed + warmup, 2),
                     timed_s=round(timed, 4), warmup_s=round(warmup, 2),
                     timings=speed_table(speed))
        write_quietly(lambda: write_entry(path, key, dict(kept, fitted_micro_batch=fitted,
                                                          speed=table)), path, info)
    return speed

# --- the plan -----------------------------------------------------------------------------------

def check_target(batch, world: int) -> int:
    """Sequences per rank per step; the target must split evenly over the ranks. `batch`: the
    config's batch section."""
    target = batch.target
    if target % world:
        near = nearest_valid_targets(target, world)
        raise BadInput(
            f"{batch.where('target_effective_batch_size')}: key 'target_effective_batch_size' "
            f"({target}) is not divisible by the "
            f"world size ({world}); nearest valid: {' or '.join(map(str, near))}")
    return target // world


def plan_from_fit(batch, world: int, fitted: int) -> BatchPlan:
    """The largest micro-batch ≤ fitted that divides the per-rank share of the target, and the
    accumulation that makes micro × accum × world == target exactly. `batch`: the config's
    batch section."""
    per_rank = check_target(batch, world)
    cap = min(fitted, per_rank, batch.max_micro)
    micro = max(d for d in range(1, cap + 1) if per_rank % d == 0)
    return BatchPlan(micro, per_rank // micro, world)
