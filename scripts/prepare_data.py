#!/usr/bin/env python3
"""Tokenize a text dataset into memory-mappable shards that train_fp8.py reads.

  python scripts/prepare_data.py --dataset fineweb-edu --tokenizer gpt2 --num_proc 16
  python scripts/prepare_data.py --dataset openwebtext --tokenizer gpt2 --num_proc 16
  python scripts/prepare_data.py --dataset 'corpus/*.jsonl' --text_field text --name mycorpus
  python scripts/prepare_data.py --dataset tinyshakespeare --tokenizer byte

Output: <data_dir>/<name>/{train_000000.bin, ..., val_000000.bin, meta.json}, where data_dir is
--data_dir, else $FP8TRAIN_DATA_DIR, else ./data. Interrupted runs resume where they stopped.
Exit codes: 0 done, 2 bad input (one line on stderr), 1 anything else.
"""
import argparse
import os
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 1)[1])
    p.add_argument("--dataset", required=True,
                   help="fineweb-edu | openwebtext | tinyshakespeare | a HF hub dataset | local "
                        ".txt/.jsonl/.json/.parquet files (globs allowed)")
    p.add_argument("--name", help="output folder name under data_dir (default: the dataset "
                                  "name, or the file name without extension)")
    p.add_argument("--output_dir", help="write here instead of <data_dir>/<name>")
    p.add_argument("--data_dir", help="default $FP8TRAIN_DATA_DIR, else ./data")
    p.add_argument("--tokenizer", default="gpt2",
                   help="gpt2 (tiktoken when installed, else HF) | byte | any AutoTokenizer "
                        "name or local directory")
    p.add_argument("--text_field", default="text")
    p.add_argument("--config_name", help="hub dataset config (fineweb-edu: sample-10BT)")
    p.add_argument("--split", default="train")
    p.add_argument("--streaming", action="store_true",
                   help="read the dataset as a stream (sets larger than the disk cache)")
    p.add_argument("--num_proc", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    p.add_argument("--shard_tokens", type=int, default=100_000_000)
    p.add_argument("--val_tokens", type=int, default=1_000_000,
                   help="the first N tokens form the validation split")
    p.add_argument("--val_docs", type=int, help="instead: the first N documents")
    p.add_argument("--max_tokens", type=int, help="stop after N tokens (a sample)")
    a = p.parse_args(argv)

    from fp8train.errors import EXIT_OK, ConfigError, run_reported
    from fp8train.prepare import PrepareArgs, prepare
    name = a.name or (a.dataset if not os.path.splitext(a.dataset)[1] and "*" not in a.dataset
                      else os.path.splitext(os.path.basename(a.dataset.replace("*", "all")))[0])
    data_dir = a.data_dir or os.environ.get("FP8TRAIN_DATA_DIR") or "data"
    out = a.output_dir or os.path.join(data_dir, name)

    def body() -> int:
        for key in ("num_proc", "shard_tokens"):
            if getattr(a, key) < 1:
                raise ConfigError(f"--{key} must be at least 1")
        prepare(PrepareArgs(dataset=a.dataset, output_dir=out, tokenizer=a.tokenizer,
                            text_field=a.text_field, config_name=a.config_name, split=a.split,
                            streaming=a.streaming, num_proc=a.num_proc,
                            shard_tokens=a.shard_tokens, val_tokens=a.val_tokens,
                            val_docs=a.val_docs, max_tokens=a.max_tokens))
        return EXIT_OK
    return run_reported(body)


if __name__ == "__main__":
    sys.exit(main())
