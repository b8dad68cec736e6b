"""Runs read back and measured, after they ran: nothing here runs during training. Nothing is
imported here: importing one module loads only the modules it uses.

- metrics_reader.py  a run's metrics.jsonl, config.yaml and train.log read back.
- plot.py            a run's curves, the LR schedule (scripts/plot_run.py,
                     scripts/visualize_lr_schedule.py).
- compare.py         runs side by side, FP8 runs against their bf16 twins
                     (scripts/compare_runs.py).
- bench.py           training speed: preset × precision × compile, each a real run
                     (scripts/bench.py).
- loss_bench.py      the output layer's loss, plain against chunked: time and memory
                     (scripts/bench_loss.py).
- race.py            the README demo against nanoGPT's CPU recipe, loss against wall time
                     (scripts/race_nanogpt.py).
"""
