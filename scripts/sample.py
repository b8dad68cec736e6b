#!/usr/bin/env python3
"""Generate text from a checkpoint.

    python scripts/sample.py runs/demo --prompt "ROMEO:"
    python scripts/sample.py runs/demo/checkpoints/step_0000400 --prompt "Once" \
        --num_samples 3 --max_new_tokens 300 --temperature 0.9 --top_k 40 --seed 7

Top-k sampling at a temperature (--temperature 0: greedy, --top_k 0: no top-k cut), with the
run's tokenizer, from the model's high-precision weights (FP8-trained models included). The same
--seed gives the same text on the same device. Exit 0: sampled; 2: bad input.
"""
import argparse
import json
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", help="a checkpoint directory or a run directory (its newest "
                                      "checkpoint that verifies)")
    p.add_argument("--prompt", default="", help="text to continue (default: start of text)")
    p.add_argument("--num_samples", type=int, default=1)
    p.add_argument("--max_new_tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--top_k", type=int, default=50, help="0: sample from every token")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--device", default="auto", help="auto (a GPU when there is one), cpu, cuda")
    p.add_argument("--json", action="store_true", help="one JSON object per sample")
    a = p.parse_args(argv)

    from fp8train.errors import BadInput, run_reported

    def body():
        for key, low in (("num_samples", 1), ("max_new_tokens", 1), ("top_k", 0)):
            if getattr(a, key) < low:
                raise BadInput(f"--{key} must be at least {low}, got {getattr(a, key)}")
        if not a.temperature >= 0:
            raise BadInput(f"--temperature must be 0 (greedy) or more, got {a.temperature}")
        from fp8train.evaluate.samples import sample_text
        texts = sample_text(a.checkpoint, a.prompt, a.num_samples, a.max_new_tokens,
                            a.temperature, a.top_k, a.seed, a.device,
                            log=lambda m: print(m, file=sys.stderr),
                            warn=lambda m: print(f"warning: {m}", file=sys.stderr))
        for i, text in enumerate(texts):
            if a.json:
                print(json.dumps({"prompt": a.prompt, "sample": text}))
            else:
                print(f"--- sample {i + 1}\n{a.prompt}{text}")
        return 0
    return run_reported(body)


if __name__ == "__main__":
    from fp8train.observe.console import run_main  # a closed stdout (| head): no traceback
    sys.exit(run_main(main))
