"""fp8_recipe: auto and fp8_backend: auto: the FP8 recipe (and backend) measured fastest on this
GPU for this model's Linear shapes, among those whose numerics pass a check against bf16.

Which recipe wins depends on the GPU, the shapes and the token count: nanochat measured
torchao's rowwise slower than bf16 (0.90x) where tensorwise was faster; torchtitan measured
rowwise 1.05x and tensorwise 1.25x at 8B. So `auto` times each candidate with the harness of
fp8_layers: auto (timing.py): every distinct eligible shape, forward + backward at the run's
token count, compiled when the run compiles, cached in fp8_layers.json under the key fp8_layers:
auto uses (so its decision afterwards times nothing).

- Candidates: the backend's recipes (te: delayed, current, block where TE says the GPU runs it;
  torchao: tensorwise, rowwise; native: delayed, current), or with fp8_backend: auto those of
  every backend that can run here (a machine without Transformer Engine still gets the best
  FP8 it can run). One that cannot run is listed with TE's or the import's reason.
- A candidate's time: the converted Linears of one micro-batch as the run would run them
  (with fp8_layers: auto, each shape in FP8 only where FP8 wins by fp8_auto_margin). The base
  precision is timed once per shape; each candidate is compiled once per shape and forgotten
  before the next. The table says how long Python took to queue each step against the GPU's
  time (host / device): a ratio near 1 or above means the timing is host-bound.
- Numerics (numerics.py): one layer of each shape, with the model's weights, input rows and
  output gradient captured from one forward and backward of the model on the run's data, in
  bf16 and in FP8 (after a few steps, so that delayed scaling has a history): the relative
  error ||fp8 - bf16|| / ||bf16|| of the output must stay under MAX_OUTPUT_ERROR and of the
  input gradient under MAX_GRAD_ERROR, at every shape. E4M3 (3 mantissa bits) rounds each
  operand by at most 2^-4; a sound recipe lands at a few percent; one that underflows or
  saturates lands near 1.
- Ranks: with several, the candidates are shared out (rank r takes every world-th); each rank
  times the base precision for its own and checks their numerics, and one bounded agreement
  (ranks.Phase) gives every rank the whole table: no rank sits in a collective while another
  compiles, and a stop signal ends the wait at once. Speeds compare as ratios to each rank's
  own base-precision time. Rank 0 writes the cache.
- Cost: the whole choice's seconds and graphs compiled are in the log and the record;
  `fp8_choice_budget_s` caps it (candidates not reached are listed as not timed).
- The fastest candidate that passes is taken; none passing keeps the backend's default, with a
  warning. The choice and the table go to the log, config.yaml (derived: fp8_backend,
  fp8_recipe, fp8_choice), W&B and summary.json; a resumed run takes its checkpoint's choice.
- On a CPU nothing is timed (FP8 is emulated, slower whatever the recipe): auto takes the
  backend's default (native's with fp8_backend: auto) and says why.
- The choosing logic takes an injected `timer` (timing.LayerTimer's interface) and
  `numerics_for`, tested on a CPU; the real ones run on any device (a CPU: the tests)."""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn

from .spec import AUTO_RECIPES

# The recipes auto weighs, per backend, and the backends' order: spec.py's AUTO_RECIPES and
# BACKENDS, from the config's one table of backends and recipes.
MAX_OUTPUT_ERROR = 0.10
MAX_GRAD_ERROR = 0.20


@dataclass
class Trial:
    backend: str
    recipe: str
    why_not: Optional[str] = None       # cannot run here
    seconds: Optional[float] = None     # converted Linears, one micro-batch, as the run would
    base_seconds: Optional[float] = None   # the same Linears in the base precision
    output_error: Optional[float] = None
    grad_error: Optional[float] = None
    cached: bool = False
    host_ratio: Optional[float] = None  # Python's queuing time / the GPU's, worst shape
    rank: int = 0                       # the rank that timed it
    skipped: Optional[str] = None       # not timed: the budget ran out
    # shape -> (base s, fp8 s): what the cache stores (left out of the record)
    timings: dict = field(default_factory=dict, repr=False)

    @property
    def name(self) -> str:
        return f"{self.backend} {self.recipe}"

    @property
    def speedup(self) -> float:
        """Base-precision time / this recipe's: comparable between ranks (each times its own
        base)."""
        return self.base_seconds / self.seconds if self.seconds else math.inf

    def measured(self) -> bool:
        return self.why_not is None and self.skipped is None and self.seconds is not None

    def numerics_pass(self) -> bool:
        return self.output_error is not None and self.output_error <= MAX_OUTPUT_ERROR and \
            self.grad_error is not None and self.grad_error <= MAX_GRAD_ERROR


def step_seconds(timings: dict, counts: dict, layers: str, margin: float) -> "tuple[float, float]":
    """(seconds as the run would run these shapes, seconds all in the base precision)."""
    from .policy import fp8_wins
    run = base = 0.0
    for shape, n in counts.items():
        b, f = timings[shape]
        base += n * b
        run += n * (b if layers == "auto" and not fp8_wins(b, f, margin) else f)
    return run, base


@dataclass
class Share:
    """One rank's part of the choice: its (candidate index, Trial)s and what they cost."""
    trials: list
    seconds: float = 0.0
    graphs: int = 0
    source: Optional[str] = None   # what the numerics ran on (None: nothing checked)


def try_share(spec, mine: list, make: Callable[[object], object], device: torch.device,
              counts: dict, cached: Callable, timer, numerics_for: Callable,
              budget_s: float) -> Share:
    """Time and check each of `mine` ((index, Trial) of this rank): `make(spec)` builds a
    candidate's backend, `cached(backend)` returns its timings from the cache or None,
    `timer` (timing.LayerTimer) times the shapes, `numerics_for(backend)` gives its (output
    error, gradient error).

    Shape by shape: the base precision once, then each candidate on the same shape, seconds
    apart, so that clock changes over the minutes of the choice hit the base and the candidates
    alike; the compiled layers of a shape are forgotten before the next. After each shape the
    time left is projected from the time each candidate took so far: candidates from the end
    of the list that would not fit in `budget_s` are not timed (the first always is)."""
    from ..errors import one_line
    t0 = time.monotonic()
    backends, todo = {}, []
    for _, trial in mine:
        # A candidate that fails (a recipe TE refuses for this format, out of memory at this
        # token count, a kernel this GPU lacks) is listed with why, not the end of the run.
        try:
            backend = make(spec.decide(trial.backend, trial.recipe, "chosen"))
            trial.why_not = backend.unavailable(device)
            if trial.why_not:
                continue
            backends[id(trial)] = backend
            timings = cached(backend)
            if timings is not None:
                trial.cached, trial.timings = True, timings
            else:
                todo.append(trial)
        except Exception as e:
            trial.why_not = f"failed: {one_line(e, with_type=True)}"
    spent = {id(t): 0.0 for t in todo}
    ratios: dict = {id(t): [] for t in todo}
    shapes = list(counts)
    for done, shape in enumerate(shapes):
        live = [t for t in todo if t.why_not is None and t.skipped is None]
        if not live:
            break
        base = timer.base(shape)
        for t in live:
            t_shape = time.monotonic()
            try:
                fp8 = timer.fp8(backends[id(t)], shape)
                t.timings[shape] = (base.seconds, fp8.seconds)
                ratios[id(t)] += [base.host_ratio, fp8.host_ratio]
            except Exception as e:
                t.why_not, t.timings = f"failed: {one_line(e, with_type=True)}", {}
            spent[id(t)] += time.monotonic() - t_shape
        timer.forget()   # one compile per candidate and shape: the next shape starts afresh
        _keep_within(live, spent, done + 1, len(shapes), time.monotonic() - t0, budget_s)
    for _, t in mine:
        if t.why_not or t.skipped or len(t.timings) < len(shapes):
            continue
        if ratios.get(id(t)):
            t.host_ratio = max(ratios[id(t)])
        try:
            t.seconds, t.base_seconds = step_seconds(t.timings, counts, spec.layers,
                                                     spec.auto_margin)
            t.output_error, t.grad_error = numerics_for(backends[id(t)])
        except Exception as e:
            t.why_not, t.seconds = f"failed: {one_line(e, with_type=True)}", None
    return Share(list(mine), time.monotonic() - t0, timer.graphs)


def _keep_within(live: list, spent: dict, done: int, shapes: int, elapsed: float,
                 budget_s: float) -> None:
    """Skip candidates from the end of `live` until the projected time of the rest fits the
    budget: each one's seconds per shape so far, times the shapes left. The first stays."""
    live = [t for t in live if t.why_not is None]
    left = shapes - done
    while len(live) > 1 and \
            elapsed + left * sum(spent[id(t)] / done for t in live) > budget_s:
        t = live.pop()
        t.skipped, t.timings = (f"not timed: fp8_choice_budget_s ({budget_s:g} s) would be "
                                "spent before it"), {}


def pick(trials: list) -> Optional[Trial]:
    """The fastest trial (the largest speed-up over the base precision) whose numerics pass,
    the first of equals; None if none does."""
    good = [t for t in trials if t.measured() and t.numerics_pass()]
    return max(good, key=lambda t: t.speedup) if good else None


def verdict_of(t: Trial, chosen: Optional[Trial]) -> str:
    if t.why_not:
        return f"cannot run: {t.why_not}"
    if t.skipped:
        return t.skipped
    if not t.numerics_pass():
        return (f"numerics: output error {t.output_error:.1%} (at most {MAX_OUTPUT_ERROR:.0%}), "
                f"gradient {t.grad_error:.1%} (at most {MAX_GRAD_ERROR:.0%})")
    if t is chosen:
        return "chosen"
    return f"slower: {chosen.speedup / t.speedup:.2f}x the chosen one's time"


def table(trials: list, chosen: Optional[Trial], tokens: int, base_name: str,
          source: str = "the model's activations") -> list:
    """The log lines: what was compared, and each candidate's time, errors and verdict."""
    from .timing import HOST_BOUND
    lines = [f"fp8 auto: each recipe's converted Linears, forward + backward of one micro-batch "
             f"({tokens:,} tokens), against {base_name}; numerics vs {base_name} on "
             f"{source} (output error at most {MAX_OUTPUT_ERROR:.0%}, input gradient "
             f"{MAX_GRAD_ERROR:.0%})"]
    for t in trials:
        if not t.measured():
            lines.append(f"  {t.name:<18} {verdict_of(t, chosen)}")
            continue
        host = "" if t.host_ratio is None else f", host/device {t.host_ratio:.2f}" + (
            " host-bound" if t.host_ratio >= HOST_BOUND else "")
        lines.append(f"  {t.name:<18} {t.seconds * 1e3:8.3f} ms ({t.speedup:.2f}x {base_name}"
                     f"{', cached' if t.cached else ''}{host}); output error "
                     f"{t.output_error:.1%}, gradient {t.grad_error:.1%}: "
                     f"{verdict_of(t, chosen)}")
    return lines


def record(trials: list, chosen: Optional[Trial], cost: Optional[dict] = None) -> dict:
    """fp8_choice, as config.yaml, W&B and summary.json hold it."""
    rows = []
    for t in trials:
        row = dataclasses.asdict(t)
        row.pop("timings")
        rows.append(dict(row, verdict=verdict_of(t, chosen)))
    return {"chosen": chosen.name if chosen else None, "table": rows, **(cost or {})}


# --- the run's entry point ----------------------------------------------------------------------

def choose(prec, model: nn.Module, saved: Optional[dict], info: Callable[[str], None],
           warn: Callable[[str], None], *, device: Optional[torch.device] = None, timer=None,
           numerics_for: Optional[Callable] = None, sample: Optional[Callable] = None):
    """The run's precision once fp8 auto has chosen: `prec` (built from the provisional spec,
    its token count set) or a backend of the chosen recipe over a fresh base precision; its
    spec says how it was decided. `model`: the unconverted model (on the meta device will do:
    only its Linears' shapes are read); `device`: where the run trains (default the model's);
    `saved`: the resumed checkpoint's derived values; `sample(shapes)`: numerics.Sample per
    shape from the model on real data (None: Gaussian noise). `timer` and `numerics_for`
    replace the real measurements (tests; with `timer` a CPU times too)."""
    if not prec.auto:
        return prec
    from .backends import converter
    from .policy import device_of, eligible_shapes
    spec = prec.spec
    device = device or device_of(model)

    def build(backend: str, recipe: str, how: str):
        return converter(spec.decide(backend, recipe, how), prec.base.fresh(device), device,
                         warn)

    if saved and saved.get("fp8_backend") in AUTO_RECIPES and saved.get("fp8_recipe"):
        name = f"{saved['fp8_backend']} {saved['fp8_recipe']}"
        info(f"fp8 auto: {name}, as the resumed checkpoint's run chose (nothing timed)")
        chosen = build(saved["fp8_backend"], saved["fp8_recipe"], "resumed")
        return _with_choice(chosen, prec, dict(chosen=name, table=[], note="resumed"))
    default = f"{prec.label} {spec.recipe}"
    if device.type != "cuda" and timer is None:
        note = (f"nothing timed on {device.type} (FP8 is emulated there, slower whatever the "
                f"recipe): {default}, the default")
        info(f"fp8 auto: {note}")
        return _with_choice(prec, prec, dict(chosen=default, table=[], note=note), "default")
    counts = eligible_shapes(model, spec.exclude)
    if not counts:
        info(f"fp8 auto: no eligible Linear to time: {default}, the default")
        return _with_choice(prec, prec, dict(chosen=default, table=[], note="no eligible layer"),
                            "default")
    trials, cost, source = _measured(prec, device, counts, timer, numerics_for, sample)
    best = pick(trials)
    for line in table(trials, best, prec.tokens, prec.base.name, source):
        info(line)
    info(cost_line(trials, cost, spec.choice_budget_s))
    choice = record(trials, best, cost)
    if best is None:
        warn(f"fp8 auto: no recipe passed the numerics check (the table above): training with "
             f"{default}, the default; set fp8_recipe to choose another")
        return _with_choice(prec, prec, choice, "default")
    info(f"fp8 auto: {best.name} chosen")
    if best.seconds >= best.base_seconds:
        warn(f"fp8 auto: no recipe makes this model's Linears faster than {prec.base.name} at "
             f"{prec.tokens:,} tokens (the fastest, {best.name}, takes "
             f"{best.seconds / best.base_seconds:.2f}x their {prec.base.name} time): FP8 costs "
             f"time here; use_fp8: false trains faster")
    if any(t.host_ratio is not None and t.host_ratio >= _host_bound() for t in trials):
        warn("fp8 auto: some timings are host-bound (host/device at or above "
             f"{_host_bound():g} in the table above: the GPU waited for Python), so they measure "
             "launch overhead more than the layers; compile: true (or a larger micro-batch) "
             "gives timings of the GPU")
    chosen = prec if best.name == default else build(best.backend, best.recipe, "chosen")
    return _with_choice(chosen, prec, choice, "chosen")


def _host_bound() -> float:
    from .timing import HOST_BOUND
    return HOST_BOUND


def cost_line(trials: list, cost: dict, budget_s: float) -> str:
    measured = [t for t in trials if t.measured()]
    cached = sum(t.cached for t in measured)
    unable = sum(t.why_not is not None for t in trials)
    skipped = sum(t.skipped is not None for t in trials)
    parts = [f"{len(measured)} measured" + (f" ({cached} from the cache)" if cached else "")]
    if unable:
        parts.append(f"{unable} cannot run")
    if skipped:
        parts.append(f"{skipped} over the budget")
    ranks = cost["ranks"]
    return (f"fp8 auto: {len(trials)} candidates ({', '.join(parts)}) in {cost['seconds']:.1f} s"
            f"{f' over {ranks} ranks' if ranks > 1 else ''}; {cost['graphs']} graphs compiled; "
            f"budget {budget_s:g} s (fp8_choice_budget_s)")


# The wait for the slowest rank's share: its budget twice (a candidate started just before the
# budget ran out still finishes) and ten minutes for compiles beyond it.
def wait_s(budget_s: float) -> float:
    return 2 * budget_s + 600


def _measured(prec, device, counts, timer, numerics_for, sample):
    """(the trials in candidate order, the cost, what the numerics ran on): each rank its share
    of the candidates (ranks.Phase), with the cache of fp8_layers auto, which rank 0 writes."""
    from ..ranks import Phase, rank_world
    from .backends import fp8_backends
    from .policy import cache_path, layer_cache_key, read_cache, write_cache
    from .timing import LayerTimer
    spec = prec.spec
    tokens, path = prec.tokens, cache_path(spec)
    rank, world = rank_world()
    trials = [Trial(b, r) for b, r in spec.candidates()]
    mine = [(i, t) for i, t in enumerate(trials) if i % world == rank]
    for _, t in mine:
        t.rank = rank

    def key(backend):
        return layer_cache_key(backend, device, tokens, counts)

    def cached(backend):
        return None if spec.reprobe else read_cache(path, key(backend))

    def make(trial_spec):
        return fp8_backends()[trial_spec.backend](trial_spec, prec.base)

    numerics = _Numerics(counts, device, tokens, sample, numerics_for)

    def share() -> Share:
        out = try_share(spec, mine, make, device, counts, cached,
                        timer or LayerTimer(device, tokens, prec.base, spec), numerics,
                        spec.choice_budget_s)
        out.source = numerics.source
        return out

    with Phase("fp8 auto: timing the recipes", wait_s(spec.choice_budget_s)) as phase:
        shares = phase.each(share, " (name fp8_backend and fp8_recipe to skip it)")
    ordered = [t for _, t in sorted((it for s in shares for it in s.trials),
                                    key=lambda it: it[0])]
    if rank == 0:   # one writer of the cache
        for t in ordered:
            if t.measured() and not t.cached:
                try:
                    write_cache(path, key(make(spec.decide(t.backend, t.recipe, "chosen"))),
                                t.timings, 0.0)
                except OSError:
                    pass   # not cached: timed again next time
    cost = dict(seconds=round(max(s.seconds for s in shares), 2),
                graphs=sum(s.graphs for s in shares), ranks=world)
    source = next((s.source for s in shares if s.source), "the model's activations"
                  if sample is not None else "Gaussian noise")
    return ordered, cost, source


class _Numerics:
    """numerics_for, made on first use (a rank with no candidate to check captures nothing):
    on `sample(shapes)`, the model's own activations, or on Gaussian noise without one or when
    the model's forward and backward did not fit in memory (said in `source`)."""

    def __init__(self, counts, device, tokens, sample, given=None):
        self.counts, self.device, self.tokens, self.sample = counts, device, tokens, sample
        self.check, self.source = given, None
        if given is not None:
            self.source = "the model's activations" if sample is not None else "Gaussian noise"

    def __call__(self, backend) -> "tuple[float, float]":
        if self.check is None:
            from ..errors import one_line
            from .numerics import checker, gaussian
            samples = None
            if self.sample is not None:
                try:
                    samples, self.source = self.sample(list(self.counts)), \
                        "the model's activations"
                except torch.OutOfMemoryError as e:
                    self.source = (f"Gaussian noise (the model's forward and backward did not "
                                   f"fit in memory: {one_line(e)[:80]})")
            if samples is None:
                samples = gaussian(list(self.counts), self.device, self.tokens)
                self.source = self.source or "Gaussian noise"
            self.check = checker(samples, self.device)
        return self.check(backend)


def _with_choice(chosen, provisional_prec, choice: dict, how: Optional[str] = None):
    """`chosen` with the choice's record and the provisional precision's token count; `how`:
    how its backend and recipe were decided (its spec says so), when it is the provisional
    precision itself."""
    if chosen.fp8:
        if how is not None and chosen is provisional_prec:
            chosen.spec = chosen.spec.decide(chosen.spec.backend, chosen.spec.recipe, how)
        chosen.set_tokens(provisional_prec.tokens, provisional_prec.info)
        chosen.fp8_choice = choice
    return chosen
