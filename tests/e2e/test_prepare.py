"""The data pipeline: scripts/prepare_data.py on local .jsonl / .parquet / .txt files through
the real `datasets` code path (no hub), with the byte tokenizer and a BPE tokenizer trained
here; shard round trips; a killed preparation resumed to byte-identical shards; the loader's
disjointness, determinism and resume position; and every bad input as one line and exit 2."""


import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml
from support.runs import DATA_DIR, ROOT, run_train, tiny_args

from fp8train.data.shards import HEADER_BYTES, open_shard, read_header

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex "
         "jolly boxers and brave zebras drink milk").split()


def make_docs(n=400, seed=0):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(3, 60)))) + f" #{i}"
            for i in range(n)]


def write_jsonl(path, docs, field="text"):
    with open(path, "w") as fh:
        for i, d in enumerate(docs):
            fh.write(json.dumps({field: d, "id": i}) + "\n")
    return path


def prepare(*args, env=None, kill_after=None):
    """scripts/prepare_data.py; `kill_after=N`: SIGKILLed after its N-th shard
    (tests/support/prepare_killed.py)."""
    full_env = dict(os.environ, FP8TRAIN_DATA_DIR=DATA_DIR, **(env or {}))
    script = ["scripts/prepare_data.py"] if kill_after is None else \
        ["tests/support/prepare_killed.py", str(kill_after)]
    return subprocess.run([sys.executable, *script, *map(str, args)],
                          cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=600)


def read_split(out, split):
    meta = json.load(open(out / "meta.json"))
    return np.concatenate([np.asarray(open_shard(str(out / n)))
                           for n in meta["splits"][split]["shards"]]), meta


def decode_docs(tokens, eot, decode):
    """Split the stream at EOT (which precedes every document) and decode each piece."""
    cuts = np.nonzero(tokens == eot)[0]
    assert cuts[0] == 0
    return [decode(tokens[a + 1:b]) for a, b in zip(cuts, list(cuts[1:]) + [len(tokens)], strict=True)]


@pytest.mark.parametrize("streaming", [False, True])
def test_jsonl_byte_round_trip_with_eot_separators(tmp_path, streaming):
    docs = make_docs()
    src = write_jsonl(tmp_path / "docs.jsonl", docs)
    out = tmp_path / "out"
    r = prepare("--dataset", src, "--tokenizer", "byte", "--output_dir", out,
                "--shard_tokens", 5000, "--val_docs", 20, "--num_proc", 2,
                *(["--streaming"] if streaming else []))
    assert r.returncode == 0, r.stderr[-2000:]
    val, meta = read_split(out, "val")
    train, _ = read_split(out, "train")
    assert meta["vocab_size"] == 257 and meta["eot_token"] == 256 and meta["dtype"] == "uint16"
    assert len(meta["splits"]["train"]["shards"]) > 3
    assert all(read_header(str(out / n)).count == 5000
               for n in meta["splits"]["train"]["shards"][:-1])  # full shards but the last
    stream = np.concatenate([val, train])
    back = decode_docs(stream, 256, lambda ids: bytes(ids.astype(np.uint8)).decode("utf-8"))
    assert back == docs
    assert meta["splits"]["val"]["documents"] == 20 and len(decode_docs(val, 256, len)) == 20
    assert not list(out.glob("*.tmp")) and not (out / ".progress.json").exists()


def save_bpe_tokenizer(directory, docs):
    """A byte-level BPE tokenizer with an end-of-text token, trained here on `docs`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(docs, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>").save_pretrained(
        directory)


def test_parquet_with_a_locally_trained_bpe_tokenizer(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    from transformers import PreTrainedTokenizerFast
    docs = make_docs(300, seed=1)
    tok_dir = tmp_path / "tok"
    save_bpe_tokenizer(tok_dir, docs)
    pq.write_table(pa.table({"content": docs, "n": list(range(len(docs)))}),
                   tmp_path / "docs.parquet")
    out = tmp_path / "out"
    r = prepare("--dataset", tmp_path / "docs.parquet", "--text_field", "content",
                "--tokenizer", tok_dir, "--output_dir", out, "--val_tokens", 1000)
    assert r.returncode == 0, r.stderr[-2000:]
    train, meta = read_split(out, "train")
    val, _ = read_split(out, "val")
    assert len(val) == 1000 and meta["tokenizer"] == str(tok_dir)
    eot = meta["eot_token"]
    hf = PreTrainedTokenizerFast.from_pretrained(tok_dir)
    assert eot == hf.eos_token_id
    assert decode_docs(np.concatenate([val, train]), eot,
                       lambda ids: hf.decode(ids.tolist())) == docs


def test_killed_preparation_resumes_to_byte_identical_shards(tmp_path):
    src = write_jsonl(tmp_path / "docs.jsonl", make_docs(600, seed=2))
    args = ["--dataset", src, "--tokenizer", "byte", "--shard_tokens", 3000,
            "--val_tokens", 2500, "--num_proc", 1]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert prepare(*args, "--output_dir", whole).returncode == 0
    r = prepare(*args, "--output_dir", cut, kill_after=4)
    assert r.returncode == -9  # SIGKILL, mid-run
    assert (cut / "train_999999.bin.tmp").exists() and not (cut / "meta.json").exists()
    r = prepare(*args, "--output_dir", cut)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resuming: 3 train and 1 val shards done" in r.stdout
    names = sorted(p.name for p in whole.glob("*.bin"))
    assert names == sorted(p.name for p in cut.glob("*.bin")) and len(names) > 6
    for n in names:
        assert (whole / n).read_bytes() == (cut / n).read_bytes(), n
    m1, m2 = (json.load(open(d / "meta.json")) for d in (whole, cut))
    assert m1["splits"] == m2["splits"]


def prepared_tinyshakespeare(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    os.symlink(os.path.join(DATA_DIR, "tinyshakespeare.txt"), data / "tinyshakespeare.txt")
    r = prepare("--dataset", "tinyshakespeare", "--tokenizer", "byte", "--data_dir", data,
                "--val_tokens", 100_000, "--shard_tokens", 400_000)
    assert r.returncode == 0, r.stderr[-2000:]
    return data


def test_training_reads_prepared_shards(tmp_path):
    data = prepared_tinyshakespeare(tmp_path)
    out = tmp_path / "run"
    r = run_train(*tiny_args(out, data_dir=data, max_steps=6, warmup_steps=2))
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"data: {data / 'tinyshakespeare'} (3 train shards) (byte tokenizer, vocab 257): " \
           f"1,015,395 train / 100,000 val tokens" in r.stdout
    derived = yaml.safe_load(open(out / "config.yaml"))["derived"]
    assert derived["vocab_size"] == 257 and derived["padded_vocab_size"] == 384


def corrupt(path, how):
    raw = bytearray(path.read_bytes())
    if how == "header":
        raw[:8] = b"NOTSHARD"
    elif how == "truncate":
        raw = raw[:HEADER_BYTES + 1000]
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("case,expected", [
    ("header", "train_000001.bin': not a token shard (bad header magic)"),
    ("truncate", "train_000001.bin' is truncated or corrupt: its header says 400,000 tokens"),
    ("tokenizer", "key 'tokenizer' is 'gpt2' but"),
    ("missing_meta", "has no meta.json"),
])
def test_bad_prepared_data_exits_2_with_one_line(tmp_path, case, expected):
    data = prepared_tinyshakespeare(tmp_path)
    d = data / "tinyshakespeare"
    extra = {}
    if case in ("header", "truncate"):
        corrupt(d / "train_000001.bin", case)
    elif case == "tokenizer":
        extra = dict(tokenizer="gpt2")
    elif case == "missing_meta":
        (d / "meta.json").unlink()
        extra = dict(dataset=d)
    r = run_train(*tiny_args(tmp_path / "run", data_dir=data, **extra))
    assert r.returncode == 2, (r.stdout[-1000:], r.stderr[-2000:])
    assert expected in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_token_ids_outside_the_vocabulary_are_caught_before_training(tmp_path):
    """A shard whose ids exceed the dataset's vocabulary (a tokenizer mismatch) stops the run
    with exit 2 instead of a device-side assert at step 1."""
    from fp8train.data.shards import write_shard
    data = prepared_tinyshakespeare(tmp_path)
    path = data / "tinyshakespeare" / "train_000000.bin"
    tokens = np.asarray(open_shard(str(path))).copy()
    tokens[10] = 300
    write_shard(str(path), tokens, 512, "byte")  # claims a larger vocabulary
    r = run_train(*tiny_args(tmp_path / "run", data_dir=data))
    assert r.returncode == 2 and "token ids up to 300 / vocabulary 512" in r.stderr


def _offline(tmp_path):
    """Offline, with an empty HuggingFace cache of its own (a cached copy elsewhere cannot
    make the case pass)."""
    return {"FP8TRAIN_OFFLINE": "1", **_empty_hf_cache(tmp_path)}


def _empty_hf_cache(tmp_path):
    return {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": str(tmp_path / "hf" / "hub"),
            "HF_DATASETS_CACHE": str(tmp_path / "hf" / "datasets")}


def _dead_hub(tmp_path):
    from support.bad_input_kit import DEAD_PROXY
    return {**DEAD_PROXY, **_empty_hf_cache(tmp_path)}


BAD_PREPARE = {  # id: (argv after --dataset's value, files, env, expected)
    "empty": ([], {"docs.jsonl": json.dumps({"text": ""}) + "\n"}, None,
              "--dataset '{d}/docs.jsonl': no training tokens (the dataset has no text)"),
    "field": (["--text_field", "body"], "docs", None, "--text_field: 'body' is not a column"),
    "text-not-a-string": ([], {"docs.jsonl": json.dumps({"text": 5}) + "\n"}, None,
                          "--text_field: 'text' of row 0 is int, not text"),
    "glob-matches-nothing": ([], {}, None, "no file matches '{d}/missing*.jsonl'"),
    "file-missing": ([], {}, None, "no file matches '{d}/missing.txt'"),
    "dir-without-text": ([], {"corpus/readme.md": "# notes\n"}, None,
                         "--dataset: directory '{d}/corpus' has no .txt, .jsonl, .json or "
                         ".parquet files"),
    "unsupported-extension": ([], {"docs.csv": "text\nhello\n"}, None,
                              "must be .txt, .jsonl, .json or .parquet files of one kind"),
    "val-tokens-zero": (["--val_tokens", "0"], "docs", None,
                        "--val_tokens must be at least 1, got 0"),
    "val-tokens-negative": (["--val_tokens", "-3"], "docs", None,
                            "--val_tokens must be at least 1, got -3"),
    "val-tokens-not-a-number": (["--val_tokens", "1e6x"], "docs", None,
                                "argument --val_tokens: '1e6x' is not a whole number"),
    "val-tokens-takes-everything": (["--val_tokens", "1000000"], "docs", None,
                                    "--val_tokens 1,000,000 takes all"),
    "val-docs-takes-everything": (["--val_docs", "500"], "docs", None,
                                  "--val_docs 500 takes all 400 documents"),
    "val-tokens-and-val-docs": (["--val_tokens", "100", "--val_docs", "5"], "docs", None,
                                "--val_tokens and --val_docs both choose"),
    "num-proc-zero": (["--num_proc", "0"], "docs", None, "--num_proc must be at least 1"),
    "max-tokens-zero": (["--max_tokens", "0"], "docs", None, "--max_tokens must be at least 1"),
    "unknown-option": (["--val_token", "5"], "docs", None, "unrecognized arguments: --val_token"),
    "output-dir-is-a-file": (["--output_dir", "{d}/afile"], "docs", None,
                             "output directory '{d}/afile' is a file"),
    "output-dir-holds-other-files": (["--output_dir", "{d}/mine"], "docs", None,
                                     "output directory '{d}/mine' holds files that are not a "
                                     "prepared dataset (notes.txt)"),
    "tokenizer-dir-missing": (["--tokenizer", "{d}/no/such/tok"], "docs", None,
                              "--tokenizer: cannot load tokenizer '{d}/no/such/tok'"),
    "streamed-malformed-jsonl": (["--streaming"], {"docs.jsonl": '{"text": "a"}\n{"text": \n'},
                                 None, "--dataset '{d}/docs.jsonl': cannot read it after"),
    "tinyshakespeare-missing-offline": (["--data_dir", "{d}/empty"], {"empty/x": ""}, "offline",
                                        "dataset 'tinyshakespeare' not found at "
                                        "'{d}/empty/tinyshakespeare.txt' (offline mode is set)"),
    "hub-dataset-offline": (["--tokenizer", "byte"], {}, "offline",
                            "--dataset 'fineweb-edu': cannot load it (not in the local "
                            "HuggingFace cache, and offline mode is set)"),
    "hub-dataset-hub-unreachable": (["--tokenizer", "byte"], {}, "dead",
                                    "--dataset 'fineweb-edu': cannot load it (not in the local "
                                    "HuggingFace cache, and the hub cannot be reached: "),
    "unknown-name-offline": (["--tokenizer", "byte"], {}, "offline",
                             "did you mean 'tinyshakespeare'?"),
    "default-tokenizer-offline": ([], {}, "offline",
                                  "--tokenizer: cannot load tokenizer 'gpt2' (not in the local "
                                  "HuggingFace cache, and offline mode is set "
                                  "(FP8TRAIN_OFFLINE=1)"),
    "default-tokenizer-hub-unreachable": ([], {}, "dead",
                                          "--tokenizer: cannot load tokenizer 'gpt2' (not in the "
                                          "local HuggingFace cache, and the hub cannot be "
                                          "reached: "),
}


DATASET_ARG = {"empty": "docs.jsonl", "text-not-a-string": "docs.jsonl",
               "glob-matches-nothing": "missing*.jsonl", "file-missing": "missing.txt",
               "dir-without-text": "corpus", "unsupported-extension": "docs.csv",
               "streamed-malformed-jsonl": "docs.jsonl",
               "tinyshakespeare-missing-offline": "=tinyshakespeare",
               "hub-dataset-offline": "=fineweb-edu",
               "hub-dataset-hub-unreachable": "=fineweb-edu",
               "unknown-name-offline": "=tinyshakespear",
               "default-tokenizer-offline": "=fineweb-edu",
               "default-tokenizer-hub-unreachable": "=fineweb-edu"}


@pytest.mark.parametrize("case", BAD_PREPARE)
def test_bad_prepare_inputs_exit_2_in_one_line_and_leave_nothing(tmp_path, case):
    """Bad input to prepare_data.py: exit 2, one line naming the argument or path, within
    seconds (offline, or with the hub unreachable, no retries), and no output folder left
    behind (the default one under data_dir, with its parents, included)."""
    argv, files, env, expected = BAD_PREPARE[case]
    d = str(tmp_path)
    if files == "docs":
        write_jsonl(tmp_path / "docs.jsonl", make_docs())
        files = {}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    if case == "output-dir-is-a-file":
        (tmp_path / "afile").write_text("x\n")
    if case == "output-dir-holds-other-files":
        (tmp_path / "mine").mkdir()
        (tmp_path / "mine" / "notes.txt").write_text("mine\n")
    ds = DATASET_ARG.get(case, "docs.jsonl")
    ds = ds[1:] if ds.startswith("=") else f"{d}/{ds}"
    tokenizer = [] if "--tokenizer" in argv or case.startswith("default-tokenizer") \
        else ["--tokenizer", "byte"]
    env = {"offline": _offline(tmp_path), "dead": _dead_hub(tmp_path), None: {}}[env]
    out = tmp_path / "out" / "nested"
    t0 = time.time()
    r = prepare("--dataset", ds, *tokenizer, "--data_dir", out,
                *[a.replace("{d}", d) for a in argv], env=env)
    elapsed = time.time() - t0
    assert r.returncode == 2, (r.stdout[-1000:], r.stderr[-2000:])
    assert expected.replace("{d}", d) in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("error: ")
    assert elapsed < 20, f"{elapsed:.0f} s"
    assert not (tmp_path / "out").exists(), list((tmp_path / "out").rglob("*"))
    if case == "output-dir-holds-other-files":
        assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["notes.txt"]


def test_a_small_corpus_gets_a_fitting_validation_split_and_is_told(tmp_path):
    """A directory of .txt files (one document each) of 60,000 tokens: the default validation
    split (1M tokens) would take everything; it takes 10% and says so. The largest token id of
    each split is recorded in meta.json."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, doc in enumerate(make_docs(400, seed=5)):
        (corpus / f"doc{i:03d}.txt").write_text(doc)
    total = sum(len(d.encode()) + 1 for d in make_docs(400, seed=5))  # + the EOT of each
    r = prepare("--dataset", corpus, "--tokenizer", "byte", "--data_dir", tmp_path / "data",
                "--num_proc", 1, "--shard_tokens", 20_000)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"validation split: the first {total // 10:,} of the corpus's {total:,} tokens (10%" \
        in r.stdout
    out = tmp_path / "data" / "corpus"
    val, meta = read_split(out, "val")
    train, _ = read_split(out, "train")
    assert len(val) == total // 10 and len(train) == total - total // 10
    assert all(read_header(str(out / n)).count == 20_000
               for n in meta["splits"]["train"]["shards"][:-1])
    for split, tokens in (("train", train), ("val", val)):
        assert meta["splits"][split]["max_token_id"] == int(tokens.max())


def test_a_rerun_says_what_it_does_and_never_mixes_arguments(tmp_path):
    src = write_jsonl(tmp_path / "docs.jsonl", make_docs(200, seed=6))
    out = tmp_path / "out"
    args = ["--dataset", src, "--tokenizer", "byte", "--output_dir", out, "--num_proc", 1]
    assert prepare(*args).returncode == 0
    first = (out / "meta.json").read_text()
    r = prepare(*args)  # the same command: nothing to do, and it says so
    assert r.returncode == 0 and "already prepared with these arguments" in r.stdout
    r = prepare(*args, "--val_tokens", 500)  # other arguments: refused, the data untouched
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "already prepared with other arguments (val_tokens: default -> 500); pass " \
           "--overwrite" in r.stderr
    assert (out / "meta.json").read_text() == first
    r = prepare(*args, "--val_tokens", 500, "--overwrite")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "--overwrite: removed the previous preparation" in r.stdout
    assert json.load(open(out / "meta.json"))["splits"]["val"]["tokens"] == 500


def test_resuming_with_other_arguments_is_refused(tmp_path):
    src = write_jsonl(tmp_path / "docs.jsonl", make_docs(600, seed=2))
    out = tmp_path / "cut"
    args = ["--dataset", src, "--tokenizer", "byte", "--val_tokens", 2500, "--num_proc", 1,
            "--output_dir", out]
    r = prepare(*args, "--shard_tokens", 3000, kill_after=3)
    assert r.returncode == -9
    r = prepare(*args, "--shard_tokens", 4000)
    assert r.returncode == 2 and "holds an unfinished preparation with other arguments " \
                                 "(shard_tokens: 3000 -> 4000)" in r.stderr
    assert (out / ".progress.json").exists()  # still resumable with the first arguments
    r = prepare(*args, "--shard_tokens", 3000)
    assert r.returncode == 0 and "resuming: 2 train and 1 val shards done" in r.stdout


def test_ctrl_c_leaves_a_resumable_folder_that_training_refuses(tmp_path):
    """SIGINT mid-run: exit 3 with one line, no traceback (the tokenizer workers too), no
    meta.json, so training refuses the folder, and the progress a rerun resumes from. Started
    with SIGINT ignored, as a non-interactive shell starts a background job (and as this test
    ran under one): prepare_data.py handles it itself, as the trainer does."""
    from fp8train.data.loader import load_prepared
    from fp8train.errors import BadInput
    out = tmp_path / "cut"
    args = ["--dataset", os.path.join(DATA_DIR, "tinyshakespeare.txt"), "--tokenizer", "byte",
            "--output_dir", out, "--val_tokens", 1000, "--shard_tokens", 200, "--num_proc", 2]
    p = subprocess.Popen([sys.executable, "scripts/prepare_data.py", *map(str, args)], cwd=ROOT,
                         env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    for line in p.stdout:
        if line.startswith("wrote train_000005.bin"):
            os.killpg(p.pid, signal.SIGINT)  # as Ctrl-C does: the workers get it too
            break
    rest, err = p.communicate(timeout=120)
    assert p.returncode == 3, err[-2000:]
    assert err.startswith("error: interrupted: ") and len(err.strip().splitlines()) == 1, err
    assert "run the same command again to resume" in err
    assert not (out / "meta.json").exists()
    with pytest.raises(BadInput, match="has no meta.json"):
        load_prepared(str(out), str(out), str(tmp_path), "byte", 32)
    assert (out / ".progress.json").exists()  # what a rerun resumes from (tested above)


def test_help_shows_the_defaults_and_survives_a_closed_pipe():
    """`prepare_data.py --help | head`: the reader is gone before the help is written."""
    read, write = os.pipe()
    os.close(read)
    r = subprocess.run([sys.executable, "scripts/prepare_data.py", "--help"], cwd=ROOT,
                       stdout=write, stderr=subprocess.PIPE, text=True, timeout=60)
    os.close(write)
    assert r.returncode == 0 and r.stderr == ""
    text = prepare("--help").stdout
    assert "--shard_tokens SHARD_TOKENS\n                        tokens per shard file " \
           "(default: 100000000)" in text and "(default: gpt2)" in text


@pytest.mark.parametrize("network", ["offline", "hub-unreachable"])
def test_a_cached_hub_tokenizer_loads_without_the_network(tmp_path, network):
    """A hub tokenizer already in the HuggingFace cache (laid out here as a download leaves it:
    the files, refs/main, and the record that the repository has no config.json; the hub
    itself is not reachable from the tests) is used at once, offline or with the hub
    unreachable, without a single retry line."""
    env = _offline(tmp_path) if network == "offline" else _dead_hub(tmp_path)
    repo, commit = "testorg/tiny-bpe", "0123456789abcdef0123456789abcdef01234567"
    cache = tmp_path / "hf" / "hub" / "models--testorg--tiny-bpe"
    save_bpe_tokenizer(cache / "snapshots" / commit, make_docs(200, seed=4))
    (cache / "refs").mkdir()
    (cache / "refs" / "main").write_text(commit)
    (cache / ".no_exist" / commit).mkdir(parents=True)
    (cache / ".no_exist" / commit / "config.json").touch()
    src = write_jsonl(tmp_path / "docs.jsonl", make_docs(50))
    t0 = time.time()
    r = prepare("--dataset", src, "--tokenizer", repo, "--output_dir", tmp_path / "out",
                "--val_docs", 5, "--num_proc", 1, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stderr == "" and time.time() - t0 < 20
    assert json.load(open(tmp_path / "out" / "meta.json"))["tokenizer"] == repo
