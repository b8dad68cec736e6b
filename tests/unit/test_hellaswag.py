"""HellaSwag: the standard jsonl and the hub's parquet read offline, every malformed input
refused in one line naming the file and line (or row), each ending scored by its summed loss
(acc) and its mean loss per token (acc_norm, llm.c's normalised score), and the accuracies of a
model whose losses are known by hand. The hub's own copy, offline: tests/e2e/test_hellaswag.py."""
import json
import math
import re

import pytest
import torch
from support.hellaswag_shared import LINES, write_hellaswag
from torch import nn

from fp8train.config.load import Config
from fp8train.data.tokenizers import ByteTokenizer
from fp8train.errors import BadInput
from fp8train.evaluate.hellaswag import accuracies, ending_losses, load_examples, render, score
from fp8train.train.preflight import check

V, L = 256, 4.0     # vocabulary; the logit the stub model gives the byte "a" (all others: 0)
P_A = math.exp(L) / (math.exp(L) + V - 1)
LOSS_A, LOSS_OTHER = -math.log(P_A), -math.log((1 - P_A) / (V - 1))


class LovesA(nn.Module):
    """Predicts "a" after anything: a byte's loss is LOSS_A for "a", LOSS_OTHER otherwise."""

    def forward(self, idx):
        logits = torch.zeros(*idx.shape, V)
        logits[..., ord("a")] = L
        return logits


def mean_loss(ending):
    """By hand: the ending's bytes are " " + ending, each scored as "a" or not."""
    text = " " + ending
    return sum(LOSS_A if ch == "a" else LOSS_OTHER for ch in text) / len(text)


@pytest.fixture
def hellaswag_file(tmp_path):
    return write_hellaswag(tmp_path)


def test_the_accuracies_of_a_model_with_known_losses_are_the_hand_computed_ones(hellaswag_file):
    examples = load_examples(hellaswag_file)
    assert [e["label"] for e in examples] == [0, 2, 1, 2]
    tok = ByteTokenizer()
    for e in examples:
        tokens, mask, _ = render(e, tok, block_size=64)
        sums, means = ending_losses(LovesA(), tokens, mask, V)
        assert means.tolist() == pytest.approx([mean_loss(x) for x in e["endings"]], rel=1e-5)
        assert sums.tolist() == pytest.approx([len(" " + x) * mean_loss(x)
                                               for x in e["endings"]], rel=1e-5)
    sums = [len(" " + x) * mean_loss(x) for x in examples[2]["endings"]]
    assert min(range(4), key=sums.__getitem__) == 3      # acc is wrong here, acc_norm right
    total = score(LovesA(), examples, tok, 64, V, torch.device("cpu"))
    assert total.tolist() == [2.0, 3.0, 4.0]
    assert accuracies(total) == {"acc": 0.5, "acc_norm": 0.75, "examples": 4}


def test_ranks_share_the_examples_and_run_the_same_number_of_forwards(hellaswag_file):
    examples = load_examples(hellaswag_file)[:3]
    calls = []

    class Counting(LovesA):
        def forward(self, idx):
            calls.append(idx.shape[0])
            return super().forward(idx)
    parts = [score(Counting(), examples, ByteTokenizer(), 64, V, torch.device("cpu"),
                   rank=r, world=2) for r in range(2)]
    assert (parts[0] + parts[1]).tolist() == [1.0, 2.0, 3.0]   # acc: 1; acc_norm: 1 and 3
    assert parts[1].tolist()[2] == 1.0 and len(calls) == 4   # 2 forwards per rank


def test_rows_keep_their_last_tokens_and_the_mask_marks_the_ending():
    tokens, mask, label = render({"ctx": "abcdef", "endings": ["xy", "x", "xyz", "w"],
                                  "label": 3}, ByteTokenizer(), block_size=4)
    assert label == 3 and tokens.shape == (4, 5)
    assert bytes(tokens[2].tolist()) == b"f xyz"           # the context's start cut
    assert mask[2].tolist() == [0, 1, 1, 1, 1]
    assert bytes(tokens[1].tolist()) == b"def x" and mask[1].tolist() == [0, 0, 0, 1, 1]


BAD_LINES = [   # (the second line of a file whose first is a good example, the one-line error)
    ("{not json", ":2: not JSON (Expecting property name enclosed in double quotes: column 2)"),
    (json.dumps({"ctx": "a", "endings": ["b"] * 4}), ":2: not a HellaSwag example (no label; "),
    (json.dumps([1, 2]), ":2: not a HellaSwag example (a JSON list, not an object"),
    # refused, not coerced: true -> 1, 2.7 -> 2, "abcd" -> four one-letter endings
    (json.dumps({"ctx": "a", "endings": ["b"] * 4, "label": True}),
     ":2: not a HellaSwag example (label is a boolean true; it must be 0, 1, 2 or 3"),
    (json.dumps({"ctx": "a", "endings": ["b"] * 4, "label": 2.7}),
     ":2: not a HellaSwag example (label is a number 2.7;"),
    (json.dumps({"ctx": "a", "endings": ["b"] * 4, "label": 2.0}), ":2: not a HellaSwag example"
     " (label is a number 2.0;"),
    (json.dumps({"ctx": "a", "endings": ["b"] * 4, "label": 7}), ":2: not a HellaSwag example "
     "(label is a number 7;"),
    (json.dumps({"ctx": "a", "endings": ["b"] * 4, "label": "4"}), ":2: not a HellaSwag example "
     "(label is a string \"4\";"),
    (json.dumps({"ctx": "a", "endings": ["b"] * 4, "label": ""}), "(the test split has no "
     "labels: use the validation split)"),
    (json.dumps({"ctx": "a", "endings": "abcd", "label": 0}), ":2: not a HellaSwag example "
     "(endings is a string \"abcd\"; it must be a list of 4 strings)"),
    (json.dumps({"ctx": "a", "endings": ["b", "c"], "label": 0}), "(endings is a list of 2 "),
    (json.dumps({"ctx": "a", "endings": ["b", "c", "d", 5], "label": 0}), "(endings is a list "
     "of 4 [\"b\", \"c\", \"d\", 5]; it must be a list of 4 strings)"),
    (json.dumps({"ctx": 3, "endings": ["b"] * 4, "label": 0}), "(ctx is a number 3, not text)"),
]


@pytest.mark.parametrize("line,expect", BAD_LINES)
def test_a_record_that_is_not_hellaswags_is_one_line_naming_the_file_and_line(tmp_path, line,
                                                                              expect):
    path = tmp_path / "h.jsonl"
    path.write_text(LINES[0] + "\n" + line + "\n")
    with pytest.raises(BadInput) as e:
        load_examples(str(path))
    assert expect in str(e.value) and str(e.value).startswith(f"{path}:2: ") and \
        "\n" not in str(e.value), str(e.value)


def test_files_as_users_have_them_are_read_or_refused_in_one_line_naming_the_line(tmp_path):
    good = "\n".join(LINES) + "\n"
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + good.encode())     # saved by an editor: read as it is
    assert [e["label"] for e in load_examples(str(bom))] == [0, 2, 1, 2]
    latin = tmp_path / "latin1.jsonl"
    latin.write_bytes((LINES[0] + "\n").encode() + LINES[1].replace("So", "S\xf6").encode("latin-1"))
    array = tmp_path / "array.json"
    array.write_text("[\n" + ",\n".join(LINES) + "\n]\n")
    cut = tmp_path / "cut.jsonl"
    cut.write_text(good[:-40])                              # a download that stopped
    for path, expect in [
            (latin, f"{latin}:2: not UTF-8 text (byte 0xf6 at column "),
            (array, f"{array}:1: a JSON array; HellaSwag's file is JSON lines, one example "
                    "object per line"),
            (cut, f"{cut}:4: not JSON (Unterminated string starting at: column "),
            (tmp_path / "h.csv", f"'{tmp_path / 'h.csv'}' does not exist")]:
        with pytest.raises(BadInput) as e:
            load_examples(str(path))
        assert str(e.value).startswith(expect) and "\n" not in str(e.value), str(e.value)
    with pytest.raises(BadInput, match="the file ends inside this record: truncated"):
        load_examples(str(cut))
    (tmp_path / "h.csv").write_text("ctx,endings,label\n")
    with pytest.raises(BadInput, match=r"is read from .jsonl .* or .parquet .*, not '.csv'"):
        load_examples(str(tmp_path / "h.csv"))


def hub_parquet(path, lines=LINES):
    """The hub's parquet of Rowan/hellaswag: its columns, labels as strings."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = [json.loads(line) for line in lines]
    for r in rows:
        r.update(label=str(r["label"]), source_id="x", split_type="indomain")
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_the_hubs_parquet_reads_as_the_jsonl_does_and_a_bad_one_is_one_line(tmp_path,
                                                                           hellaswag_file):
    repo = tmp_path / "hellaswag"          # a copy of the dataset's repository
    one = hub_parquet(repo / "data" / "validation-00000-of-00001.parquet")
    hub_parquet(repo / "data" / "train-00000-of-00001.parquet", LINES[:1])
    assert load_examples(str(one)) == load_examples(hellaswag_file)
    assert load_examples(str(repo)) == load_examples(hellaswag_file)   # its validation split
    converted = tmp_path / "converted"     # the hub's parquet conversion of the dataset
    hub_parquet(converted / "default" / "validation" / "0000.parquet")
    hub_parquet(converted / "default" / "train" / "0000.parquet", LINES[:1])
    assert load_examples(str(converted)) == load_examples(hellaswag_file)
    assert len(load_examples(str(one), limit=2)) == 2
    bad = hub_parquet(tmp_path / "bad.parquet",
                      LINES[:2] + [LINES[2].replace('"label": 1', '"label": 9')])
    with pytest.raises(BadInput, match=re.escape(f"{bad}: row 2: not a HellaSwag example "
                                                 "(label is a string \"9\"")):
        load_examples(str(bad))
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(one.read_bytes()[:-100])
    with pytest.raises(BadInput, match=re.escape(f"{cut}: not a readable parquet file (")):
        load_examples(str(cut))
    (tmp_path / "empty").mkdir()
    with pytest.raises(BadInput, match="a folder without the hub's validation.*parquet"):
        load_examples(str(tmp_path / "empty"))


def test_the_preflight_checks_the_file_before_anything_is_built(hellaswag_file, tmp_path):
    """train_fp8.py's preflight (no torch) reads the examples: a missing or bad file is one
    line naming the key, the file and the line."""
    cfg = Config(dataset="synthetic", hellaswag_interval=10,
                 hellaswag_path=str(tmp_path / "nope.jsonl"))
    with pytest.raises(BadInput, match="key 'hellaswag_path': .*nope.jsonl' does not exist"):
        check(cfg)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(LINES[0] + "\n" + BAD_LINES[3][0] + "\n")
    with pytest.raises(BadInput, match=re.escape(f"key 'hellaswag_path': {bad}:2: not a "
                                                 "HellaSwag example (label is a boolean true")):
        check(Config(dataset="synthetic", hellaswag_interval=10, hellaswag_path=str(bad)))
    assert check(Config(dataset="synthetic", hellaswag_interval=10,
                        hellaswag_path=hellaswag_file, hellaswag_examples=2)) is not None
    assert len(load_examples(hellaswag_file, limit=2)) == 2
