"""The command line of scripts/diagnose_gpu.py: run every check, print each section as soon as
it is measured, end with the verdicts, optionally write it all as JSON.

Exits 0 whatever it finds (a missing feature is a finding, not an error of the command); 2 for
a bad argument or a --json path that cannot be written. Nothing heavy is imported before the
arguments are parsed."""
from __future__ import annotations

import argparse
import time

from ..errors import EXIT_OK, BadInput, run_reported


def _positive_multiple_of_16(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n <= 0 or n % 16:
        raise argparse.ArgumentTypeError(f"{text!r}: needs a positive multiple of 16 "
                                         "(an FP8 GEMM requirement)")
    return n


def parse_args(argv):
    p = argparse.ArgumentParser(
        description="Check this machine's GPU for fp8train: versions, FP8 backends (a real FP8 "
        "GEMM each), SDPA attention kernels, and measured matmul / bandwidth ceilings against "
        "the datasheet peak. Always exits 0: missing features are reported, not errors.")
    p.add_argument("--json", metavar="PATH", help="also write everything as JSON to PATH")
    p.add_argument("--size", type=_positive_multiple_of_16, default=8192, metavar="N",
                   help="matmul size N (N x N x N) for the TFLOP/s ceilings (default 8192)")
    p.add_argument("--quick", action="store_true",
                   help="0.1 s warm-up, fewer timed iterations and smaller copies (noisier "
                   "ceilings, a few seconds faster)")
    return p.parse_args(argv)


def _show(text: str) -> None:
    print(text + "\n", flush=True)


def diagnose(size: int, quick: bool) -> dict:
    """Every check on this machine, each section printed as soon as it is done; the report."""
    from . import report as fmt
    from .attention import check_attention
    from .ceilings import judge_ceilings, measure_ceilings, timing_plan
    from .environment import collect_versions, device_info
    from .fp8_probes import fp8_section
    from .verdicts import verdicts
    report = {"args": {"size": size, "quick": quick},
              "versions": collect_versions(), "device": device_info()}
    _show(fmt.format_environment(report))
    report["fp8"] = fp8_section(report["device"])
    _show(fmt.format_fp8(report))
    dev = report["device"]
    if dev["cuda"]:
        import torch
        device = torch.device("cuda", dev["index"])
        report["attention"] = check_attention(device)
        _show(fmt.format_attention(report))
        measured = measure_ceilings(device, timing_plan(size, quick), report["fp8"]["gate"])
        report["ceilings"] = judge_ceilings(dev["name"], measured)
        _show(fmt.format_ceilings(report))
    report["verdicts"] = verdicts(report)
    print(fmt.format_verdicts(report["verdicts"]), flush=True)
    return report


def main(argv=None) -> int:
    args = parse_args(argv)

    def body() -> int:
        t0 = time.perf_counter()
        print("fp8train GPU check (scripts/diagnose_gpu.py)\n", flush=True)
        report = diagnose(args.size, args.quick)
        report["seconds"] = round(time.perf_counter() - t0, 2)
        if args.json:
            from .report import write_json
            try:
                write_json(report, args.json)
            except OSError as e:
                raise BadInput(f"cannot write {args.json}: {e.strerror or e}") from None
            print(f"\nwrote {args.json}")
        return EXIT_OK
    return run_reported(body)

