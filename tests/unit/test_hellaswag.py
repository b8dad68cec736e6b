"""HellaSwag: the standard jsonl read offline, each ending scored by its mean loss per token
(llm.c's normalised score), and the accuracy of a model whose losses are known by hand."""
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
from fp8train.evaluate.hellaswag import ending_losses, load_examples, render, score
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


def test_the_accuracy_of_a_model_with_known_losses_is_the_hand_computed_one(hellaswag_file):
    examples = load_examples(hellaswag_file)
    assert [e["label"] for e in examples] == [0, 2, 1, 2]
    tok = ByteTokenizer()
    for e in examples:
        tokens, mask, _ = render(e, tok, block_size=64)
        got = ending_losses(LovesA(), tokens, mask, V)
        assert got.tolist() == pytest.approx([mean_loss(x) for x in e["endings"]], rel=1e-5)
    sums = [len(" " + x) * mean_loss(x) for x in examples[2]["endings"]]
    assert min(range(4), key=sums.__getitem__) == 3      # unnormalised would be wrong here
    total = score(LovesA(), examples, tok, 64, V, torch.device("cpu"))
    assert total.tolist() == [3.0, 4.0]                   # accuracy 0.75, by hand above


def test_ranks_share_the_examples_and_run_the_same_number_of_forwards(hellaswag_file):
    examples = load_examples(hellaswag_file)[:3]
    calls = []

    class Counting(LovesA):
        def forward(self, idx):
            calls.append(idx.shape[0])
            return super().forward(idx)
    parts = [score(Counting(), examples, ByteTokenizer(), 64, V, torch.device("cpu"),
                   rank=r, world=2) for r in range(2)]
    assert (parts[0] + parts[1]).tolist() == [2.0, 3.0]   # examples 1 and 3 right
    assert parts[1].tolist()[1] == 1.0 and len(calls) == 4   # 2 forwards per rank


def test_rows_keep_their_last_tokens_and_the_mask_marks_the_ending():
    tokens, mask, label = render({"ctx": "abcdef", "endings": ["xy", "x", "xyz", "w"],
                                  "label": 3}, ByteTokenizer(), block_size=4)
    assert label == 3 and tokens.shape == (4, 5)
    assert bytes(tokens[2].tolist()) == b"f xyz"           # the context's start cut
    assert mask[2].tolist() == [0, 1, 1, 1, 1]
    assert bytes(tokens[1].tolist()) == b"def x" and mask[1].tolist() == [0, 0, 0, 1, 1]


@pytest.mark.parametrize("line,expect", [
    ("{not json", ":2: not JSON"),
    (json.dumps({"ctx": "a", "endings": ["b", "c"], "label": 0}), ":2: not a HellaSwag example"),
    (json.dumps({"ctx": "a", "endings": ["b"] * 4}), ":2: not a HellaSwag example (needs"),
    (json.dumps({"ctx": "a", "endings": ["b"] * 4, "label": 7}), ":2: not a HellaSwag example (4"),
])
def test_a_file_that_is_not_hellaswag_is_one_line_naming_the_line(tmp_path, line, expect):
    path = tmp_path / "h.jsonl"
    path.write_text(LINES[0] + "\n" + line + "\n")
    with pytest.raises(BadInput, match=re.escape(f"{path}{expect}")):
        load_examples(str(path))


def test_the_first_n_examples_and_a_missing_file(hellaswag_file, tmp_path):
    assert len(load_examples(hellaswag_file, limit=2)) == 2
    with pytest.raises(BadInput, match="cannot read"):
        load_examples(str(tmp_path / "nope.jsonl"))
    cfg = Config(dataset="synthetic", hellaswag_interval=10,
                 hellaswag_path=str(tmp_path / "nope.jsonl"))
    with pytest.raises(BadInput, match="key 'hellaswag_path': .*nope.jsonl' is not a file"):
        check(cfg)


def test_without_a_path_the_examples_come_from_the_hub_through_datasets(monkeypatch):
    """The hub cannot be reached here: datasets.load_dataset is stood in for, answering as the
    hub's Rowan/hellaswag does (labels as strings), or failing as it does offline."""
    import datasets
    asked = []

    def load_dataset(name, split):
        asked.append((name, split))
        return [json.loads(line) for line in LINES]
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    examples = load_examples(None, limit=3)
    assert asked == [("Rowan/hellaswag", "validation")] and len(examples) == 3
    assert [e["label"] for e in examples] == [0, 2, 1]

    def offline(name, split):
        raise ConnectionError("Couldn't reach 'Rowan/hellaswag' on the Hub")
    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(BadInput, match="HellaSwag from the hub .Rowan/hellaswag. failed: .*set "
                                       "hellaswag_path"):
        load_examples(None)
