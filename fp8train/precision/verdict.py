"""What FP8 bought a run: the end-of-run verdict (summary.json's `fp8_verdict`, the `summary:`
lines). Pure functions of plain data (`Fp8Facts`, taken from the precision object and the model
at the end of the run), so every number is tested on a CPU with injected timings.

What it says, and only when it is known:

- **FLOP share.** The converted Linears' matmul FLOPs over the model's training FLOPs per token,
  counted as MFU counts them (`GPT.flops_per_token`, PaLM appendix B): 6 FLOPs per matmul
  weight per token (forward 2, backward 4), so a Linear of in x out costs 6 * in * out; the
  attention scores and values 12 * n_layer * n_embd * seq_len; a tied LM head counts as a
  matmul; embedding lookups, biases, norms and activations count nothing. From it, the most
  FP8 could give if the step's time split like its FLOPs (`flop_bound`, Amdahl):
  1 / (1 - share + share / g), with g the converted GEMMs' timed speed-up where fp8_layers
  auto timed them, else 2 (FP8 tensor cores' dense peak is twice bf16's). Real steps spend
  more time per FLOP outside the GEMMs (attention, norms, the optimizer), so expect less.
- **Timed speed-ups** (fp8_layers auto on a GPU): per shape, base seconds / FP8 seconds of one
  layer's forward + backward at the run's micro-batch tokens (policy.py); and the converted
  GEMMs' gain together, sum n_s * base_s / sum n_s * fp8_s (n_s: converted layers of shape s).
- **Expected step speed-up** (timed, and the run measured its steady-state tokens/s). The run
  measured its step time T with FP8 on; each rank runs `accum` micro-batches per step, each
  running every converted layer once, so the converted GEMMs take G8 = accum * sum n_s fp8_s of
  it and would take G16 = accum * sum n_s base_s in bf16. The bf16 step is estimated as
  T16 = T - G8 + G16, and with f_s = accum * n_s * base_s / T16 (shape s's share of that bf16
  step), f = sum f_s:  speed-up = T16 / T = 1 / (1 - f + sum f_s / speedup_s).
  An estimate: each shape was timed alone, not inside the compiled model, and recomputation
  (activation checkpointing) is not counted. A bf16 twin run measures it (compare_runs.py).
- Nothing made up: emulated FP8 (CPU) gets no speed-up number at all; a run whose FP8 was
  switched off by a recovery, fell back to the base precision, or converted no layer says so
  and claims no speed-up."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

FLOP_COUNTING = ("6 FLOPs per matmul weight per token (forward + backward) + attention scores "
                 "and values 12 * n_layer * n_embd * seq_len, as MFU counts them")
# FP8's dense tensor-core peak over the base precision's (H100, H200, B200, L40S alike), for
# the bound when nothing was timed; an fp32 base (TF32, or no tensor cores) gets no bound.
PEAK_RATIO = {"bf16": 2.0, "fp16": 2.0}


@dataclass
class Fp8Facts:
    """What the verdict needs from the run's precision and model, as plain data."""
    asked: bool                         # use_fp8 was set
    label: str = ""                     # te | torchao | native
    recipe: Optional[str] = None
    base: str = "bf16"                  # the base precision (what bf16 means on this device)
    fallback: Optional[str] = None      # FP8 could not run: why (fp8_fallback: bf16)
    emulated: bool = False              # CPU: FP8 GEMMs emulated, nothing timed
    disabled: bool = False              # switched off by a remedy, or by fp8_until
    off_reason: str = "after non-finite steps (fp8_recovery)"
    converted: dict = field(default_factory=dict)   # name -> (in, out, bias)
    total_linears: int = 0
    layer_policy: str = ""              # what fp8_layers did (config.yaml's fp8_layer_policy)
    timings: Optional[dict] = None      # shape -> (base s, fp8 s): fp8_layers auto timed them
    timed_tokens: Optional[int] = None  # the token count they were timed at

    def verdict(self, flops_per_token: float, tokens_per_sec: Optional[float],
                tokens_per_step: int, accum: int) -> Optional[dict]:
        """summary.json's fp8_verdict for these facts (`verdict` below)."""
        return verdict(self, flops_per_token, tokens_per_sec, tokens_per_step, accum)


def linear_shape(mod) -> Optional[tuple]:
    """(in, out, bias) of a Linear as converted by any backend (nn.Linear subclasses, or
    Transformer Engine's Linear, whose bias flag is `use_bias`); None for anything else."""
    i, o = getattr(mod, "in_features", None), getattr(mod, "out_features", None)
    if not isinstance(i, int) or not isinstance(o, int):
        return None
    bias = mod.use_bias if hasattr(mod, "use_bias") else getattr(mod, "bias", None) is not None
    return (i, o, bool(bias))


def facts_of(prec, model) -> Fp8Facts:
    """The facts of a finished run's precision object and (unwrapped) model."""
    if not prec.fp8:
        return Fp8Facts(asked=prec.fallback_from is not None, base=prec.name,
                        fallback=prec.fallback_from)
    sel = prec.selection
    converted = {}
    for name in (sel.chosen if sel is not None else []):
        try:
            shape = linear_shape(model.get_submodule(name))
        except AttributeError:   # renamed by a wrapper: counted as unknown below
            shape = None
        converted[name] = shape
    timings = getattr(prec, "layer_timings", None)
    return Fp8Facts(asked=True, label=prec.label, recipe=prec.spec.recipe,
                    base=prec.base.name, emulated=bool(prec.emulate),
                    disabled=bool(prec.disabled), converted=converted,
                    off_reason="at fp8_until, for the cool-down" if prec.handed_over
                    else prec.off_reason,
                    total_linears=sel.total if sel is not None else 0,
                    layer_policy=str(prec.layer_policy),
                    timings=dict(timings) if timings else None,
                    timed_tokens=prec.tokens if timings else None)


# --- the numbers --------------------------------------------------------------------------------

def flop_share(shapes, flops_per_token: float) -> Optional[float]:
    """The converted Linears' share of the training FLOPs per token: 6 * in * out each."""
    if not flops_per_token or flops_per_token <= 0:
        return None
    return sum(6.0 * i * o for i, o, _ in shapes) / flops_per_token


def amdahl(share: float, gain: float) -> float:
    """Whole speed-up when `share` of the time gets `gain` times faster."""
    return 1.0 / (1.0 - share + share / gain)


def shape_counts(converted: dict) -> dict:
    """shape -> number of converted layers of it (layers of unknown shape left out)."""
    counts: dict = {}
    for shape in converted.values():
        if shape is not None:
            counts[shape] = counts.get(shape, 0) + 1
    return counts


def timed_shapes(timings: dict, counts: dict) -> list:
    """One row per timed shape: its converted layers, times and speed-up."""
    rows = []
    for shape, (base_s, fp8_s) in timings.items():
        i, o, bias = shape
        rows.append(dict(shape=shape_text(shape), in_features=i, out_features=o, bias=bias,
                         layers_converted=counts.get(tuple(shape), 0),
                         base_ms=base_s * 1e3, fp8_ms=fp8_s * 1e3,
                         speedup=base_s / fp8_s if fp8_s > 0 else None))
    return rows


def converted_gemm_seconds(timings: dict, counts: dict) -> Optional[tuple]:
    """(base s, fp8 s) of one micro-batch's forward + backward through every converted layer,
    from the per-shape timings; None when a converted shape was not timed or nothing was."""
    if not counts or any(s not in timings for s in counts):
        return None
    return (sum(n * timings[s][0] for s, n in counts.items()),
            sum(n * timings[s][1] for s, n in counts.items()))


def step_estimate(gemm_base_s: float, gemm_fp8_s: float, accum: int,
                  step_s: Optional[float]) -> "tuple[Optional[dict], str]":
    """The expected whole-step speed-up from the measured FP8 step time and the converted GEMMs'
    timings (the module docstring's model); (None, why) when it cannot be estimated."""
    if step_s is None or step_s <= 0:
        return None, "no steady-state step time (the run was too short to measure one)"
    g8, g16 = accum * gemm_fp8_s, accum * gemm_base_s
    if g8 >= step_s:
        return None, (f"the timed FP8 GEMMs ({g8 * 1e3:.1f} ms a step) take longer than the "
                      f"measured step ({step_s * 1e3:.1f} ms): the isolated timings do not "
                      "describe this run")
    bf16_step = step_s - g8 + g16
    share = g16 / bf16_step
    return dict(measured_step_ms=step_s * 1e3, converted_gemm_fp8_ms=g8 * 1e3,
                converted_gemm_base_ms=g16 * 1e3, bf16_step_estimate_ms=bf16_step * 1e3,
                converted_share_of_bf16_step=share,
                expected_speedup=bf16_step / step_s), ""


def verdict(f: Fp8Facts, flops_per_token: float, tokens_per_sec: Optional[float],
            tokens_per_step: int, accum: int) -> Optional[dict]:
    """summary.json's fp8_verdict; None for a run that did not ask for FP8.
    `tokens_per_sec`: the run's steady-state tokens/s (all ranks; None: not measured);
    `tokens_per_step`: tokens of one optimizer step, all ranks; `accum`: micro-batches per
    step on each rank."""
    if not f.asked:
        return None
    out = dict(status="fp8", backend=f.label or None, recipe=f.recipe, base=f.base,
               layers_converted=len(f.converted), layers_total=f.total_linears,
               flop_share=None, flop_counting=FLOP_COUNTING, flop_bound=None,
               flop_bound_gain=None, timed_tokens=None, timed_shapes=None,
               converted_gemm_speedup=None, step=None, note="")
    if f.fallback:
        return dict(out, status="fallback", note=f"FP8 did not run ({f.fallback}): the run "
                    f"trained in {f.base} throughout")
    counts = shape_counts(f.converted)
    unknown = len(f.converted) - sum(counts.values())
    out["flop_share"] = None if unknown else flop_share(
        [s for s, n in counts.items() for _ in range(n)], flops_per_token)
    if not f.converted:
        return dict(out, status="no_layers", note=f"FP8 converted none of the {f.total_linears} "
                    f"Linear layers: the run trained in {f.base} throughout")
    if f.emulated:
        return dict(out, status="emulated", note="FP8 emulated on CPU (numerics only): no "
                    "speed-up measured or claimed")
    if f.disabled:
        return dict(out, status="switched_off", note=f"FP8 was switched off {f.off_reason}: "
                    f"the converted layers computed in {f.base} from then on, so this run's "
                    "tokens/s is not FP8's: no speed-up claimed")
    gemm = converted_gemm_seconds(f.timings, counts) if f.timings else None
    gain = gemm[0] / gemm[1] if gemm and gemm[1] > 0 else None
    if f.timings:
        out.update(timed_tokens=f.timed_tokens, timed_shapes=timed_shapes(f.timings, counts),
                   converted_gemm_speedup=gain)
    bound_gain = gain or PEAK_RATIO.get(f.base)
    if out["flop_share"] is not None and bound_gain:
        out.update(flop_bound=amdahl(out["flop_share"], bound_gain), flop_bound_gain=bound_gain)
    if unknown:   # the timed GEMMs of the layers of unknown shape would be left out
        return dict(out, note=f"no step speed-up estimate ({unknown} converted layers of "
                    "unknown shape); compare with a bf16 twin run to measure it")
    if gemm is None:
        why = "a converted shape was not timed" if f.timings else \
            f"layers not timed: {f.layer_policy}" if f.layer_policy.startswith("auto") else \
            f"layers not timed: fp8_layers {f.layer_policy or '?'}; only auto times them"
        return dict(out, note=f"no step speed-up estimate ({why}); compare with a bf16 twin "
                    "run to measure it")
    step_s = tokens_per_step / tokens_per_sec if tokens_per_sec else None
    est, why = step_estimate(gemm[0], gemm[1], accum, step_s)
    if est is None:
        return dict(out, note=f"no step speed-up estimate: {why}")
    return dict(out, step=est, note="estimate from layers timed one at a time; compare with a "
                "bf16 twin run to measure it")


# --- the words ----------------------------------------------------------------------------------

def shape_text(shape) -> str:
    i, o, bias = shape
    return f"{i} × {o}" + (" + bias" if bias else "")


def describe(v: Optional[dict]) -> list:
    """The verdict as `summary:` lines (none for a run without FP8)."""
    if v is None:
        return []
    if v["status"] in ("fallback", "no_layers"):
        return [f"summary: FP8 verdict: {v['note']}"]
    share = v["flop_share"]
    head = (f"summary: FP8 verdict: {v['backend']}"
            + (f" ({v['recipe']})" if v.get("recipe") else "")
            + f", {v['layers_converted']}/{v['layers_total']} Linears converted"
            + (f", {100 * share:.1f}% of the training FLOPs per token" if share is not None
               else ""))
    if v["status"] != "fp8":
        return [f"{head}; {v['note']}"]
    lines = [head]
    if v["timed_shapes"]:
        shapes = ", ".join(f"{r['shape']} {_x(r['speedup'])}"
                           + ("" if r["layers_converted"] else " (kept)")
                           for r in v["timed_shapes"])
        lines.append(f"summary: FP8 timed at {v['timed_tokens']:,} tokens (one layer's forward "
                     f"+ backward, {v['base']} time / FP8 time): {shapes}"
                     + (f"; the converted GEMMs together {_x(v['converted_gemm_speedup'])}"
                        if v["converted_gemm_speedup"] else ""))
    if v["flop_bound"] is not None:
        g = v["flop_bound_gain"]
        how = f"their timed {_x(g)}" if v["converted_gemm_speedup"] else \
            f"{_x(g)} (FP8's peak over {v['base']}'s, not measured)"
        lines.append(f"summary: FP8 FLOP-share bound: at most {_x(v['flop_bound'])} for the "
                     f"whole step, if its time split like its FLOPs and the converted GEMMs "
                     f"ran at {how}")
    step = v["step"]
    if step:
        lines.append(
            f"summary: FP8 expected step speed-up ≈ {_x(step['expected_speedup'])} (estimate: "
            f"the converted GEMMs, {100 * step['converted_share_of_bf16_step']:.1f}% of an "
            f"estimated {step['bf16_step_estimate_ms']:.1f} ms {v['base']} step, take "
            f"{step['converted_gemm_fp8_ms']:.1f} ms of this run's "
            f"{step['measured_step_ms']:.1f} ms step in FP8); {v['note']}")
    else:
        lines.append(f"summary: FP8 verdict: {v['note']}")
    return lines


def _x(ratio: Optional[float]) -> str:
    return "n/a" if ratio is None else f"{ratio:.2f}×"
