"""fp8_recipe: auto and fp8_backend: auto: the FP8 recipe (and backend) measured fastest on this
GPU for this model's Linear shapes, among those whose numerics pass a check against bf16.

Which recipe wins depends on the GPU, the shapes and the token count: nanochat measured
torchao's rowwise slower than bf16 (0.90x) where tensorwise was faster; torchtitan measured
rowwise 1.05x and tensorwise 1.25x at 8B. So `auto` tries each candidate with the harness of
fp8_layers: auto (policy.py): every distinct eligible shape timed forward + backward at the
run's token count against the base precision, compiled when the run compiles, cached in
fp8_layers.json under the same key fp8_layers: auto uses (so its decision afterwards times
nothing), timed by rank 0 alone and shared with one all-gather.

- Candidates: the backend's recipes (te: delayed, current, block where TE says the GPU runs it;
  torchao: tensorwise, rowwise; native: delayed, current), or with fp8_backend: auto those of
  every backend that can run here (a machine without Transformer Engine still gets the best
  FP8 it can run). One that cannot run is listed with TE's or the import's reason.
- A candidate's time: the converted Linears of one micro-batch as the run would run them
  (with fp8_layers: auto, each shape in FP8 only where FP8 wins by fp8_auto_margin).
- Numerics: one layer of each shape, the same weights, inputs and output gradient in bf16 and
  in FP8 (after a few steps, so that delayed scaling has a history): the relative error
  ||fp8 - bf16|| / ||bf16|| of the output must stay under MAX_OUTPUT_ERROR and of the input
  gradient under MAX_GRAD_ERROR, at every shape. E4M3 (3 mantissa bits) rounds each operand by
  at most 2^-4; a sound recipe lands at a few percent; one that underflows or saturates lands
  near 1.
- The fastest candidate that passes is taken; none passing keeps the backend's default, with a
  warning. The choice and the table go to the log, config.yaml (derived: fp8_backend,
  fp8_recipe, fp8_choice), W&B and summary.json; a resumed run takes its checkpoint's choice.
- On a CPU nothing is timed (FP8 is emulated, slower whatever the recipe): auto takes the
  backend's default (native's with fp8_backend: auto) and says why.
- The choosing logic is a pure function of injected `timer_for` and `numerics_for`, tested on
  a CPU; `cuda_numerics` and policy.cuda_timer are the real ones."""
from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

# The recipes auto weighs, per backend (torchao's rowwise_with_gw_hp is rowwise with a bf16
# weight-gradient GEMM: slower than rowwise by design, chosen for accuracy, by name).
AUTO_RECIPES = {"te": ("delayed", "current", "block"), "torchao": ("tensorwise", "rowwise"),
                "native": ("delayed", "current")}
BACKENDS = ("te", "torchao", "native")   # fp8_backend: auto's order, on a tie too
MAX_OUTPUT_ERROR = 0.10
MAX_GRAD_ERROR = 0.20


def is_auto(cfg) -> bool:
    return bool(cfg.use_fp8) and "auto" in (cfg.fp8_backend, cfg.fp8_recipe)


def concrete(cfg, backend: str, recipe: str):
    return dataclasses.replace(cfg, fp8_backend=backend, fp8_recipe=recipe)


def provisional(cfg, runs: Callable[[str], bool]):
    """The config a run builds before it chooses (the batch probe's, and a CPU run's): the
    first backend of BACKENDS that `runs` here (native otherwise), with its default recipe."""
    if not is_auto(cfg):
        return cfg
    backend = cfg.fp8_backend
    if backend == "auto":
        backend = next((b for b in BACKENDS[:-1] if runs(b)), BACKENDS[-1])
    return concrete(cfg, backend, AUTO_RECIPES[backend][0] if cfg.fp8_recipe == "auto"
                    else cfg.fp8_recipe)


def as_chosen(cfg, derived: dict):
    """A finished run's config with the backend and recipe fp8 auto chose (its config.yaml's
    derived values) in place of auto: what evaluating or sampling its checkpoint in FP8 needs."""
    if not is_auto(cfg) or not derived.get("fp8_backend") or not derived.get("fp8_recipe"):
        return cfg
    return concrete(cfg, derived["fp8_backend"], derived["fp8_recipe"])


def candidates(cfg) -> list:
    backends = BACKENDS if cfg.fp8_backend == "auto" else (cfg.fp8_backend,)
    return [(b, r) for b in backends for r in AUTO_RECIPES[b]]


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

    @property
    def name(self) -> str:
        return f"{self.backend} {self.recipe}"

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


def try_all(cfg, make: Callable[[object], object], device: torch.device, counts: dict,
            measure: Callable, timer_for: Callable, numerics_for: Callable) -> list:
    """A Trial of each candidate: `make(config)` builds that backend, `measure(backend, timer)`
    returns policy.Measured for the shapes, `timer_for(backend)` and `numerics_for(backend)`
    give its timer and its (output error, gradient error)."""
    from ..errors import one_line
    trials = []
    for backend_name, recipe in candidates(cfg):
        trial = Trial(backend_name, recipe)
        trials.append(trial)
        backend = make(concrete(cfg, backend_name, recipe))
        # A candidate that fails (a recipe TE refuses for this format, out of memory at this
        # token count, a kernel this GPU lacks) is listed with why, not the end of the run.
        try:
            trial.why_not = backend.unavailable(device)
            if trial.why_not:
                continue
            measured = measure(backend, timer_for(backend))
            trial.cached = measured.cached
            trial.seconds, trial.base_seconds = step_seconds(
                measured.timings, counts, cfg.fp8_layers, cfg.fp8_auto_margin)
            trial.output_error, trial.grad_error = numerics_for(backend)
        except Exception as e:
            trial.why_not, trial.seconds = f"failed: {one_line(e, with_type=True)}", None
    return trials


def pick(trials: list) -> Optional[Trial]:
    """The fastest trial whose numerics pass (the first of equals); None if none does."""
    good = [t for t in trials if t.why_not is None and t.seconds is not None and
            t.numerics_pass()]
    return min(good, key=lambda t: t.seconds) if good else None


def verdict_of(t: Trial, chosen: Optional[Trial]) -> str:
    if t.why_not:
        return f"cannot run: {t.why_not}"
    if not t.numerics_pass():
        return (f"numerics: output error {t.output_error:.1%} (at most {MAX_OUTPUT_ERROR:.0%}), "
                f"gradient {t.grad_error:.1%} (at most {MAX_GRAD_ERROR:.0%})")
    if t is chosen:
        return "chosen"
    return f"slower: {t.seconds / chosen.seconds:.2f}x the chosen one's time"


def table(trials: list, chosen: Optional[Trial], tokens: int, base_name: str) -> list:
    """The log lines: what was compared, and each candidate's time, errors and verdict."""
    lines = [f"fp8 auto: each recipe's converted Linears, forward + backward of one micro-batch "
             f"({tokens:,} tokens), against {base_name}; numerics vs {base_name} on the same "
             f"shapes (output error at most {MAX_OUTPUT_ERROR:.0%}, input gradient "
             f"{MAX_GRAD_ERROR:.0%})"]
    for t in trials:
        if t.why_not:
            lines.append(f"  {t.name:<18} {verdict_of(t, chosen)}")
            continue
        speed = t.base_seconds / t.seconds if t.seconds else math.inf
        lines.append(f"  {t.name:<18} {t.seconds * 1e3:8.3f} ms ({speed:.2f}x {base_name}"
                     f"{', cached' if t.cached else ''}); output error {t.output_error:.1%}, "
                     f"gradient {t.grad_error:.1%}: {verdict_of(t, chosen)}")
    return lines


def record(trials: list, chosen: Optional[Trial]) -> dict:
    """fp8_choice, as config.yaml, W&B and summary.json hold it."""
    return {"chosen": chosen.name if chosen else None,
            "table": [dict(dataclasses.asdict(t), verdict=verdict_of(t, chosen))
                      for t in trials]}


# --- the real numerics check (CUDA) -------------------------------------------------------------

def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||; inf when it is not finite (a NaN must fail the check, not pass it)."""
    err = float(torch.linalg.vector_norm(a.float() - b.float()) /
                torch.linalg.vector_norm(b.float()).clamp_min(1e-30))
    return err if math.isfinite(err) else math.inf


def cuda_numerics(shapes, device: torch.device, tokens: int, warmup: int = 3) -> Callable:
    """numerics_for on a GPU (on a CPU too, emulated, for the tests): for each shape, one layer
    converted by a timing copy of the backend, and an nn.Linear with the same weights in the
    base precision (autocast, as Accelerate runs it); `warmup` training steps of the FP8
    layer, then one step of each on the same input (at most 8,192 rows) and output gradient.
    The worst errors over the shapes."""
    from ..batch.fit import release_memory
    from .policy import _autocast_dtype, _fp8_layer

    def numerics_for(backend) -> "tuple[float, float]":
        worst = [0.0, 0.0]
        dtype = _autocast_dtype(backend.base)
        rows = min(tokens, 8192)
        for shape in shapes:
            cuda = device.type == "cuda"
            with torch.random.fork_rng(devices=[device] if cuda else []), \
                    (torch.cuda.device(device) if cuda else contextlib.nullcontext()):
                torch.manual_seed(0)
                trial, layer = _fp8_layer(shape, backend, device)
                ref = nn.Linear(shape[0], shape[1], bias=shape[2], device=device)
                with torch.no_grad():
                    ref.weight.copy_(layer.weight)
                    if shape[2]:
                        ref.bias.copy_(layer.bias)
                x = torch.randn(rows, shape[0], device=device)
                g = torch.randn(rows, shape[1], device=device)
                try:
                    for _ in range(warmup):
                        _run(layer, x, g, dtype, trial)
                    y, gx = _run(layer, x, g, dtype, trial)
                    y_ref, gx_ref = _run(ref, x, g, dtype, None)
                    worst[0] = max(worst[0], rel_error(y, y_ref))
                    worst[1] = max(worst[1], rel_error(gx, gx_ref))
                finally:
                    del trial, layer
                    backend.reset_trials()   # the trial's TE state, before the real model
                    release_memory(device if cuda else None)
        return worst[0], worst[1]

    return numerics_for


def _run(layer: nn.Module, x: torch.Tensor, g: torch.Tensor, dtype, fp8):
    x = x.detach().clone().requires_grad_(True)
    autocast = torch.autocast(x.device.type, dtype=dtype) if dtype else contextlib.nullcontext()
    with autocast, (fp8.forward_context(training=True) if fp8 else contextlib.nullcontext()):
        y = layer(x)
    y.backward(g.to(y.dtype))
    if fp8 is not None:
        fp8.after_backward()
    layer.zero_grad(set_to_none=True)
    return y.detach().float(), x.grad.float()


# --- the run's entry point ----------------------------------------------------------------------

def choose(cfg, prec, model: nn.Module, saved: Optional[dict], info: Callable[[str], None],
           warn: Callable[[str], None], build: Callable, run_dir: Optional[str] = None, *,
           device: Optional[torch.device] = None, timer_for: Optional[Callable] = None,
           numerics_for: Optional[Callable] = None):
    """The run's precision once fp8 auto has chosen: `prec` (built from the provisional config,
    its token count set) or a backend of the chosen recipe, made by `build(config)` (the run's
    build_precision). `model`: the unconverted model (on the meta device will do: only its
    Linears' shapes are read); `device`: where the run trains (default the model's); `saved`:
    the resumed checkpoint's derived values. `timer_for` and `numerics_for` replace the CUDA
    measurements (tests)."""
    if not is_auto(cfg) or not prec.fp8:
        return prec
    from .policy import _device_of, eligible_shapes
    device = device or _device_of(model)
    if saved and saved.get("fp8_backend") in AUTO_RECIPES and saved.get("fp8_recipe"):
        name = f"{saved['fp8_backend']} {saved['fp8_recipe']}"
        info(f"fp8 auto: {name}, as the resumed checkpoint's run chose (nothing timed)")
        chosen = build(concrete(cfg, saved["fp8_backend"], saved["fp8_recipe"]))
        return _with_choice(chosen, prec, dict(chosen=name, table=[], note="resumed"))
    default = f"{prec.label} {prec.cfg.fp8_recipe}"
    if device.type != "cuda" and timer_for is None:
        note = (f"nothing timed on {device.type} (FP8 is emulated there, slower whatever the "
                f"recipe): {default}, the default")
        info(f"fp8 auto: {note}")
        return _with_choice(prec, prec, dict(chosen=default, table=[], note=note))
    counts = eligible_shapes(model, cfg.fp8_exclude)
    if not counts:
        info(f"fp8 auto: no eligible Linear to time: {default}, the default")
        return _with_choice(prec, prec, dict(chosen=default, table=[], note="no eligible layer"))
    trials = _measured(cfg, prec, device, counts, run_dir, timer_for, numerics_for)
    best = pick(trials)
    for line in table(trials, best, prec.tokens, prec.base.name):
        info(line)
    choice = record(trials, best)
    if best is None:
        warn(f"fp8 auto: no recipe passed the numerics check (the table above): training with "
             f"{default}, the default; set fp8_recipe to choose another")
        return _with_choice(prec, prec, choice)
    info(f"fp8 auto: {best.name} chosen")
    if best.seconds >= best.base_seconds:
        warn(f"fp8 auto: no recipe makes this model's Linears faster than {prec.base.name} at "
             f"{prec.tokens:,} tokens (the fastest, {best.name}, takes "
             f"{best.seconds / best.base_seconds:.2f}x their {prec.base.name} time): FP8 costs "
             f"time here; use_fp8: false trains faster")
    chosen = prec if best.name == default else build(concrete(cfg, best.backend, best.recipe))
    return _with_choice(chosen, prec, choice)


def _measured(cfg, prec, device, counts, run_dir, timer_for, numerics_for) -> list:
    """try_all on rank 0 with the cache of fp8_layers auto; every rank gets the trials."""
    from ..ranks import on_rank0
    from .backends import fp8_backends
    from .policy import cache_path, cuda_timer, layer_cache_key, measure
    tokens, path = prec.tokens, cache_path(cfg, run_dir)
    timer_for = timer_for or (lambda backend: cuda_timer(backend, device, tokens))
    numerics_for = numerics_for or cuda_numerics(list(counts), device, tokens)

    def measure_backend(backend, timer):
        key = layer_cache_key(backend, device, tokens, counts)
        return measure(list(counts), key, path, timer, refresh=cfg.reprobe)

    def make(config):
        return fp8_backends()[config.fp8_backend](config, prec.base, run_dir)

    return on_rank0(lambda: try_all(cfg, make, device, counts, measure_backend, timer_for,
                                    numerics_for),
                    "fp8 auto: timing the recipes", " (name fp8_backend and fp8_recipe to skip it)")


def _with_choice(chosen, provisional_prec, choice: dict):
    if chosen.fp8:
        chosen.set_tokens(provisional_prec.tokens, provisional_prec.info)
        chosen.fp8_choice = choice
    return chosen
