"""The fastest micro-batch: the rule, the search over the candidates, the agreement over ranks and
the table. `fit.choose_speed` runs them on real training steps (fit.make_trial).

Larger is not always faster: past the point where a step is compute-bound, a larger micro-batch
only adds memory pressure (allocator churn, fragmentation). After the fit is known, each
micro-batch that divides the rank's share of the target is timed, largest first, on real
training steps of a throw-away model, and the one with the highest tokens/s of a whole optimizer
step is taken. Each rank times alone (no collectives), the ranks agree on the slowest rank's
figure per micro-batch, and the table is cached with the fit.

What the budget counts. Each timed micro-batch first warms up (a new model, its first steps
and, under `compile: true`, a compilation of its own with static shapes, as the run compiles at
its one micro-batch), then runs its timed steps. `batch_timing_budget_s` is charged with the
timed steps only; the warm-up is measured and reported apart. A GPT's first compiled step takes
longer than the default budget (24-73 s on an H200): charged to it, the largest candidate's
compile spent the budget before a second size was timed, and the "fastest" was always the
largest. One graph compiled with a dynamic batch dimension and reused across the sizes would
compile once, but it would time other kernels than the run's (inductor specialises code, and
CUDA graphs are recorded, per static shape), so every size compiles for itself; inductor's
on-disk caches then serve the run's own compile of the size it takes (on CPU, measured: the
tiny model's step recompiled after a reset in 0.6-1.3 s instead of 26-41 s cold).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, Optional

from ..ranks import RankFailed, gather

TIMED_STEPS = 3     # forward+backward micro-steps timed per candidate, after one warm-up step
CLEAR_FALL = 0.15   # a candidate this much slower than the best so far ends the search
BUDGET_KEY = "batch_timing_budget_s"
# Warm-up (building, compiling, CUDA graphs) is not charged to the budget, but it is bounded:
# after two sizes, no further size starts once warm-up has taken this many budgets (a compile
# of llama-1b with FP8 took 73 s on an H200: seven sizes would hold start-up for 8 minutes).
WARMUP_BUDGETS = 4


@dataclass(frozen=True)
class StepTimes:
    """One trial's measurements: the step's peak bytes and, when timed, the mean seconds of a
    forward+backward micro-step and of the optimizer step."""
    peak: int
    micro_s: float = 0.0
    optimizer_s: float = 0.0


@dataclass(frozen=True)
class Timing:
    micro: int
    tokens_per_sec: float
    peak_bytes: Optional[int]
    timed_s: Optional[float] = None    # its timed steps: what the budget is charged with
    warmup_s: Optional[float] = None   # the rest of its trial (model, first steps, compiling)


@dataclass(frozen=True)
class Speed:
    micro: int              # the micro-batch chosen
    timings: tuple          # agreed Timings, largest micro-batch first
    candidates: tuple       # every micro-batch that could have been timed, largest first
    stopped: str            # why the search ended before the last candidate ("": it did not)
    seconds: float          # timed steps, charged to the budget (the slowest rank); 0 if cached
    cached: bool
    per_rank: int           # sequences per rank per optimizer step
    warmup_seconds: float = 0.0   # the rest of the timing: warm-ups, compiles (slowest rank)
    compiled: bool = False        # the sizes were timed under torch.compile


def speed_candidates(per_rank: int, fitted: int, maximum: int) -> list:
    """The micro-batches a rank's `per_rank` sequences split into evenly, up to the fit, largest
    first."""
    cap = min(fitted, per_rank, maximum)
    return [d for d in range(cap, 0, -1) if per_rank % d == 0]


def step_tokens_per_sec(times: StepTimes, micro: int, per_rank: int, seq_len: int) -> float:
    """Tokens/s of a whole optimizer step at micro-batch `micro`: per_rank / micro micro-steps
    and one optimizer step (whose cost a smaller micro-batch does not spread as far)."""
    seconds = per_rank // micro * times.micro_s + times.optimizer_s
    return per_rank * seq_len / seconds if seconds > 0 else float("inf")


def fastest(timings, tolerance: float) -> int:
    """The micro-batch with the highest tokens/s. Going down from the largest, a smaller one
    replaces the best only when it is faster by more than `tolerance`: within timing noise the
    larger one is kept (fewer micro-steps, the same memory it was measured to fit in)."""
    best = None
    for t in sorted(timings, key=lambda t: -t.micro):
        if best is None or t.tokens_per_sec > best.tokens_per_sec * (1 + tolerance):
            best = t
    return best.micro


def time_candidates(measure: Callable[[int], Optional[Timing]], candidates, budget_s: float,
                    clock: Callable[[], float] = time.perf_counter) -> "tuple[list, str]":
    """Time `candidates` largest first, until the throughput clearly falls (CLEAR_FALL below the
    best so far) or the next one's timed steps would overrun `budget_s` (taken to cost what the
    last one's did). The budget is charged with each Timing's `timed_s` only (the whole call
    when `measure` does not report it); the rest of the call is its `warmup_s`, not charged,
    but bounded: once two sizes are timed, the next one would not start past WARMUP_BUDGETS
    budgets of warm-up (taken to cost what the last one's did).
    `measure(micro)` is None for a micro-batch that ran out of memory (nothing charged).
    Returns the timings and why the search stopped early ("" when every candidate was timed)."""
    timings, spent, last, warm = [], 0.0, 0.0, 0.0
    for micro in candidates:
        if timings and spent + last > budget_s:
            return timings, budget_stop(budget_s, timings, spent, last)
        if len(timings) >= 2 and warm + timings[-1].warmup_s > WARMUP_BUDGETS * budget_s:
            return timings, (f"warm-up (compiling) took {warm:.3g} s for {len(timings)} sizes: "
                             f"another would pass {WARMUP_BUDGETS} × the {budget_s:g} s timing "
                             f"budget ({BUDGET_KEY})")
        t0 = clock()
        t = measure(micro)
        cost = clock() - t0
        if t is None:
            continue
        last = cost if t.timed_s is None else t.timed_s
        spent += last
        t = replace(t, timed_s=last, warmup_s=max(0.0, cost - last))
        warm += t.warmup_s
        timings.append(t)
        best = max(x.tokens_per_sec for x in timings)
        if t.tokens_per_sec < (1 - CLEAR_FALL) * best:
            return timings, (f"micro {micro} was {1 - t.tokens_per_sec / best:.0%} slower than "
                             "the best: smaller ones were not timed")
    return timings, ""


def budget_stop(budget_s: float, timings: list, spent: float, last: float) -> str:
    """Why the budget ended the search (it names BUDGET_KEY: cached_speed relies on it)."""
    budget = f"the {budget_s:g} s timing budget ({BUDGET_KEY})"
    if len(timings) == 1:
        return (f"{budget} cannot time a second micro-batch to compare: micro "
                f"{timings[0].micro}'s timed steps took {last:.3g} s")
    return f"{budget} was spent ({spent:.3g} s of timed steps)"


def agree_speed(local: Optional[list], seconds: float, warmup: float,
                error: Optional[str]) -> "tuple[list, float, float]":
    """One all-gather of every rank's timings (or error): the micro-batches timed on every rank,
    at the slowest rank's tokens/s (a step waits for it) and the largest peak; and the slowest
    rank's timed and warm-up seconds."""
    gathered = gather(([(t.micro, t.tokens_per_sec, t.peak_bytes, t.timed_s, t.warmup_s)
                        for t in local or []], seconds, warmup, error))
    for rank, (_, _, _, err) in enumerate(gathered):
        if err:
            raise RankFailed(f"micro-batch timing failed on rank {rank}: {err}")
    return (combine_timings([ts for ts, _, _, _ in gathered]), max(g[1] for g in gathered),
            max(g[2] for g in gathered))


def combine_timings(by_rank: list) -> list:
    """Each rank's [(micro, tokens/s, peak bytes[, timed s, warm-up s])] -> the Timings of the
    micro-batches every rank timed, at the slowest rank's tokens/s, the largest peak and the
    longest timed and warm-up seconds, largest micro-batch first."""
    tables = [{row[0]: tuple(row[1:]) + (None,) * (5 - len(row)) for row in ts}
              for ts in by_rank]
    common = set.intersection(*(set(d) for d in tables))

    def most(m, i):
        return max((d[m][i] for d in tables if d[m][i] is not None), default=None)
    return [Timing(m, min(d[m][0] for d in tables), most(m, 1), most(m, 2), most(m, 3))
            for m in sorted(common, reverse=True)]


def cached_speed(speed, per_rank: int, candidates: list, budget_s: float):
    """(timings, why the search stopped) of a cached table that answers this search: the same
    per-rank target and candidates, and not cut short by a smaller budget than this one's.
    None when there is none (a malformed entry included)."""
    if not (isinstance(speed, dict) and speed.get("per_rank") == per_rank and
            speed.get("candidates") == candidates):
        return None
    stopped = str(speed.get("stopped", ""))
    if BUDGET_KEY in stopped and speed.get("budget_s") != budget_s:
        return None   # a different budget may time more (or fewer) micro-batches

    def seconds(row, name):
        return None if row.get(name) is None else float(row[name])
    try:
        timings = [Timing(int(t["micro"]), float(t["tokens_per_sec"]),
                          None if t.get("peak_gb") is None else int(t["peak_gb"] * 1e9),
                          seconds(t, "timed_s"), seconds(t, "warmup_s"))
                   for t in speed["timings"]]
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    return (timings, stopped) if timings else None


def speed_table(speed: Speed) -> list:
    """The timings as config.yaml's derived section and the cache record them: per micro-batch
    its accumulation, tokens/s and peak GB, and the seconds of its timed steps (charged to the
    budget) and of its warm-up (not charged) where known."""
    rows = []
    for t in speed.timings:
        row = dict(micro=t.micro, accum=speed.per_rank // t.micro,
                   tokens_per_sec=round(t.tokens_per_sec, 1),
                   peak_gb=None if t.peak_bytes is None else round(t.peak_bytes / 1e9, 4))
        row.update({k: round(v, n) for k, v, n in (("timed_s", t.timed_s, 4),
                                                   ("warmup_s", t.warmup_s, 2)) if v is not None})
        rows.append(row)
    return rows


def describe_speed(speed: Speed, tolerance: float) -> list:
    """The log's table: one line per timed micro-batch, the chosen one marked; the seconds of
    timed steps (what the budget counts) apart from the warm-ups and compiles."""
    if speed.cached:
        how = "cached"
    else:
        how = (f"{speed.seconds:.1f} s of timed steps + {speed.warmup_seconds:.1f} s warm-up" +
               (" and compiling, not counted in the budget" if speed.compiled else ""))
    lines = [f"batch timing ({how}): tokens/s of a whole step of {speed.per_rank} sequences per "
             f"rank; a smaller micro-batch must be over {tolerance:.0%} faster to be taken"]
    alone = len(speed.timings) == 1
    for t in speed.timings:
        mem = "" if t.peak_bytes is None else f", {t.peak_bytes / 1e9:.3f} GB"
        secs = "" if t.timed_s is None or t.warmup_s is None else \
            f"; timed {t.timed_s:.3g} s, warm-up {t.warmup_s:.1f} s"
        mark = "  <- fastest" if t.micro == speed.micro and not alone else ""
        lines.append(f"  micro {t.micro:>4} × accum {speed.per_rank // t.micro:<5}"
                     f"{t.tokens_per_sec:>12,.0f} tokens/s{mem}{secs}{mark}")
    untimed = [m for m in speed.candidates if m not in {t.micro for t in speed.timings}]
    if untimed and speed.stopped:
        lines.append(f"  not timed: {', '.join(map(str, untimed))} ({speed.stopped})" +
                     (f": nothing was compared, micro {speed.micro} is kept" if alone else ""))
    return lines
