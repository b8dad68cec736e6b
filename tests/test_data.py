"""Data: tokenizers, the corpus lookup, the split and the batch sampler."""
import os

import numpy as np
import pytest

from fp8train.config import ConfigError
from fp8train.data import (ByteTokenizer, RandomWindows, build_tokenizer, corpus_path,
                           load_tokens, val_batches)


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
    with pytest.raises(ConfigError) as e:
        corpus_path("tinyshakespeare", str(tmp_path))
    msg = str(e.value)
    assert str(tmp_path / "tinyshakespeare.txt") in msg and "offline" in msg
    assert "https://" in msg and "FP8TRAIN_DATA_DIR" in msg


def test_unprepared_large_dataset_is_a_clear_error(tmp_path):
    from fp8train.data import load_prepared, prepared_dir
    d = prepared_dir("fineweb-edu", str(tmp_path))
    with pytest.raises(ConfigError, match=r"dataset 'fineweb-edu' is not prepared: .* run: "
                                          r"python scripts/prepare_data.py --dataset fineweb-edu "
                                          r"--tokenizer gpt2 --data_dir "):
        load_prepared(d, "fineweb-edu", str(tmp_path), "gpt2", 64)


def test_local_text_file_and_too_small_corpus(tmp_path):
    p = tmp_path / "tiny.txt"
    p.write_text("hello world\n" * 100)
    splits = load_tokens(str(p), "unused", ByteTokenizer(), 16, 0.1)
    assert len(splits.train) == 1080 and len(splits.val) == 120
    with pytest.raises(ConfigError, match="fewer than seq_len"):
        load_tokens(str(p), "unused", ByteTokenizer(), 512, 0.1)
    with pytest.raises(ConfigError, match="not found"):
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
    with pytest.raises(ConfigError, match="key 'tokenizer': cannot load tokenizer"):
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
    import fp8train.data as D
    root, url = local_server
    monkeypatch.delenv("FP8TRAIN_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    (root / "bad.txt").write_text("not shakespeare")
    monkeypatch.setattr(D, "TINYSHAKESPEARE_URL", f"{url}/bad.txt")
    dest = tmp_path / "data"
    with pytest.raises(ConfigError, match="checksum mismatch"):
        corpus_path("tinyshakespeare", str(dest), log=lambda m: None)
    assert not (dest / "tinyshakespeare.txt").exists()
    assert not [p for p in dest.iterdir() if p.suffix == ".part"]
    (root / "input.txt").write_bytes(open(os.path.join(data_dir, "tinyshakespeare.txt"), "rb").read())
    monkeypatch.setattr(D, "TINYSHAKESPEARE_URL", f"{url}/input.txt")
    path = corpus_path("tinyshakespeare", str(dest), log=lambda m: None)
    assert path == str(dest / "tinyshakespeare.txt") and os.path.getsize(path) == 1_115_394
