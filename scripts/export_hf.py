#!/usr/bin/env python3
"""Export a checkpoint to a Hugging Face transformers model directory.

    python scripts/export_hf.py runs/demo hf/demo               # the run's newest good checkpoint
    python scripts/export_hf.py runs/demo/checkpoints/step_0000400 hf/demo --dtype bf16

gpt2 presets become GPT2LMHeadModel, llama presets LlamaForCausalLM: config.json, safetensors
weights and the run's tokenizer (the byte tokenizer as a byte-level tokenizer of 256 ids), so
AutoModelForCausalLM.from_pretrained(OUT_DIR) and AutoTokenizer.from_pretrained(OUT_DIR) work.
FP8-trained models are exported from their high-precision master weights. After writing, the
directory is loaded back with transformers and its logits compared with ours; the result goes
to OUT_DIR/fp8train_export.json. Exit 0: exported and checked; 2: bad input; 1: the check failed.
"""
import argparse
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", help="a checkpoint directory (checkpoints/step_N) or a run "
                                      "directory (its newest checkpoint that verifies)")
    p.add_argument("out_dir", help="where to write the transformers model (new or empty)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="weights' dtype (default fp32: the master weights as trained; bf16 "
                        "halves the size)")
    p.add_argument("--no_tokenizer", action="store_true",
                   help="write the model alone (e.g. the tokenizer cannot be loaded here)")
    p.add_argument("--overwrite", action="store_true", help="replace what OUT_DIR holds")
    a = p.parse_args(argv)

    from fp8train.errors import run_reported

    def body():
        from fp8train.evaluate.hf_export import export
        export(a.checkpoint, a.out_dir, a.dtype, tokenizer=not a.no_tokenizer,
               overwrite=a.overwrite, log=print, warn=lambda m: print(f"warning: {m}",
                                                                      file=sys.stderr))
        return 0
    return run_reported(body)


if __name__ == "__main__":
    from fp8train.observe.console import run_main  # a closed stdout (| head): no traceback
    sys.exit(run_main(main))
