"""A few generated texts at each evaluation: a loss curve says how much a model learned, a
sample says what. The logger writes them to <output_dir>/samples.jsonl and a W&B table."""
from __future__ import annotations

import torch

from ..compile import eager
from ..data.tokenizers import build_tokenizer
from ..errors import BadInput
from ..model import generate


class TextSampler:
    """Continues the first tokens of fixed validation sequences with its own seeded generator
    (the training RNG is untouched, so a run with samples trains exactly like one without).
    Every rank generates the same samples, because under FSDP each forward is a collective;
    the main process decodes and writes them."""

    def __init__(self, ev, tokenizer: str, seed: int, mcfg, prec, accelerator, warn):
        """`ev`: the config's eval section (eval_samples, sample_tokens)."""
        self.ev, self.seed, self.mcfg, self.prec, self.acc = ev, seed, mcfg, prec, accelerator
        self.prompt_tokens = max(1, min(32, mcfg.block_size // 2))
        self.tokenizer = None
        if accelerator.is_main_process:
            try:
                self.tokenizer = build_tokenizer(tokenizer)
            except BadInput as e:
                warn(f"no text samples: {e}")

    def take(self, model, eval_set, step: int) -> list[dict]:
        prompts = torch.cat([x for x, _ in eval_set])[:self.ev.samples, :self.prompt_tokens]
        device = self.acc.device
        gen = torch.Generator(device=device).manual_seed(self.seed)
        # No DDP hooks, no torch.compile recompiling for every length (FSDP stays FSDP; blocks
        # compiled in place run eagerly).
        net = self.acc.unwrap_model(model, keep_torch_compile=False)
        was_training = net.training
        net.eval()
        with torch.no_grad(), self.prec.sampling_context(), eager():
            out = generate(net, prompts.to(device), self.ev.sample_tokens, self.mcfg.vocab_size,
                           self.mcfg.block_size, gen)
        net.train(was_training)
        if self.tokenizer is None:  # not the main process, or no tokenizer to decode with
            return []
        return [{"step": step, "prompt": self.tokenizer.decode(p.tolist()),
                 "sample": self.tokenizer.decode(o[self.prompt_tokens:].tolist())}
                for p, o in zip(prompts, out.cpu())]


def sample_text(path: str, prompt: str, num_samples: int = 1, max_new_tokens: int = 200,
                temperature: float = 0.8, top_k: int = 50, seed: int = 1337,
                device: str = "auto", log=print, warn=print) -> list[str]:
    """Continuations of `prompt` by the model of `path` (a checkpoint or a run directory),
    decoded with the run's tokenizer. On a GPU in the run's base precision (bf16), else fp32;
    FP8-trained models sample from their high-precision weights, as at eval time."""
    from . import trained
    dev = trained.pick_device(device)
    t = trained.load(path, dev, warn=warn, info=log)
    tok = build_tokenizer(t.cfg.tokenizer)
    ids = [int(i) for i in tok.encode(prompt)] if prompt else []
    if not ids:   # nothing to continue: start from the end-of-text token, else a newline
        eos = getattr(getattr(tok, "tok", None), "eos_token_id", None)
        ids = [eos] if eos is not None else [int(i) for i in tok.encode("\n")]
    if max(ids) >= t.mcfg.vocab_size:
        raise BadInput(f"the prompt has token ids up to {max(ids)}; the model knows "
                          f"{t.mcfg.vocab_size:,}")
    if len(ids) > t.mcfg.block_size:
        warn(f"the prompt is {len(ids):,} tokens; the model sees its last {t.mcfg.block_size:,}")
    log(f"sampling {t.describe()}: {num_samples} × {max_new_tokens} tokens, temperature "
        f"{temperature:g}, top_k {top_k or 'off'}, on {dev.type}")
    gen = torch.Generator(device=dev).manual_seed(seed)
    start = torch.tensor([ids] * num_samples, device=dev)
    with trained.autocast(t.cfg, dev, warn):
        out = generate(t.model, start, max_new_tokens, t.mcfg.vocab_size, t.mcfg.block_size,
                       gen, temperature, top_k)
    return [tok.decode(row[len(ids):].tolist()) for row in out.cpu()]
