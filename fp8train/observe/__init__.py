"""What a run shows and leaves behind, and the tools that read it back. Nothing is imported
here: importing one module loads only the modules it uses.

- logger.py          the one fan-out: console + train.log, metrics.jsonl + W&B + the progress
                     line, samples, summary.json; secrets redacted.
- console.py         what every entry point does alike with the console (`run_main`).
- tracking.py        W&B through Accelerate: start, offline fallback, run id, environment.
- metrics.py         tokens/s, MFU and the GPU peak table; the interval `Meter` and its clocks.
- profiling.py       `profile_steps`: traces and memory snapshots of chosen steps.
- summary.py         the end-of-run report.
- metrics_reader.py  metrics.jsonl read back.
- plot.py            a run's curves, the LR schedule (scripts/plot_run.py,
                     scripts/visualize_lr_schedule.py).
- compare.py         runs side by side, FP8 runs against their bf16 twins
                     (scripts/compare_runs.py).
- bench.py           training speed: preset × precision × compile, each a real run
                     (scripts/bench.py).
- race.py            the README demo against nanoGPT's CPU recipe, loss against wall time
                     (scripts/race_nanogpt.py).
"""
