#!/usr/bin/env python3
"""Validation loss and perplexity of a checkpoint, computed as the training loop computes them.

    python scripts/evaluate.py runs/demo                   # newest good checkpoint, the run's eval
    python scripts/evaluate.py runs/demo/checkpoints/step_0000400 --whole --split val
    python scripts/evaluate.py runs/demo --data_dir /data --json
    python scripts/evaluate.py runs/gpt2 --hellaswag data/hellaswag_val.jsonl

By default the same eval_sequences windows in the same micro-batches and precision as the run's
eval: on the same kind of machine the number equals the val/loss metrics.jsonl logged at that
step (printed beside it when the run directory has it). --whole evaluates every window of the
split instead. --hellaswag scores HellaSwag instead (acc: the ending with the lowest summed loss;
acc_norm: the lowest mean loss per token, as llm.c does), from a local hellaswag_val.jsonl or the
hub's parquet or, given no path, from the hub (its local cache offline). Exit 0: evaluated; 2:
bad input (checkpoint, data, options).
"""
import argparse
import json
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", help="a checkpoint directory or a run directory (its newest "
                                      "checkpoint that verifies)")
    p.add_argument("--split", choices=("val", "train"), default="val")
    p.add_argument("--eval_sequences", type=int,
                   help="windows to evaluate, evenly spread (default: the run's eval_sequences)")
    p.add_argument("--whole", action="store_true", help="every window of the split")
    p.add_argument("--batch_size", type=int,
                   help="sequences per forward (default: the run's micro-batch)")
    p.add_argument("--data_dir", help="where the run's dataset is now (default: the run's)")
    p.add_argument("--dataset", help="evaluate on another dataset with the same tokenizer")
    p.add_argument("--device", default="auto", help="auto (a GPU when there is one), cpu, cuda")
    p.add_argument("--hellaswag", nargs="?", const="hub", metavar="PATH",
                   help="HellaSwag accuracy instead of the loss: the validation jsonl or the "
                        "hub's validation parquet at PATH, or without one the hub's "
                        "Rowan/hellaswag (offline: its local cache)")
    p.add_argument("--hellaswag_examples", type=int, help="score the first N examples only")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    a = p.parse_args(argv)

    from fp8train.errors import BadInput, run_reported

    def body():
        for key in ("eval_sequences", "batch_size", "hellaswag_examples"):
            if getattr(a, key) is not None and getattr(a, key) < 1:
                raise BadInput(f"--{key} must be at least 1")
        quiet = (lambda m: print(m, file=sys.stderr)) if a.json else print
        warn = lambda m: print(f"warning: {m}", file=sys.stderr)  # noqa: E731
        if a.hellaswag:
            from fp8train.evaluate.hellaswag import evaluate_checkpoint
            r = evaluate_checkpoint(a.checkpoint, None if a.hellaswag == "hub" else a.hellaswag,
                                    a.hellaswag_examples, a.device, log=quiet, warn=warn)
            print(json.dumps(r) if a.json else
                  f"HellaSwag acc {r['hellaswag/acc']:.4f}, acc_norm {r['hellaswag/acc_norm']:.4f} "
                  f"(per {r['acc_norm_by']}) over {r['examples']:,} examples ({r['seconds']:.1f} s)")
            return 0
        from fp8train.evaluate.evaluation import evaluate
        r = evaluate(a.checkpoint, a.split, a.eval_sequences, a.whole, a.batch_size, a.data_dir,
                     a.dataset, a.device, log=quiet, warn=warn)
        if a.json:
            print(json.dumps(r))
            return 0
        s = a.split
        print(f"{s}/loss {r[f'{s}/loss']:.4f}, {s}/ppl {r[f'{s}/ppl']:.2f} over "
              f"{r['tokens']:,} tokens ({r['seconds']:.1f} s)")
        if "logged_val_loss" in r:
            print(f"the run logged val/loss {r['logged_val_loss']:.4f} at step {r['step']:,} "
                  f"(difference {r[f'{s}/loss'] - r['logged_val_loss']:+.2e})")
        return 0
    return run_reported(body)


if __name__ == "__main__":
    from fp8train.observe.console import run_main  # a closed stdout (| head): no traceback
    sys.exit(run_main(main))
