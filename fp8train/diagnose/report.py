"""The report as text, section by section (printed as each section is measured), and as JSON."""
from __future__ import annotations

import json
import math

from .attention import ATTENTION
from .ceilings import FP8_PEAK_FACTOR
from .fp8_probes import BACKENDS, FWD_TOL, GRAD_TOL, TE_RECIPES


def _row(label: str, text: str) -> str:
    return f"  {label:<17}{text}"


def format_environment(report: dict) -> str:
    dev, v = report["device"], report["versions"]
    lines = ["Environment"]
    if dev["cuda"]:
        cap = f"{dev['capability'][0]}.{dev['capability'][1]}"
        lines.append(_row("GPU", f"{dev['name']} (device {dev['index']} of {dev['count']}), "
                          f"compute capability {cap}, {dev['memory_gib']:.1f} GiB, "
                          f"{dev['sm_count']} SMs"))
    else:
        lines.append(_row("GPU", f"no CUDA device: {dev['reason']}"))
    lines.append(_row("driver", f"{v['driver']} ({v['driver_source']})" if v["driver"]
                      else "not found (no nvidia-smi, no CUDA driver visible to torch)"))
    lines.append(_row("CUDA runtime", f"{v['cuda_runtime']} (torch build)" if v["cuda_runtime"]
                      else "none (CPU-only torch build)"))
    lines.append(_row("torch", v["torch"]))
    lines.append(_row("cuDNN", v["cudnn"] or v.get("cudnn_error") or "none"))
    nccl = v["nccl"] or "none"
    lines.append(_row("NCCL", f"{nccl}; torch.distributed NCCL backend "
                      f"{'available' if v['nccl_available'] else 'not available'}"))
    lines.append(_row("Python", v["python"]))
    return "\n".join(lines)


def format_fp8(report: dict) -> str:
    fp8 = report["fp8"]
    gate = fp8["gate"]
    if gate is None:
        cap = report["device"]["capability"]
        head = f"FP8 (needs compute capability >= 8.9; this GPU has {cap[0]}.{cap[1]})"
    elif not report["device"]["cuda"]:
        head = "FP8 (needs a CUDA GPU of compute capability >= 8.9; no CUDA device: imports only)"
    else:
        head = f"FP8 ({gate}; imports only)"
    lines = [head]
    for name in BACKENDS:
        b = fp8["backends"][name]
        recipes = b.get("recipes")
        if not b["imports"]:
            text = f"does not import: {b['error']}"
        elif recipes:
            text = f"imports ({b['version']}); per recipe (fp8_recipe):"
        else:
            text = f"imports ({b['version']}); " + _gemm_text(b["gemm"])
        lines.append(_row(name, text))
        for recipe in TE_RECIPES if recipes else ():
            r = recipes[recipe]
            text = (_gemm_text(r["gemm"]) if r["available"] else
                    f"not available here: {r['reason']}")
            lines.append(_row(f"  {recipe}", text))
    return "\n".join(lines)


def _gemm_text(g: dict | None) -> str:
    if g is None:
        return "no FP8 GEMM run"
    if g["ok"]:
        return (f"{g['what']}: relative error forward {g['fwd_err']:.3f}, gradients "
                f"{g['grad_err']:.3f} (tolerance {FWD_TOL}, {GRAD_TOL}): OK")
    return f"FP8 GEMM FAILED: {g['error']}"


def format_attention(report: dict) -> str:
    lines = ["Attention (F.scaled_dot_product_attention, bf16, forward + backward)"]
    for key, _ in ATTENTION:
        a = report["attention"][key]
        text = (f"runs (relative error {a['rel_err']:.3g} against fp32 math)" if a["ok"]
                else f"{'missing' if a.get('missing') else 'FAILED'}: {a['error']}")
        lines.append(_row(key, text))
    return "\n".join(lines)


def format_ceilings(report: dict) -> str:
    c = report["ceilings"]
    plan = c["plan"]
    lines = [f"Ceilings (matmuls {plan['size']}^3, median of {plan['matmul_iters']}; copies "
             f"median of {plan['copy_iters']}; each after ~{plan['warmup_s']:g} s of warm-up)",
             f"  peak: {c['peak_note']} (fp8train/observe/metrics.py)",
             _row("bf16 matmul", _matmul_text(c, "bf16_matmul")),
             _row("FP8 matmul", _matmul_text(c, "fp8_matmul"))]
    for key, label in (("d2d_copy", "device copy"), ("h2d_pinned", "host->device")):
        e = c[key]
        if e["ok"]:
            text = (f"{e['gbps']:8.1f} GB/s  ({_size(e['bytes'])}"
                    f"{', read + write' if key == 'd2d_copy' else ', pinned'})")
        else:
            text = _failed(e)
        lines.append(_row(label, text))
    return "\n".join(lines)


def _failed(entry: dict) -> str:
    return entry.get("skipped") or f"FAILED: {entry['error']}"


def _matmul_text(c: dict, key: str) -> str:
    """A matmul ceiling: TFLOP/s, the share of its dense peak, and for FP8 the comparisons
    with bf16 (judge_ceilings adds those keys to the FP8 entry only)."""
    m = c[key]
    if not m["ok"]:
        return _failed(m)
    text = f"{m['tflops']:8.1f} TFLOP/s"
    if "pct_of_peak" in m:
        fp8 = key == "fp8_matmul"
        peak = c["peak_fp8_tflops"] if fp8 else c["peak_bf16_tflops"]
        text += (f"  {m['pct_of_peak']:.0f}% of the {peak:g} TFLOP/s {'FP8' if fp8 else 'bf16'} "
                 "dense peak" + (f" ({FP8_PEAK_FACTOR}x bf16)" if fp8 else ""))
    if "speedup_vs_bf16" in m:
        text += f"; {m['speedup_vs_bf16']:.2f}x the bf16 matmul"
    if "pct_of_bf16_peak" in m:
        text += (f"; {m['pct_of_bf16_peak']:.0f}% of the bf16 peak, which is what "
                 "train/mfu of an FP8 run is measured against")
    return text


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:g} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:g} MiB"


def format_verdicts(rows: list) -> str:
    lines = ["Verdict"]
    for r in rows:
        lines.append(f"  {r['feature']:<26}{r['status']:<9}{r['reason']}")
    return "\n".join(lines)


def format_report(report: dict) -> str:
    """Everything main prints, from a report dict (the tests feed it made-up GPU numbers)."""
    parts = [format_environment(report), format_fp8(report)]
    if report.get("attention"):
        parts.append(format_attention(report))
    if report.get("ceilings"):
        parts.append(format_ceilings(report))
    parts.append(format_verdicts(report["verdicts"]))
    return "\n\n".join(parts)


def json_safe(obj):
    """`obj` with NaN / inf (a check whose error was not finite) as strings: they are not JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def write_json(report: dict, path: str) -> None:
    """The whole report as indented JSON at `path`. OSError when it cannot be written."""
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(json_safe(report), fh, indent=2)
        fh.write("\n")
