"""The data pipeline: scripts/prepare_data.py on local .jsonl / .parquet / .txt files through
the real `datasets` code path (no hub), with the byte tokenizer and a BPE tokenizer trained
here; shard round trips; a killed preparation resumed to byte-identical shards; the loader's
disjointness, determinism and resume position; and every bad input as one line and exit 2."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import yaml

from conftest import DATA_DIR, ROOT, run_train, tiny_args
from fp8train.data import RandomWindows, ShardedTokens
from fp8train.shards import HEADER_BYTES, open_shard, read_header

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


def prepare(*args, env=None):
    full_env = dict(os.environ, FP8TRAIN_DATA_DIR=DATA_DIR, **(env or {}))
    return subprocess.run([sys.executable, "scripts/prepare_data.py", *map(str, args)],
                          cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=600)


def read_split(out, split):
    meta = json.load(open(out / "meta.json"))
    return np.concatenate([np.asarray(open_shard(str(out / n)))
                           for n in meta["splits"][split]["shards"]]), meta


def decode_docs(tokens, eot, decode):
    """Split the stream at EOT (which precedes every document) and decode each piece."""
    cuts = np.nonzero(tokens == eot)[0]
    assert cuts[0] == 0
    return [decode(tokens[a + 1:b]) for a, b in zip(cuts, list(cuts[1:]) + [len(tokens)])]


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


def test_parquet_with_a_locally_trained_bpe_tokenizer(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders
    from transformers import PreTrainedTokenizerFast
    docs = make_docs(300, seed=1)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(docs, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok_dir = tmp_path / "tok"
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>").save_pretrained(
        tok_dir)
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
    r = prepare(*args, "--output_dir", cut, env={"FP8TRAIN_PREPARE_KILL_AFTER": "4"})
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


@pytest.mark.parametrize("world,micro,accum", [(2, 4, 2), (8, 2, 1), (8, 3, 2)])
def test_ranks_read_disjoint_windows_within_an_epoch(world, micro, accum):
    """Simulated ranks take their slice of each step exactly as the training loop does."""
    tokens = ShardedTokens([np.arange(n, dtype=np.uint16) for n in (4000, 3000, 5000)])
    seq = 16
    sampler = RandomWindows(tokens, seq, seed=5)
    n = sampler.n_windows
    effective = micro * accum * world
    per_rank = {r: [] for r in range(world)}
    for step in range(n // effective):
        for r in range(world):
            first = step * effective + r * micro * accum
            for m in range(accum):
                per_rank[r] += sampler.starts(first + m * micro, micro).tolist()
    seen = [s for r in per_rank for s in per_rank[r]]
    assert len(seen) == len(set(seen)) == (n // effective) * effective
    assert all(s % seq == 0 and 0 <= s <= len(tokens) - seq - 1 for s in seen)
    # Windows that cross a shard boundary read both shards.
    x, y = sampler.batch(0, n)
    assert (y[:, :-1] == x[:, 1:]).all()
    flat = np.arange(12000)  # the three shards hold 0..3999, 0..2999, 0..4999
    concat = np.concatenate([flat[:4000], flat[:3000], flat[:5000]])
    starts = sampler.starts(0, n)
    assert (x.numpy() == concat[starts[:, None] + np.arange(seq)]).all()


def test_loader_is_deterministic_and_resumes_at_the_same_position():
    tokens = np.arange(50_000, dtype=np.uint16)
    a, b = RandomWindows(tokens, 32, seed=1), RandomWindows(tokens, 32, seed=1)
    straight = [a.batch(pos, 8)[0] for pos in range(0, 400, 8)]
    resumed = [b.batch(pos, 8)[0] for pos in range(200, 400, 8)]  # data_position 200 on resume
    assert all((s == r).all() for s, r in zip(straight[25:], resumed))
    # A new epoch is a new order of the same windows.
    n = a.n_windows
    e0, e1 = a.starts(0, n), a.starts(n, n)
    assert sorted(e0) == sorted(e1) and (e0 != e1).any()


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
    from fp8train.shards import write_shard
    data = prepared_tinyshakespeare(tmp_path)
    path = data / "tinyshakespeare" / "train_000000.bin"
    tokens = np.asarray(open_shard(str(path))).copy()
    tokens[10] = 300
    write_shard(str(path), tokens, 512, "byte")  # claims a larger vocabulary
    r = run_train(*tiny_args(tmp_path / "run", data_dir=data))
    assert r.returncode == 2 and "token ids up to 300 / vocabulary 512" in r.stderr


@pytest.mark.parametrize("case,expected", [
    ("empty", "no training tokens"),
    ("field", "--text_field: 'body' is not a column"),
    ("nofile", "no file matches"),
])
def test_bad_prepare_inputs_exit_2(tmp_path, case, expected):
    src = tmp_path / "docs.jsonl"
    if case == "empty":
        src.write_text(json.dumps({"text": ""}) + "\n")
        extra = ["--val_tokens", 0]
    elif case == "field":
        write_jsonl(src, make_docs(10))
        extra = ["--text_field", "body"]
    else:
        src = tmp_path / "missing*.jsonl"
        extra = []
    r = prepare("--dataset", src, "--tokenizer", "byte", "--output_dir", tmp_path / "o", *extra)
    assert r.returncode == 2, r.stderr[-2000:]
    assert expected in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("depth", [0, 3])
def test_batch_stream_yields_the_loop_order_with_or_without_prefetch(depth):
    """The background prefetch changes when batches are made, never which: rank 1 of 2,
    micro 4 × accum 3, resumed at data position 48."""
    from fp8train.data import BatchStream
    tokens = np.arange(20_000, dtype=np.uint16)
    sampler = RandomWindows(tokens, 16, seed=3)
    stream = BatchStream(sampler, position=48, rank_offset=12, micro=4, accum=3, effective=24,
                         pin=False, depth=depth)
    got = [stream.next()[0] for _ in range(9)]
    stream.close()
    want = [sampler.batch(48 + s * 24 + 12 + m * 4, 4)[0] for s in range(3) for m in range(3)]
    assert all((g == w).all() for g, w in zip(got, want))
