"""In-process tests: scripts/bench.py --quick on CPU: the harness end to end (real train_fp8.py
runs on the synthetic stream, the probe's micro-batch, FP8 layer counts, the tables). It checks
the ... The whole story, and the tests that start processes: tests/e2e/test_bench.py."""


import math

import numpy as np
from support.runs import ROOT


def _bench():
    """The command line's parse (scripts/bench.py) and the suite it fills in (fp8train.analysis.bench)."""
    import importlib.util

    from fp8train.analysis import bench as suite
    spec = importlib.util.spec_from_file_location("bench", ROOT / "scripts" / "bench.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script.parse, suite


def test_default_suite_is_small_and_probes_once_per_preset():
    """The default suite (it must fit its 9.5-minute budget) and what each process is told:
    the probe is eager and --plan-only in the base precision; every configuration then trains
    at that micro-batch, without a probe of its own (a compiled probe compiles every trial)."""
    parse, bench = _bench()
    args = parse([])
    assert (args.presets, args.precisions, args.compile, args.warmup, args.steps,
            args.budget_min, args.fp8_layers) == ("gpt2-124m", f"bf16,{bench.default_fp8()}",
                                                  "on", 10, 20, 9.5, "all")
    # without Transformer Engine (as here), the FP8 row is torchao's, not a failed te row
    import importlib.util
    assert bench.default_fp8() == ("te" if importlib.util.find_spec("transformer_engine")
                                   else "torchao")
    assert len(bench.configurations(args)) == 2
    full = parse(["--full"])
    assert len(bench.configurations(full)) == 12 and full.budget_min == 60
    assert parse(["--full", "--budget-min", "30"]).budget_min == 30
    probe = bench.probe_args("gpt2-124m", "bf16", args, "d")
    assert {"--plan-only", "--auto_batch_size", "--compile=false", "--no_fp8",
            "--precision=bf16", "--max_batch_size=64"} <= set(probe)
    te = bench.train_args(dict(preset="gpt2-124m", precision="te", compile=True,
                               compile_scope="auto", optimizer="adamw"), args, "d", 48)
    assert {"--batch_size=48", "--gradient_accumulation_steps=1", "--compile=true", "--use_fp8",
            "--fp8_backend=te", "--fp8_fallback=error", "--fp8_layers=all",
            "--precision=bf16", "--compile_scope=auto", "--optimizer=adamw"} <= set(te)
    # first step per block against the whole model, Muon's step against AdamW's: one row each
    both = parse(["--compile-scopes", "blocks,model", "--optimizers", "adamw,muon"])
    assert [(c["compile_scope"], c["optimizer"]) for c in bench.configurations(both)
            if c["precision"] == "bf16"] == [("blocks", "adamw"), ("blocks", "muon"),
                                            ("model", "adamw"), ("model", "muon")]
    assert not any(a.startswith("--auto_batch_size") for a in te)
    assert bench.base_precision("te", args) == "bf16" and bench.base_precision("fp32", args) == \
        "fp32"


def test_synthetic_stream_is_fixed_and_learnable():
    from fp8train.data.loader import SYNTHETIC_VOCAB, synthetic_splits
    a, b = synthetic_splits(1 << 16, 1 << 12), synthetic_splits(1 << 16, 1 << 12)
    assert np.array_equal(a.train, b.train) and len(a.train) == 1 << 16
    assert a.vocab_size == SYNTHETIC_VOCAB and a.train.max() < SYNTHETIC_VOCAB
    # Far from uniform: the Zipf words make the unigram entropy well below ln(vocab).
    counts = np.bincount(a.train, minlength=SYNTHETIC_VOCAB)
    p = counts[counts > 0] / counts.sum()
    assert -(p * np.log(p)).sum() < 0.9 * math.log(SYNTHETIC_VOCAB)
