"""HellaSwag: the standard jsonl read offline, each ending scored by its mean loss per token
(llm.c's normalised score), and the accuracy of a model whose losses are known by hand."""
import json
import math
import re

import pytest
import torch
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


def example(ctx, endings, label, **extra):
    return json.dumps({"ind": 0, "activity_label": "x", "ctx_a": ctx, "ctx_b": "", "ctx": ctx,
                       "endings": endings, "label": label, "split": "val", **extra})


def mean_loss(ending):
    """By hand: the ending's bytes are " " + ending, each scored as "a" or not."""
    text = " " + ending
    return sum(LOSS_A if ch == "a" else LOSS_OTHER for ch in text) / len(text)


# Four examples; the model picks the ending with the most "a"s per byte.
#  1: right (label 0 is all "a"s)        2: wrong (label 2, the model picks 0)
#  3: right: normalised, the long mostly-"a" ending (label 1) beats a short one whose SUM of
#     losses is lower ("b": 2 bytes), so an unnormalised score would pick 3
#  4: right, label given as a string, as the hub's copy has it
LINES = [example("Then", ["aaaa", "bbbb", "cccc", "dddd"], 0),
         example("So", ["aaab", "abbb", "bbbb", "bbba"], 2),
         example("A man", ["bbbbbbbbbbbb", "aaaaaaaaaaab", "bbbbbbbbbbba", "b"], 1),
         example("She", ["xyz", "qq", "aaaa", "zz"], "2")]


@pytest.fixture
def hellaswag_file(tmp_path):
    path = tmp_path / "hellaswag_val.jsonl"
    path.write_text("\n".join(LINES) + "\n")
    return str(path)


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


# --- in a real run, and from a checkpoint ------------------------------------------------------

def test_a_run_logs_hellaswag_and_evaluate_py_reproduces_it(tmp_path, hellaswag_file):
    import subprocess
    import sys

    from conftest import ROOT, run_train, tiny_args
    out = tmp_path / "run"
    r = run_train(*tiny_args(out, hellaswag_interval=12, hellaswag_path=hellaswag_file))
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    accs = {row["step"]: row["val/hellaswag_acc"] for row in rows if "val/hellaswag_acc" in row}
    assert list(accs) == [12] and accs[12] in (0.0, 0.25, 0.5, 0.75, 1.0)
    assert f"val/hellaswag_acc {accs[12]:.4f}" in r.stdout
    e = subprocess.run([sys.executable, "scripts/evaluate.py", str(out), "--hellaswag",
                        hellaswag_file, "--json"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert e.returncode == 0, e.stderr[-2000:]
    got = json.loads(e.stdout)
    assert got["val/hellaswag_acc"] == accs[12] and got["examples"] == 4 and got["step"] == 12
