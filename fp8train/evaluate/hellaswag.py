"""HellaSwag (Zellers et al. 2019): pick the right one of four endings of a short text.

Each ending is scored by the model's cross-entropy over the ending's tokens given the context,
and the example is right when the true ending scores best, two ways, named as lm-evaluation-
harness and llm.c name them:
- `acc`: the lowest sum of the ending's token losses (the highest log-probability of the
  ending as a whole);
- `acc_norm`: the lowest mean loss per token of the ending (normalised per token, as llm.c's
  dev/data/hellaswag.py and nanochat do; lm-evaluation-harness's acc_norm divides by the
  ending's length in characters, and its acc_bytes by its length in bytes: for the byte
  tokenizer on ASCII text, nearly all of HellaSwag's, the three agree).
They are logged as `hellaswag/acc` and `hellaswag/acc_norm`, and `val/hellaswag_acc`, the name
earlier versions gave acc_norm, is kept beside them. The context is encoded alone and each
ending as " " + ending, so that the tokens of the ending are those a reader's text would have;
a row longer than the model's context keeps its last tokens. GPT-2 124M scores about 0.294
acc_norm (llm.c), random guessing 0.25.

The examples are read (and checked) by hellaswag_data.py: the standard jsonl of the
validation split, the hub's parquet, or the hub's Rowan/hellaswag through `datasets`."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..compile import eager
from .hellaswag_data import ENDINGS, load_examples, source_name

NORMALISED_BY = "token"     # acc_norm: mean loss per token of the ending


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
    """Each row's (sum, mean per token) of cross-entropy over its ending's tokens (two [4]
    tensors)."""
    logits = model(tokens[:, :-1])[..., :vocab_size].float()
    ce = F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")
    m = mask[:, 1:]
    total = (ce * m).sum(1)
    return total, total / m.sum(1).clamp_min(1.0)


@torch.no_grad()
def score(model, examples: list, tokenizer, block_size: int, vocab_size: int, device,
          context=None, rank: int = 0, world: int = 1) -> torch.Tensor:
    """[right by acc, right by acc_norm, counted] over this rank's share of `examples` (every
    world-th), a device tensor to sum over the ranks. Every rank runs the same number of
    forwards (the last share padded with an uncounted repeat), as each forward is a collective
    under FSDP."""
    import contextlib
    total = torch.zeros(3, device=device)
    per_rank = -(-len(examples) // world)
    for k in range(per_rank):
        i = k * world + rank
        counted = i < len(examples)
        tokens, mask, label = render(examples[min(i, len(examples) - 1)], tokenizer, block_size)
        with (context() if context is not None else contextlib.nullcontext()):
            sums, means = ending_losses(model, tokens.to(device), mask.to(device), vocab_size)
        if counted:
            total += torch.stack([(sums.argmin() == label).float(),
                                  (means.argmin() == label).float(),
                                  torch.ones((), device=device)])
    return total


def accuracies(total) -> dict:
    """score()'s sums (over every rank) as the metrics' values."""
    right, right_norm, n = (float(v) for v in total.tolist())
    return {"acc": right / n, "acc_norm": right_norm / n, "examples": int(n)}


def metrics_row(acc: dict) -> dict:
    """The metrics of one HellaSwag evaluation: hellaswag/acc, hellaswag/acc_norm,
    hellaswag/examples, and val/hellaswag_acc (acc_norm, as earlier versions named it)."""
    return {"hellaswag/acc": acc["acc"], "hellaswag/acc_norm": acc["acc_norm"],
            "hellaswag/examples": acc["examples"], "val/hellaswag_acc": acc["acc_norm"]}


def describe(acc: dict) -> str:
    """One evaluation's accuracies in words, for the log line."""
    return (f"HellaSwag acc {acc['acc']:.4f}, acc_norm {acc['acc_norm']:.4f} (per "
            f"{NORMALISED_BY}) over {acc['examples']:,} examples")


class HellaSwag:
    """HellaSwag during training: at the evaluations whose step is a multiple of
    `hellaswag_interval`, and at the last, on every rank, without torch.compile (each example
    has its own length) and without FP8 GEMMs (lengths not multiples of 16). The examples were
    read and checked by the preflight (read again here from the process's cache)."""

    def __init__(self, ev, tokenizer, mcfg, prec, accelerator):
        self.ev, self.tokenizer, self.mcfg, self.prec, self.acc = ev, tokenizer, mcfg, prec, \
            accelerator
        self.examples = load_examples(ev.hellaswag_path, ev.hellaswag_examples)

    def due(self, step: int, last: bool) -> bool:
        return step % self.ev.hellaswag_interval == 0 or last

    def accuracy(self, model) -> dict:
        """{"acc", "acc_norm", "examples"} of the model now, agreed by every rank."""
        net = self.acc.unwrap_model(model, keep_torch_compile=False)
        was_training = net.training
        net.eval()
        with eager():   # blocks compiled in place run eagerly: every example has its length
            total = score(net, self.examples, self.tokenizer, self.mcfg.block_size,
                          self.mcfg.vocab_size, self.acc.device, self.prec.sampling_context,
                          self.acc.process_index, self.acc.num_processes)
        net.train(was_training)
        return accuracies(self.acc.reduce(total, "sum"))


def evaluate_checkpoint(path: str, hellaswag_path: str | None, limit: int | None = None,
                        device: str = "auto", log=print, warn=print) -> dict:
    """HellaSwag accuracies of the model of `path` (a checkpoint or a run directory), encoded
    with its run's tokenizer, in its run's base precision (scripts/evaluate.py --hellaswag).
    The examples are read first: a bad file or an offline hub fails before the model loads."""
    import time

    from ..data.tokenizers import build_tokenizer
    from . import trained
    examples = load_examples(hellaswag_path, limit, option="--hellaswag PATH")
    dev = trained.pick_device(device)
    t = trained.load(path, dev, warn=warn, info=log)
    log(f"HellaSwag: {len(examples):,} examples of {source_name(hellaswag_path)}, "
        f"{t.describe()} on {dev.type}")
    t0 = time.time()
    total = score(t.model, examples, build_tokenizer(t.cfg.tokenizer), t.mcfg.block_size,
                  t.mcfg.vocab_size, dev, lambda: trained.autocast(t.cfg, dev, warn))
    acc = accuracies(total)
    return {"checkpoint": t.path, "step": t.step, "hellaswag": source_name(hellaswag_path),
            **metrics_row(acc), "acc_norm_by": NORMALISED_BY, "examples": acc["examples"],
            "seconds": round(time.time() - t0, 2)}
