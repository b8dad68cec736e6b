"""What a run shows and leaves behind while it runs (read back afterwards by fp8train/analysis).
Nothing is imported here: importing one module loads only the modules it uses.

- logger.py          the one fan-out: console + train.log, metrics.jsonl + W&B + the progress
                     line, samples, summary.json; secrets redacted.
- console.py         what every entry point does alike with the console (`run_main`).
- tracking.py        W&B through Accelerate: start, offline fallback, run id, environment.
- metrics.py         tokens/s, MFU and the GPU peak table; the interval `Meter` and its clocks.
- metrics_file.py    metrics.jsonl read back: the one reader (tools, sweeps, evaluate.py, tests).
- profiling.py       `profile_steps`: traces and memory snapshots of chosen steps.
"""
