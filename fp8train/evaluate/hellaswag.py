"""HellaSwag (Zellers et al. 2019): pick the right one of four endings of a short text.

Each ending is scored by the model's mean cross-entropy over the ending's tokens given the
context (the "normalised" score of llm.c's dev/data/hellaswag.py and nanochat's core eval),
and the example counts as right when the true ending scores lowest: `val/hellaswag_acc`. The
context is encoded alone and each ending as " " + ending, so that the tokens of the ending are
those a reader's text would have; a row longer than the model's context keeps its last tokens.
GPT-2 124M scores about 0.294 this way (llm.c), random guessing 0.25.

The examples are the standard jsonl of the validation split (github.com/rowanz/hellaswag,
hellaswag_val.jsonl: fields ctx, endings, label), from a local file (`hellaswag_path`), or when
none is given from the HuggingFace hub (Rowan/hellaswag) through `datasets`."""
from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from ..compile import eager
from ..errors import BadInput, one_line

HUB_DATASET = "Rowan/hellaswag"
ENDINGS = 4


def load_examples(path: str | None, limit: int | None = None) -> list[dict]:
    """The examples ({"ctx", "endings", "label"}), the first `limit` of them: from the jsonl
    at `path`, else from the hub. BadInput (one line, naming the file and line) when they
    cannot be read or are not HellaSwag's."""
    rows = _read_jsonl(path) if path else _read_hub()
    out = []
    for where, row in rows:
        out.append(_example(row, where))
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise BadInput(f"{path or HUB_DATASET}: no HellaSwag examples")
    return out


def _read_jsonl(path: str):
    try:
        with open(path, encoding="utf-8") as fh:
            for i, line in enumerate(fh, 1):
                if line.strip():
                    try:
                        yield f"{path}:{i}", json.loads(line)
                    except json.JSONDecodeError as e:
                        raise BadInput(f"{path}:{i}: not JSON ({e.msg})") from None
    except OSError as e:
        raise BadInput(f"key 'hellaswag_path': cannot read '{path}': {one_line(e)}") from None


def _read_hub():
    try:
        import datasets
        split = datasets.load_dataset(HUB_DATASET, split="validation")
    except Exception as e:
        raise BadInput(f"HellaSwag from the hub ({HUB_DATASET}) failed: {one_line(e)}; set "
                       f"hellaswag_path to a local hellaswag_val.jsonl") from None
    for i, row in enumerate(split):
        yield f"{HUB_DATASET}[{i}]", row


def _example(row, where: str) -> dict:
    try:
        ctx, endings, label = row["ctx"], list(row["endings"]), int(row["label"])
    except (KeyError, TypeError, ValueError) as e:
        raise BadInput(f"{where}: not a HellaSwag example (needs ctx, endings and label: "
                       f"{one_line(e)})") from None
    if len(endings) != ENDINGS or not 0 <= label < ENDINGS or \
            not all(isinstance(t, str) for t in [ctx, *endings]):
        raise BadInput(f"{where}: not a HellaSwag example (4 text endings and a label 0-3)")
    return {"ctx": ctx, "endings": endings, "label": label}


def render(example: dict, tokenizer, block_size: int):
    """(tokens [4, L], mask [4, L]: 1 on the ending's tokens, label): the four rows of an
    example, right-padded with 0 to the longest, each at most block_size + 1 tokens (the model
    reads the first block_size and predicts the last)."""
    ctx = [int(t) for t in tokenizer.encode(example["ctx"])]
    rows, masks = [], []
    for ending in example["endings"]:
        end = [int(t) for t in tokenizer.encode(" " + ending)]
        row = (ctx + end)[-(block_size + 1):]
        mark = ([0] * len(ctx) + [1] * len(end))[-(block_size + 1):]
        rows.append(row)
        masks.append(mark)
    width = max(len(r) for r in rows)
    tokens = torch.zeros(ENDINGS, width, dtype=torch.long)
    mask = torch.zeros(ENDINGS, width)
    for i, (r, m) in enumerate(zip(rows, masks)):
        tokens[i, :len(r)] = torch.tensor(r)
        mask[i, :len(m)] = torch.tensor(m, dtype=torch.float32)
    return tokens, mask, example["label"]


def ending_losses(model, tokens: torch.Tensor, mask: torch.Tensor, vocab_size: int):
    """Each row's mean cross-entropy over its ending's tokens (a [4] tensor)."""
    logits = model(tokens[:, :-1])[..., :vocab_size].float()
    ce = F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")
    m = mask[:, 1:]
    return (ce * m).sum(1) / m.sum(1).clamp_min(1.0)


@torch.no_grad()
def score(model, examples: list, tokenizer, block_size: int, vocab_size: int, device,
          context=None, rank: int = 0, world: int = 1) -> torch.Tensor:
    """[right, counted] over this rank's share of `examples` (every world-th), a device tensor
    to sum over the ranks. Every rank runs the same number of forwards (the last share padded
    with an uncounted repeat), as each forward is a collective under FSDP."""
    import contextlib
    total = torch.zeros(2, device=device)
    per_rank = -(-len(examples) // world)
    for k in range(per_rank):
        i = k * world + rank
        counted = i < len(examples)
        tokens, mask, label = render(examples[min(i, len(examples) - 1)], tokenizer, block_size)
        with (context() if context is not None else contextlib.nullcontext()):
            losses = ending_losses(model, tokens.to(device), mask.to(device), vocab_size)
        if counted:
            total += torch.stack([(losses.argmin() == label).float(),
                                  torch.ones((), device=device)])
    return total


class HellaSwag:
    """HellaSwag during training: at the evaluations whose step is a multiple of
    `hellaswag_interval`, and at the last, on every rank, without torch.compile (each example
    has its own length) and without FP8 GEMMs (lengths not multiples of 16)."""

    def __init__(self, ev, tokenizer, mcfg, prec, accelerator):
        self.ev, self.tokenizer, self.mcfg, self.prec, self.acc = ev, tokenizer, mcfg, prec, \
            accelerator
        self.examples = load_examples(ev.hellaswag_path, ev.hellaswag_examples)

    def due(self, step: int, last: bool) -> bool:
        return step % self.ev.hellaswag_interval == 0 or last

    def accuracy(self, model) -> float:
        net = self.acc.unwrap_model(model, keep_torch_compile=False)
        was_training = net.training
        net.eval()
        with eager():   # blocks compiled in place run eagerly: every example has its length
            total = score(net, self.examples, self.tokenizer, self.mcfg.block_size,
                          self.mcfg.vocab_size, self.acc.device, self.prec.sampling_context,
                          self.acc.process_index, self.acc.num_processes)
        net.train(was_training)
        total = self.acc.reduce(total, "sum")
        return (total[0] / total[1]).item()


def evaluate_checkpoint(path: str, hellaswag_path: str | None, limit: int | None = None,
                        device: str = "auto", log=print, warn=print) -> dict:
    """HellaSwag accuracy of the model of `path` (a checkpoint or a run directory), encoded
    with its run's tokenizer, in its run's base precision (scripts/evaluate.py --hellaswag)."""
    import time

    from ..data.tokenizers import build_tokenizer
    from . import trained
    dev = trained.pick_device(device)
    t = trained.load(path, dev, warn=warn, info=log)
    examples = load_examples(hellaswag_path, limit)
    log(f"HellaSwag: {len(examples):,} examples of {hellaswag_path or HUB_DATASET}, "
        f"{t.describe()} on {dev.type}")
    t0 = time.time()
    total = score(t.model, examples, build_tokenizer(t.cfg.tokenizer), t.mcfg.block_size,
                  t.mcfg.vocab_size, dev, lambda: trained.autocast(t.cfg, dev, warn))
    return {"checkpoint": t.path, "step": t.step, "hellaswag": hellaswag_path or HUB_DATASET,
            "examples": int(total[1].item()), "val/hellaswag_acc": (total[0] / total[1]).item(),
            "seconds": round(time.time() - t0, 2)}
