#!/usr/bin/env python3
"""Tokenize a text dataset into memory-mappable shards that train_fp8.py reads.

  python scripts/prepare_data.py --dataset fineweb-edu --tokenizer gpt2 --num_proc 16
  python scripts/prepare_data.py --dataset openwebtext --tokenizer gpt2 --num_proc 16
  python scripts/prepare_data.py --dataset 'corpus/*.jsonl' --text_field text --name mycorpus
  python scripts/prepare_data.py --dataset tinyshakespeare --tokenizer byte

Output: <data_dir>/<name>/{train_000000.bin, ..., val_000000.bin, meta.json}, where data_dir is
--data_dir, else $FP8TRAIN_DATA_DIR, else ./data. An interrupted run (Ctrl-C, a killed job)
resumes where it stopped when the same command is run again; a finished one is left alone
unless --overwrite. FP8TRAIN_OFFLINE=1: tokenizers and hub datasets from the local
HuggingFace cache only.
Exit codes: 0 done, 2 bad input (one line on stderr), 3 interrupted (resumable), 1 anything
else.
"""
import argparse
import os
import signal
import sys


class _Help(argparse.RawDescriptionHelpFormatter):
    """The epilog as written, and each option's default where it has one."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and "default" not in text:
            text += " (default: %(default)s)"
        return text


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, as every other bad input: not the usage block
        print(f"error: {message} (--help lists the options)", file=sys.stderr)
        sys.exit(2)


def _count(text: str) -> int:
    """A token or document count: 1000000, 1_000_000 or 1e6."""
    try:
        return int(text.replace("_", ""))
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not value.is_integer():
        raise argparse.ArgumentTypeError(f"'{text}' is not a whole number")
    return int(value)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(description=__doc__.split("\n")[0], formatter_class=_Help,
                epilog=__doc__.split("\n", 1)[1], allow_abbrev=False)  # a typo is not a prefix
    p.add_argument("--dataset", required=True,
                   help="fineweb-edu | openwebtext | tinyshakespeare | a HF hub dataset | local "
                        ".txt/.jsonl/.json/.parquet files (globs allowed) or a directory of them")
    p.add_argument("--name", help="output folder name under data_dir (default: the dataset "
                                  "name, or the file name without extension)")
    p.add_argument("--output_dir", help="write here instead of <data_dir>/<name>")
    p.add_argument("--data_dir", help="where outputs go and tinyshakespeare.txt is found "
                                      "(default: $FP8TRAIN_DATA_DIR, else ./data)")
    p.add_argument("--tokenizer", default="gpt2",
                   help="gpt2 (tiktoken when installed, else HF) | byte | any AutoTokenizer "
                        "name or local directory")
    p.add_argument("--text_field", default="text", help="the column that holds the text")
    p.add_argument("--config_name", help="hub dataset config (fineweb-edu: sample-10BT)")
    p.add_argument("--split", default="train", help="the hub dataset's split to read")
    p.add_argument("--streaming", action="store_true",
                   help="read the dataset as a stream (sets larger than the disk cache)")
    p.add_argument("--num_proc", type=_count, default=max(1, (os.cpu_count() or 2) - 1),
                   help="tokenizer processes; the output does not depend on it (default: the "
                        "CPU count - 1, here %(default)s)")
    p.add_argument("--shard_tokens", type=_count, default=100_000_000,
                   help="tokens per shard file")
    p.add_argument("--val_tokens", type=_count,
                   help="the first N tokens form the validation split (default: 1,000,000, "
                        "or 10%% of a corpus smaller than 10,000,000 tokens)")
    p.add_argument("--val_docs", type=_count, help="instead: the first N documents")
    p.add_argument("--max_tokens", type=_count, help="stop after N tokens (a sample)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a finished or unfinished preparation in the output folder")
    return p


def _log(msg: str) -> None:
    """A progress line; a closed stdout (`| head`) silences the rest instead of failing."""
    try:
        print(msg, flush=True)
    except BrokenPipeError:
        sys.stdout = open(os.devnull, "w")


def _output_name(dataset: str) -> str:
    if os.path.isdir(dataset):
        return os.path.basename(os.path.normpath(dataset))
    if not os.path.splitext(dataset)[1] and "*" not in dataset:
        return dataset
    return os.path.splitext(os.path.basename(dataset.replace("*", "all")))[0]


def main(argv=None) -> int:
    try:
        a = _parser().parse_args(argv)
    except BrokenPipeError:  # --help into a closed pipe
        return 0

    from fp8train.data.prepare import PROGRESS, PrepareArgs, prepare
    from fp8train.errors import EXIT_OK, EXIT_STOPPED, run_reported
    data_dir = a.data_dir or os.environ.get("FP8TRAIN_DATA_DIR") or "data"
    out = a.output_dir or os.path.join(data_dir, a.name or _output_name(a.dataset))

    def body() -> int:
        prepare(PrepareArgs(dataset=a.dataset, output_dir=out, tokenizer=a.tokenizer,
                            text_field=a.text_field, config_name=a.config_name, split=a.split,
                            streaming=a.streaming, num_proc=a.num_proc,
                            shard_tokens=a.shard_tokens, val_tokens=a.val_tokens,
                            val_docs=a.val_docs, max_tokens=a.max_tokens,
                            overwrite=a.overwrite, data_dir=data_dir), log=_log)
        return EXIT_OK

    def stop(signum, frame):  # a killed job (SIGTERM) ends as Ctrl-C does
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, stop)
    # Ctrl-C too, as the trainer does, also where the start left SIGINT ignored (a job sent to
    # the background by a non-interactive shell): `kill -INT` still stops it.
    signal.signal(signal.SIGINT, stop)
    try:
        return run_reported(body)
    except KeyboardInterrupt:
        kept = os.path.isfile(os.path.join(out, PROGRESS))
        print("error: interrupted: " + (
            f"'{out}' is unfinished (no meta.json, so training refuses it); run the same "
            "command again to resume" if kept else "nothing was written"),
            file=sys.stderr, flush=True)
        return EXIT_STOPPED


if __name__ == "__main__":
    from fp8train.observe.console import run_main  # a closed stdout (| head): no traceback
    sys.exit(run_main(main))
