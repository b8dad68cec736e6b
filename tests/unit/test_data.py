"""Data: tokenizers, the corpus lookup, the split and the batch sampler."""


import os

import numpy as np
import pytest

from fp8train.data.corpus import corpus_path
from fp8train.data.loader import load_tokens
from fp8train.data.tokenizers import ByteTokenizer, build_tokenizer
from fp8train.data.windows import RandomWindows, val_batches
from fp8train.errors import BadInput


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode("To be, or not — to be")
    assert ids.dtype == np.uint8 and tok.decode(ids) == "To be, or not — to be"


def test_tinyshakespeare_split_is_90_10_and_contiguous(data_dir):
    splits = load_tokens("tinyshakespeare", data_dir, ByteTokenizer(), 64, 0.1)
    assert len(splits.train) + len(splits.val) == 1_115_394
    assert len(splits.val) == 111_539
    raw = open(os.path.join(data_dir, "tinyshakespeare.txt"), "rb").read()
    assert splits.val[:100].astype(np.uint8).tobytes() == raw[-111_539:][:100]


def test_missing_corpus_offline_names_the_path(tmp_path, monkeypatch):
    monkeypatch.setenv("FP8TRAIN_OFFLINE", "1")
    with pytest.raises(BadInput) as e:
        corpus_path("tinyshakespeare", str(tmp_path))
    msg = str(e.value)
    assert str(tmp_path / "tinyshakespeare.txt") in msg and "offline" in msg
    assert "https://" in msg and "FP8TRAIN_DATA_DIR" in msg


def test_unprepared_large_dataset_is_a_clear_error(tmp_path):
    from fp8train.data.loader import load_prepared, prepared_dir
    d = prepared_dir("fineweb-edu", str(tmp_path))
    with pytest.raises(BadInput, match=r"dataset 'fineweb-edu' is not prepared: .* run: "
                                          r"python scripts/prepare_data.py --dataset fineweb-edu "
                                          r"--tokenizer gpt2 --data_dir "):
        load_prepared(d, "fineweb-edu", str(tmp_path), "gpt2", 64)


def test_local_text_file_and_too_small_corpus(tmp_path):
    p = tmp_path / "tiny.txt"
    p.write_text("hello world\n" * 100)
    splits = load_tokens(str(p), "unused", ByteTokenizer(), 16, 0.1)
    assert len(splits.train) == 1080 and len(splits.val) == 120
    with pytest.raises(BadInput, match="fewer than seq_len"):
        load_tokens(str(p), "unused", ByteTokenizer(), 512, 0.1)
    with pytest.raises(BadInput, match="not found"):
        corpus_path(str(tmp_path / "missing.txt"), "unused")


def test_windows_are_deterministic_and_independent_of_the_split():
    tokens = np.arange(10_000, dtype=np.uint16)
    a, b = RandomWindows(tokens, 32, seed=1), RandomWindows(tokens, 32, seed=1)
    whole = a.starts(0, 16)
    # the same 16 sequences drawn as 4 micro-batches of 4 (or across ranks) are identical
    parts = np.concatenate([b.starts(i, 4) for i in range(0, 16, 4)])
    np.testing.assert_array_equal(whole, parts)
    assert not np.array_equal(whole, RandomWindows(tokens, 32, seed=2).starts(0, 16))
    x, y = a.batch(0, 16)
    assert x.shape == (16, 32) and (y[:, :-1] == x[:, 1:]).all()
    assert (x[:, 0] == a.starts(0, 16)[0:16].__array__()).all()
    # windows stay inside the data and cover it roughly uniformly
    s = a.starts(0, 20_000)
    assert s.min() >= 0 and s.max() + 33 <= len(tokens)
    assert abs(np.mean(s) / (len(tokens) - 32) - 0.5) < 0.02


def test_val_batches_are_fixed_whatever_the_micro_batch():
    tokens = np.arange(5_000, dtype=np.uint16)
    a = val_batches(tokens, 16, 24, micro=8)
    b = val_batches(tokens, 16, 24, micro=5)
    assert [len(x) for x, _ in a] == [8, 8, 8] and [len(x) for x, _ in b] == [5, 5, 5, 5, 4]
    import torch
    assert torch.equal(torch.cat([x for x, _ in a]), torch.cat([x for x, _ in b]))


def test_hf_tokenizer_from_a_local_directory(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(["to be or not to be, that is the question"] * 50,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"]))
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>").save_pretrained(tmp_path)
    tok = build_tokenizer(str(tmp_path))
    ids = tok.encode("to be or not to be")
    assert 0 < len(ids) < len("to be or not to be") and tok.vocab_size == len(tok.tok)
    assert tok.decode(ids) == "to be or not to be"


def test_unknown_hf_tokenizer_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the hub is unreachable here; fail fast
    with pytest.raises(BadInput, match="key 'tokenizer': cannot load tokenizer"):
        build_tokenizer(str(tmp_path / "no-such-tokenizer"))


@pytest.fixture
def local_server(tmp_path):
    """A real HTTP server on loopback standing in for the public URL (no internet here)."""
    import functools
    import http.server
    import threading
    root = tmp_path / "www"
    root.mkdir()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a, **k: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_download_checks_the_checksum_and_writes_atomically(tmp_path, local_server, data_dir,
                                                             monkeypatch):
    import fp8train.data.corpus as D
    root, url = local_server
    monkeypatch.delenv("FP8TRAIN_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    (root / "bad.txt").write_text("not shakespeare")
    monkeypatch.setattr(D, "TINYSHAKESPEARE_URL", f"{url}/bad.txt")
    dest = tmp_path / "data"
    with pytest.raises(BadInput, match="checksum mismatch"):
        corpus_path("tinyshakespeare", str(dest), log=lambda m: None)
    assert not (dest / "tinyshakespeare.txt").exists()
    assert not [p for p in dest.iterdir() if p.suffix in (".part", ".tmp")]   # no partial file
    (root / "input.txt").write_bytes(open(os.path.join(data_dir, "tinyshakespeare.txt"), "rb").read())
    monkeypatch.setattr(D, "TINYSHAKESPEARE_URL", f"{url}/input.txt")
    path = corpus_path("tinyshakespeare", str(dest), log=lambda m: None)
    assert path == str(dest / "tinyshakespeare.txt") and os.path.getsize(path) == 1_115_394


def _prepared(root, name="mycorpus", train=2000, val=500, vocab=257):
    from fp8train.data.shards import write_meta, write_shard
    out = root / name
    out.mkdir(parents=True)
    for split, n in (("train", train), ("val", val)):
        write_shard(str(out / f"{split}_000000.bin"), np.arange(n) % 256, vocab, "byte")
    sizes = (("train", train), ("val", val))
    write_meta(str(out), dict(tokenizer="byte", vocab_size=vocab, splits={
        s: dict(shards=[f"{s}_000000.bin"], tokens=n) for s, n in sizes}))
    return out


def test_a_prepared_name_is_found_under_data_dir_and_recorded_as_its_path(tmp_path, monkeypatch):
    from fp8train.config.load import dump_yaml
    from fp8train.train.preflight import load_checked
    store = tmp_path / "store"
    _prepared(store)
    (store / "notes.txt").write_text("hello world\n" * 100)
    monkeypatch.chdir(tmp_path)   # no ./mycorpus here: the name is looked up in data_dir
    cfg = load_checked([f"--data_dir={store}", "--dataset=mycorpus"])
    assert cfg.dataset == str(store / "mycorpus")
    assert f"dataset: {store / 'mycorpus'}" in dump_yaml(cfg)
    (tmp_path / "mycorpus").mkdir()   # a folder of that name here, not a dataset: data_dir's wins
    assert load_checked([f"--data_dir={store}", "--dataset=mycorpus"]).dataset == \
        str(store / "mycorpus")
    assert load_checked([f"--data_dir={store}", "--dataset=notes.txt"]).dataset == \
        str(store / "notes.txt")
    # a path that exists as given wins over data_dir; known names stay names
    (tmp_path / "mycorpus.txt").write_text("x\n")
    assert load_checked([f"--data_dir={store}", "--dataset=mycorpus.txt"]).dataset == "mycorpus.txt"
    assert load_checked([f"--data_dir={store}", "--dataset=tinyshakespeare"]).dataset == \
        "tinyshakespeare"


def test_plain_text_is_accepted_and_binary_text_is_not(tmp_path):
    from fp8train.data.sources import dataset_error
    ok = tmp_path / "ok.txt"
    ok.write_text("café — naïve {braces} are fine in prose\n" * 5000)   # > one sniffed block
    assert dataset_error(str(ok), "data", "byte") is None
    one_json_line = tmp_path / "one.txt"
    one_json_line.write_text('{"a": 1}\nand then prose\n')
    assert dataset_error(str(one_json_line), "data", "byte") is None
    late = tmp_path / "late.txt"
    late.write_bytes(b"x" * (1 << 16) + b"\0")   # beyond the sniffed block: read at load time
    assert dataset_error(str(late), "data", "byte") is None


def _put_token(shard, position, value):
    raw = bytearray(shard.read_bytes())
    raw[1024 + 2 * position:1024 + 2 * position + 2] = np.array([value], np.uint16).tobytes()
    shard.write_bytes(bytes(raw))


def test_body_token_ids_are_scanned_once_and_rescanned_when_a_shard_changes(tmp_path):
    from fp8train.data.loader import load_prepared
    from fp8train.data.shards import CHECKED_FILE
    d = _prepared(tmp_path)
    said = []
    load = lambda: load_prepared(str(d), str(d), str(tmp_path), "byte", 32, log=said.append)
    load()
    assert len(said) == 1 and "checked every token id of 2 shards (2,500 tokens scanned)" in said[0]
    assert (d / CHECKED_FILE).is_file()
    load()
    assert len(said) == 1                       # recorded: not scanned again
    shard = d / "train_000000.bin"
    _put_token(shard, 1234, 999)                # same size: the mtime tells it changed
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    with pytest.raises(BadInput, match=r"shard '.*train_000000.bin' holds token id 999, "
                                          r"outside the dataset's vocabulary of 257 \(the first "
                                          r"such id is at position 1,234; the header says at "
                                          r"most 255\)"):
        load()


def test_a_dataset_whose_record_cannot_be_written_is_still_checked(tmp_path):
    """A read-only copy (a shared filesystem) cannot hold the record: every run scans, and says
    so. Made unwritable by a directory in the record's place, which holds even for root."""
    from fp8train.data.loader import load_prepared
    from fp8train.data.shards import CHECKED_FILE
    d = _prepared(tmp_path)
    (d / CHECKED_FILE).mkdir()
    _put_token(d / "val_000000.bin", 7, 400)
    said = []
    with pytest.raises(BadInput, match="holds token id 400"):
        load_prepared(str(d), str(d), str(tmp_path), "byte", 32, log=said.append)
    assert "not recorded" in said[0] and "every run checks them again" in said[0]
    assert not [p for p in d.iterdir() if p.name.endswith(".tmp")]


def test_scanning_is_cheap():
    """The number docs/data.md quotes: a max over 100M uint16 tokens, memory-mapped."""
    import tempfile
    import time
    with tempfile.NamedTemporaryFile(suffix=".bin") as fh:
        np.zeros(100_000_000, dtype=np.uint16).tofile(fh.name)
        tokens = np.memmap(fh.name, dtype=np.uint16, mode="r")
        t0 = time.perf_counter()
        assert int(tokens.max()) == 0
        assert time.perf_counter() - t0 < 5


def test_eval_sequences_are_capped_at_the_disjoint_windows_of_the_split():
    tokens = np.arange(1_000, dtype=np.uint16)
    warned = []
    batches = val_batches(tokens, 32, 1_000_000, micro=8, warn=warned.append)
    starts = torch_cat_first_tokens(batches)
    assert len(starts) == 31 and (np.diff(starts) >= 32).all()
    assert "key 'eval_sequences' (1,000,000) is more than the validation split holds" in warned[0]
    assert "evaluating on 31" in warned[0]
    assert len(torch_cat_first_tokens(val_batches(tokens, 32, 31, 8, warned.append))) == 31
    assert len(warned) == 1                     # no warning when it fits


def torch_cat_first_tokens(batches):
    return np.concatenate([x[:, 0].numpy() for x, _ in batches])


def test_synthetic_data_is_checked_against_seq_len():
    from types import SimpleNamespace

    from fp8train.data.loader import load_splits
    cfg = SimpleNamespace(dataset="synthetic", seq_len=300_000)
    with pytest.raises(BadInput, match="dataset 'synthetic': the val split has 262,144 tokens"):
        load_splits(cfg)


def test_out_of_memory_is_recognised_on_cpu_and_gpu_and_when_wrapped():
    import torch

    from fp8train.errors import is_out_of_memory
    from fp8train.ranks import RankFailed
    assert is_out_of_memory(MemoryError())
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert is_out_of_memory(RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator:"
                                         " can't allocate memory: you tried to allocate 8 bytes"))
    assert is_out_of_memory(RankFailed("a step failed on rank 0: OutOfMemoryError: CUDA out of "
                                       "memory"))
    assert not is_out_of_memory(ValueError("out of memory"))
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
