"""fp8_layers: which eligible Linears go to FP8. `all` takes every one, `min_size` those with at
least fp8_min_layer_size weights, and `auto` the shapes where FP8 is measured to be faster.

Why measure: an FP8 layer also pays to cast its input, its weight and (in backward) its
grad_output to FP8, and to transpose them for the backward GEMMs, and only the GEMMs get faster.
Whether the saving beats those casts depends on the shape, the token count, the GPU, the
backend and its recipe. A size threshold tuned on one machine is wrong on the next. So `auto`
takes each distinct (in_features, out_features, bias) among the eligible Linears and times
forward + backward of one such layer at the run's token count (micro-batch × seq_len rows),
once in the base precision and once converted by the chosen backend. It converts the shapes
where FP8 is faster by at least fp8_auto_margin; layers that share a shape share the decision.

- The decision, the cache and the agreement between ranks are pure functions of an injected
  timer, `time_shape(shape) -> (base seconds, fp8 seconds)`, so they are tested on a CPU.
  `device_timer` is the real one (timing.py: warm-up, then CUDA events with Python's queuing
  time kept apart, the median of several repeats).
- Only rank 0 times, or reads the cache. It shares its timings with one all-gather, which also
  carries its error, so every rank decides the same. The others wait for it in a ranks.Phase:
  through a store of its own, bounded, and ended at once by a stop signal, never inside a
  collective of the default process group (whose NCCL timeout would end the job). The timing
  copy of a TE backend does not all-reduce its amaxes, for the same reason.
- Timings are cached in fp8_layers.json beside batch_probe.json, keyed on what changes them:
  GPU, backend, recipe or format, base precision, versions, token count and shapes. A cache hit
  times nothing. The margin is applied when deciding, so changing it re-decides without
  re-timing.
- On a CPU the FP8 GEMMs are emulated, so FP8 is always slower. There `auto` times nothing
  and converts every eligible layer, as `all` does, so the CPU demo still exercises FP8.
- The micro-batch probe's throw-away models never get a token count (Precision.set_tokens).
  For them `auto` also converts everything and times nothing: the memory is about the same."""
from __future__ import annotations

import contextlib
import importlib
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from ..io import read_entry, write_entry
from ..ranks import Phase, on_rank0, rank_world
from .layers import select_linears, shape_of

CACHE_FILE = "fp8_layers.json"

# A Linear's shape: (in_features, out_features, bias).
Shape = tuple
# shape -> (seconds in the base precision, seconds in FP8), each for one forward + backward.
Timer = Callable[[Shape], "tuple[float, float]"]


# --- what to time -------------------------------------------------------------------------------

def eligible_shapes(model: nn.Module, exclude) -> "OrderedDict[Shape, int]":
    """The distinct shapes among the Linears FP8 could take (dims divisible by 16, not
    excluded) and how many layers have each, in model order."""
    counts: "OrderedDict[Shape, int]" = OrderedDict()
    for name in select_linears(model, 0, exclude).chosen:
        shape = shape_of(model.get_submodule(name))
        counts[shape] = counts.get(shape, 0) + 1
    return counts


def shape_text(shape: Shape) -> str:
    i, o, bias = shape
    return f"{i} × {o}" + (" + bias" if bias else "")


# --- the decision -------------------------------------------------------------------------------

def fp8_wins(base_s: float, fp8_s: float, margin: float) -> bool:
    """FP8 wins when its speed-up (base time / FP8 time) is at least 1 + margin."""
    return base_s >= fp8_s * (1.0 + margin)


def keep_reasons(timings: dict, margin: float, base_name: str) -> dict:
    """shape -> why it stays in high precision, for the shapes FP8 does not win."""
    return {shape: f"auto: FP8 {fp8 * 1e3:.2f} ms vs {base_name} {base * 1e3:.2f} ms"
            for shape, (base, fp8) in timings.items() if not fp8_wins(base, fp8, margin)}


@dataclass
class Measured:
    timings: dict        # shape -> (base seconds, fp8 seconds)
    cached: bool         # read from the cache: nothing was timed
    seconds: float       # how long the timing took (0 when cached)
    note: str = ""       # why the timings could not be cached, if so


def measure(shapes: list, key: dict, path: str, time_shape: Timer,
            refresh: bool = False) -> Measured:
    """The timings of `shapes`: from the cache under `key`, else timed and cached."""
    hit = None if refresh else read_cache(path, key)
    if hit is not None:
        return Measured(hit, cached=True, seconds=0.0)
    t0 = time.perf_counter()
    timings = {}
    for shape in shapes:
        base_s, fp8_s = time_shape(shape)
        timings[shape] = (float(base_s), float(fp8_s))
    seconds = time.perf_counter() - t0
    try:
        write_cache(path, key, timings, seconds)
        note = ""
    except OSError as e:
        note = f"not cached: cannot write {path} ({e.strerror or e})"
    return Measured(timings, cached=False, seconds=seconds, note=note)


def decide(counts: "OrderedDict[Shape, int]", key: dict, path: str, time_shape: Timer,
           margin: float, base_name: str, label: str, tokens: int,
           info: Callable[[str], None], rank: int = 0, world: int = 1,
           gather: Optional[Callable[[object], list]] = None,
           refresh: bool = False, wait_s: float = 1200.0) -> "tuple[dict, Measured]":
    """fp8_layers auto for these shapes: timings agreed over ranks (rank 0 times; the others
    wait at most `wait_s`, in a ranks.Phase, unless `gather` is given: tests), the table through
    `info`, and shape -> reason for the shapes that stay in high precision."""
    with Phase("fp8_layers auto: timing the layer shapes", wait_s) if gather is None and \
            world > 1 else contextlib.nullcontext() as phase:
        gather_fn = gather or (phase.gather if phase is not None else (lambda obj: [obj]))
        measured = on_rank0(lambda: measure(list(counts), key, path, time_shape, refresh),
                            "fp8_layers auto: timing the layer shapes",
                            " (fp8_layers: all or min_size does not time)", rank=rank,
                            gather_fn=gather_fn)
    for line in report(counts, measured, margin, base_name, label, tokens, path):
        info(line)
    return keep_reasons(measured.timings, margin, base_name), measured


def report(counts: "OrderedDict[Shape, int]", measured: Measured, margin: float,
           base_name: str, label: str, tokens: int, path: str) -> list:
    """The table: shape, layers, base ms, fp8 ms, speed-up, decision."""
    if measured.cached:
        how = f"cached in {path}: nothing timed"
    else:
        how = f"timed in {measured.seconds:.1f} s; " + (measured.note or f"cached in {path}")
    head = (f"fp8_layers auto: forward + backward of one layer at {tokens:,} tokens, "
            f"{base_name} vs FP8 {label}; FP8 where at least {1 + margin:.2f}× faster ({how})")
    rows = [("shape (in × out)", "layers", f"{base_name} ms", "fp8 ms", "speed-up", "decision")]
    for shape, n in counts.items():
        base, fp8 = measured.timings[shape]
        speedup = base / fp8 if fp8 > 0 else float("inf")
        rows.append((shape_text(shape), str(n), f"{base * 1e3:.3f}", f"{fp8 * 1e3:.3f}",
                     f"{speedup:.2f}×", "fp8" if fp8_wins(base, fp8, margin) else base_name))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = [head]
    for r in rows:
        cells = [r[0].ljust(widths[0])] + [r[c].rjust(widths[c]) for c in range(1, 5)] + [r[5]]
        lines.append("  " + "  ".join(cells))
    return lines


# --- the cache ----------------------------------------------------------------------------------

def cache_path(spec) -> str:
    """fp8_layers.json in the batch-probe cache's directory (batch_cache_dir, else the run's
    directory)."""
    return os.path.join(spec.cache_dir, CACHE_FILE)


def cache_key(device: str, backend: str, settings: dict, base: str, versions: dict,
              tokens: int, shapes) -> dict:
    """Everything that changes the timings. The margin is not in it: it is applied after."""
    return dict(device=device, backend=backend, settings=settings, base=base,
                versions=versions, tokens=tokens, shapes=sorted(list(s) for s in shapes))


def layer_cache_key(backend, device: torch.device, tokens: int, shapes) -> dict:
    """The cache key of `backend`'s timings of `shapes` at `tokens` on `device` (also what
    fp8 auto's trials are cached under: the chosen one's layer decision then times nothing)."""
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return cache_key(device_name, backend.spec.backend, backend_settings(backend),
                     backend.base.name, versions(backend.spec.backend), tokens, shapes)


def read_cache(path: str, key: dict) -> Optional[dict]:
    """shape -> (base s, fp8 s) stored under `key`, or None (no file, other key, damaged)."""
    entry = read_entry(path, key)
    try:
        timings = {tuple(t["shape"]): (float(t["base_s"]), float(t["fp8_s"]))
                   for t in entry["timings"]}
    except (KeyError, TypeError, ValueError):
        return None
    return timings if all(tuple(s) in timings for s in key["shapes"]) else None


def write_cache(path: str, key: dict, timings: dict, seconds: float) -> None:
    write_entry(path, key, dict(timing_seconds=round(seconds, 2),
                                timings=[dict(shape=list(s), base_s=b, fp8_s=f)
                                         for s, (b, f) in timings.items()]))


def backend_settings(backend) -> dict:
    """The keys that change how fast a backend's layers are."""
    spec = backend.spec
    out = {"fp8_recipe": spec.recipe} if spec.backend == "torchao" else \
        {"fp8_format": spec.format}
    if spec.backend != "torchao" and spec.recipe != "delayed":
        out["fp8_recipe"] = spec.recipe   # (delayed left out: caches from before stay valid)
    if backend.base.name == "fp32":
        out["tf32"] = spec.tf32
    if spec.compile:   # timed as the run executes: compiled
        out["compile_mode"] = spec.compile_mode
    return out


def versions(backend_name: str) -> dict:
    out = {"torch": torch.__version__, "cuda": torch.version.cuda}
    module = {"te": "transformer_engine", "torchao": "torchao"}.get(backend_name)
    if module:
        out[module] = _module_version(module)
    return out


def _module_version(module: str) -> str:
    try:
        return str(getattr(importlib.import_module(module), "__version__"))
    except Exception:  # not importable here, or no __version__
        try:
            from importlib.metadata import version
            return version(module)
        except Exception:
            return "unknown"


# --- the backend's entry point ------------------------------------------------------------------

CPU_NOTE = ("fp8_layers auto: nothing timed on {device} (FP8 is emulated there, always "
            "slower): every eligible layer is converted, as with fp8_layers: all")


def layer_decision(backend, model: nn.Module) -> dict:
    """Fp8Backend.select with fp8_layers auto: shape -> reason for the shapes kept in high
    precision ({} converts every eligible layer)."""
    if backend.tokens is None:  # the micro-batch probe's throw-away models
        backend.layer_policy = "auto: not timed (no token count), as all"
        return {}
    device = device_of(model)
    if backend.timer is None and device.type != "cuda":
        backend.info(CPU_NOTE.format(device=device.type))
        backend.layer_policy = f"auto: as all ({device.type}, FP8 emulated: not timed)"
        return {}
    counts = eligible_shapes(model, backend.spec.exclude)
    if not counts:
        backend.layer_policy = "auto: no eligible layer to time"
        return {}
    tokens, label = backend.tokens, backend.label
    timer = backend.timer or device_timer(backend, device, tokens)
    key = layer_cache_key(backend, device, tokens, counts)
    rank, world = rank_world()
    keep, measured = decide(counts, key, cache_path(backend.spec), timer,
                            backend.spec.auto_margin, backend.base.name, label, tokens,
                            backend.info, rank, world, refresh=backend.spec.reprobe,
                            wait_s=2 * backend.spec.choice_budget_s + 600)
    # Kept for the end-of-run verdict (verdict.py): what FP8 was measured to buy, per shape.
    backend.layer_timings = dict(measured.timings)
    how = "cached" if measured.cached else "timed"
    backend.layer_policy = (f"auto: {len(counts) - len(keep)}/{len(counts)} shapes in FP8 "
                            f"({how} at {tokens:,} tokens)")
    return keep


def device_of(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def device_timer(backend, device: torch.device, tokens: int) -> Timer:
    """time_shape on the device (timing.LayerTimer): the base precision and FP8 of one shape;
    dynamo forgets the compiled timing layers after each shape."""
    from .timing import LayerTimer
    timer = LayerTimer(device, tokens, backend.base, backend.spec)

    def time_shape(shape: Shape) -> "tuple[float, float]":
        try:
            return timer.base(shape).seconds, timer.fp8(backend, shape).seconds
        finally:
            timer.forget()

    return time_shape
