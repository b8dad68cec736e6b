"""One verdict per feature: OK (works here), MISSING (not installed, no device, hardware too
old) or FAILED (present, but its check raised or gave wrong numbers), and why."""
from __future__ import annotations

from .attention import ATTENTION
from .fp8_probes import BACKENDS, FWD_TOL, GRAD_TOL, TE_RECIPES

# (report key, feature, unit, which peak its percentage is of)
CEILINGS = (("bf16_matmul", "bf16 matmul ceiling", "TFLOP/s", "bf16"),
            ("fp8_matmul", "FP8 matmul ceiling", "TFLOP/s", "FP8"),
            ("d2d_copy", "device copy bandwidth", "GB/s", None),
            ("h2d_pinned", "host-to-device bandwidth", "GB/s", None))


def verdicts(report: dict) -> list:
    """The rows {"feature", "status", "reason"} of a report, in the order they are printed."""
    # Without a device, the first row says why; the others only that there is none.
    no_cuda = None if report["device"]["cuda"] else "no CUDA device"
    rows = [*_device_rows(report), *_fp8_rows(report["fp8"], no_cuda),
            *_attention_rows(report.get("attention") or {}, no_cuda),
            _nccl_row(report["versions"]), *_ceiling_rows(report.get("ceilings") or {}, no_cuda)]
    return [{"feature": f, "status": s, "reason": r} for f, s, r in rows]


def _device_rows(report: dict) -> list:
    dev, gate = report["device"], report["fp8"]["gate"]
    if not dev["cuda"]:
        return [("CUDA device", "MISSING", dev["reason"]),
                ("FP8 hardware", "MISSING", "no CUDA device")]
    return [("CUDA device", "OK", f"{dev['name']}, compute capability "
             f"{dev['capability'][0]}.{dev['capability'][1]}, {dev['memory_gib']:.1f} GiB"),
            ("FP8 hardware", "MISSING" if gate else "OK", gate or "compute capability >= 8.9")]


def _fp8_rows(fp8: dict, no_cuda: str | None) -> list:
    """One row per backend; for te, the row "FP8 te" is its default recipe (delayed), and
    "FP8 te current" / "FP8 te block" follow it."""
    rows = []
    for name in BACKENDS:
        b = fp8["backends"][name]
        if name != "te":
            rows.append(_fp8_row(f"FP8 {name}", b, b["gemm"], None, fp8["gate"], no_cuda))
            continue
        recipes = b.get("recipes") or {}
        for recipe in TE_RECIPES:
            r = recipes.get(recipe) or {}
            gemm = b["gemm"] if recipe == "delayed" else r.get("gemm")
            rows.append(_fp8_row("FP8 te" + ("" if recipe == "delayed" else f" {recipe}"), b,
                                 gemm, r.get("reason"), fp8["gate"], no_cuda))
    return rows


def _fp8_row(feature: str, b: dict, gemm: dict | None, unavailable: str | None,
             gate: str | None, no_cuda: str | None) -> tuple:
    """A backend's (or TE recipe's) row: MISSING when it does not import, when no FP8 GEMM can
    run here or when the library says this GPU cannot run it; else its GEMM check's verdict."""
    if not b["imports"]:
        return feature, "MISSING", b["error"]
    if unavailable:
        return feature, "MISSING", unavailable
    if gemm is None:
        return feature, "MISSING", (f"imports ({b['version']}), but no FP8 GEMM can run: "
                                    f"{no_cuda or gate or 'not checked'}")
    if gemm["ok"]:
        return feature, "OK", (f"{gemm['what']}: relative error forward {gemm['fwd_err']:.3f}, "
                               f"gradients {gemm['grad_err']:.3f} (tolerance {FWD_TOL}, "
                               f"{GRAD_TOL})")
    return feature, "FAILED", gemm["error"]


def _attention_rows(attention: dict, no_cuda: str | None) -> list:
    rows = []
    for key, _ in ATTENTION:
        a, feature = attention.get(key), f"SDPA {key} attention"
        if a is None:
            rows.append((feature, "MISSING", no_cuda or "not checked"))
        elif a["ok"]:
            rows.append((feature, "OK", "bf16 forward + backward ran and matches fp32 math "
                         f"(relative error {a['rel_err']:.3g})"))
        else:
            rows.append((feature, "MISSING" if a.get("missing") else "FAILED", a["error"]))
    return rows


def _nccl_row(versions: dict) -> tuple:
    if versions["nccl_available"]:
        return ("NCCL", "OK", f"NCCL {versions['nccl'] or '(version unknown)'} in "
                "torch.distributed")
    return ("NCCL", "MISSING", f"torch {versions['torch']} has no NCCL backend (multi-GPU runs "
            "need it)")


def _ceiling_rows(ceilings: dict, no_cuda: str | None) -> list:
    rows = []
    for key, feature, unit, peak in CEILINGS:
        c = ceilings.get(key)
        if c is None:
            rows.append((feature, "MISSING", no_cuda or "not measured"))
        elif c.get("ok"):
            value = c["tflops"] if unit == "TFLOP/s" else c["gbps"]
            pct = f", {c['pct_of_peak']:.0f}% of the {peak} peak" if "pct_of_peak" in c else ""
            rows.append((feature, "OK", f"{value:,.1f} {unit}{pct}"))
        elif "skipped" in c:
            rows.append((feature, "MISSING", c["skipped"]))
        else:
            rows.append((feature, "FAILED", c["error"]))
    return rows
