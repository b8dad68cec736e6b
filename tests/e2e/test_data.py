"""Data: tokenizers, the corpus lookup, the split and the batch sampler."""


import os


def test_the_suggested_prepare_command_works(tmp_path, monkeypatch):
    """The command in the refusal of a .jsonl given directly, run as printed, prepares a dataset
    that the same run then accepts by name."""
    import shlex
    import subprocess
    import sys

    from support.runs import ROOT

    from fp8train.data.sources import dataset_error, resolved_dataset
    src = tmp_path / "docs.jsonl"
    src.write_text("".join('{"body": "document %d. %s"}\n' % (i, "words " * 30)
                           for i in range(60)))
    store = tmp_path / "store"
    msg = dataset_error(str(src), str(store), "byte")
    command = msg.split("prepare it first: ", 1)[1].split(", and train with --dataset ")[0]
    assert "--text_field body" in command and "--tokenizer byte" in command
    argv = shlex.split(command)[1:] + ["--val_docs", "10", "--num_proc", "1"]
    r = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0, r.stderr[-2000:]
    name = msg.rsplit("--dataset ", 1)[1]
    path = resolved_dataset(name, str(store))
    assert path == str(store / "docs") and dataset_error(path, str(store), "byte") is None


def test_a_real_out_of_memory_is_one_line_naming_the_keys(tmp_path):
    """A real allocation failure (a model far larger than the process may map, under an address
    space limit so that it fails the same way whatever the machine's overcommit policy)."""
    import resource
    import subprocess
    import sys

    from support.runs import DATA_DIR, ROOT, tiny_args

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (32 << 30, 32 << 30))
    r = subprocess.run([sys.executable, "train_fp8.py",
                        *tiny_args(tmp_path / "out", n_layer=1, n_head=1, n_embd=1 << 20,
                                   seq_len=32, batch_size=2, gradient_accumulation_steps=1,
                                   max_steps=2, warmup_steps=0)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, preexec_fn=limit,
                       env=dict(os.environ, FP8TRAIN_DATA_DIR=DATA_DIR))
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: out of memory ("), r.stderr
    assert "lower batch_size (now 2;" in lines[0] and "seq_len (now 32)" in lines[0]
