"""Training: from the command line to the last step. Nothing is imported here: importing one
module loads only the modules it uses (torch is imported by build, loop and what they use, never
by cli or preflight, so that a bad config comes back before torch loads).

- cli.py         train_fp8.py's entry: the config, preflight, then `loop.train`; one-line errors
                 and exit codes.
- preflight.py   the checks of a loaded config that read the filesystem (dataset,
                 batch_cache_dir, HellaSwag's examples, a resume path).
- threads.py     how torch's CPU threads wait (OpenMP's policy), set before torch loads.
- build.py       assembly: run directory, resume point, precision, Accelerator, data, the
                 plan (plan.py), model and optimizer (restored on resume), config.yaml, W&B,
                 the loop's components; returns one `Run`.
- fp8_check.py   fp8_check_interval: the loss gap between FP8 and the base precision.
- loop.py        `train()` and the `Trainer`: the step, and the components in order.
- plan.py        every start-up decision, once, in order: the batch plan, fp8_recipe /
                 fp8_backend auto's choice on the model's own activations (and the batch plan
                 again for the chosen backend), the run's length and LR schedule.
- health.py      non-finite steps and loss spikes, counted on the device.
- recovery.py    rollback after a streak of non-finite steps, with the FP8 remedy.
- signals.py     stop signals, and the stop every rank agrees on.
- summary.py     the end-of-run report (summary.json, the closing lines), FP8's verdict in it.
"""
