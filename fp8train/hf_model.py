"""Any transformers causal LM, trained as fp8train trains its own GPT: `model: hf:<hub id or
directory>`.

`HFCausalLM` holds the transformers model (`.hf`, saved with `save_pretrained` as is) and gives
it the interface the rest of fp8train uses on GPT (model.py), so that precision, compile,
activation checkpointing, FSDP, the batch probe, Muon, MFU and the checkpoints apply to it
unchanged:
  forward        the transformers backbone (embeddings, decoder layers, final norm; its own
                 attention implementation, SDPA) gives the hidden states; with targets, the
                 loss comes from them through `output_loss`, else the logits
  output_loss    the output layer and the loss, chunked over the tokens (loss.chunked_lm_loss):
                 at a 128K-152K vocabulary (Llama 3, Qwen) the fp32 logits of a whole
                 micro-batch would be several GB; one compiled region, as GPT's is
  blocks         the decoder layers (the class in the model's `_no_split_modules`): compiled one
                 by one, checkpointed one by one, one FSDP unit each
  checkpoint_fn  how a decoder layer is recomputed in backward (Transformer Engine swaps its own)
The module names stay transformers' (`hf.model.layers.0.self_attn.q_proj`), so `fp8_exclude`
patterns and the FP8 metrics name the layers as the model card does.

The model's shape, vocabulary and dropout are its config.json's: the preset keys are refused
with it (config/requires.py). Its weights start fresh (`init_from: scratch`, the model's own
init) or from its saved weights (`init_from: pretrained`).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import types
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from .config.schema import HF_PREFIX
from .errors import BadInput, one_line
from .hub import load_pretrained
from .loss import chunked_lm_loss, lm_loss
from .model import model_config_from
from .observe.console import drop_transformers_noise


@dataclass(frozen=True)
class HFModelConfig:
    """What fp8train needs to know of an hf: model, read from its config.json; the same names
    as model.ModelConfig where the meaning is the same."""
    source: str               # hub id or directory
    init_from: str            # scratch | pretrained
    arch: str                 # transformers' model_type ("llama", "qwen3", "gemma", ...)
    n_layer: int
    n_head: int
    n_kv_head: int
    n_embd: int               # hidden_size
    head_dim: int
    vocab_size: int           # the data's token ids (the tokenizer's), as GPT's
    padded_vocab_size: int    # the model's embedding rows: its vocabulary, often larger
    block_size: int           # the run's seq_len
    tie_embeddings: bool
    hf_config: dict = field(repr=False)   # its config.json as read (plain values: the batch
                                          # probe's cache key holds it)

    def transformers_config(self):
        """A fresh transformers config object of `hf_config` (transformers mutates the one
        a model is built from)."""
        import transformers
        d = dict(self.hf_config)
        return transformers.AutoConfig.for_model(d.pop("model_type"), **d)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head

    def build(self) -> "HFCausalLM":
        return HFCausalLM(self)


def model_config(cfg, vocab_size: int, what: str = "", saved: Optional[dict] = None):
    """The model a config names: a preset's ModelConfig at the data's vocabulary, or an hf:
    model's HFModelConfig, whose vocabulary must hold the data's ids. BadInput in one line
    naming the key. `cfg`: the run's config (or a checkpoint's); `what`: where it came from;
    `saved`: the derived values of the run's checkpoint, whose hf_config is the model's
    config.json as the run first read it (the source is not read again)."""
    where = what or cfg.where("model")
    if cfg.model.startswith(HF_PREFIX):
        mcfg = hf_model_config(cfg.model[len(HF_PREFIX):], cfg.init_from, cfg.seq_len, where,
                               vocab_size, (saved or {}).get("hf_config"))
        if vocab_size > mcfg.padded_vocab_size:
            raise BadInput(f"{where}: model '{cfg.model}' has {mcfg.padded_vocab_size:,} token "
                           f"ids, but the data's tokenizer '{cfg.tokenizer}' has {vocab_size:,}: prepare "
                           f"the data with the model's own tokenizer (tokenizer: model)")
        return mcfg
    try:
        return model_config_from(
            cfg.model, vocab_size, cfg.seq_len, n_layer=cfg.n_layer, n_head=cfg.n_head,
            n_kv_head=cfg.n_kv_head, n_embd=cfg.n_embd, ffn_hidden_size=cfg.ffn_hidden_size,
            dropout=cfg.dropout, pad_vocab_multiple=cfg.pad_vocab_multiple)
    except (KeyError, ValueError) as e:
        where = what or cfg.where("model", "n_layer", "n_head", "n_kv_head", "n_embd",
                                  "ffn_hidden_size")
        raise BadInput(f"{where}: model '{cfg.model}': {e}") from None


def hf_model_config(source: str, init_from: str, block_size: int, where: str = "key 'model'",
                    vocab_size: Optional[int] = None, saved: Optional[dict] = None
                    ) -> HFModelConfig:
    """The model's config.json (a directory, the local HuggingFace cache, or the hub when it can
    be reached; `saved`: as a run recorded it, so that its checkpoints need neither), checked
    that fp8train can train it at `block_size`. `vocab_size`: the data's token ids (default:
    the model's whole vocabulary)."""
    drop_transformers_noise()
    import transformers
    name = f"model 'hf:{source}'"
    if saved is not None:
        d = dict(saved)
        hfc = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
    else:
        hfc = load_pretrained(transformers.AutoConfig, source, f"{where}: {name}",
                              "model config")
    model_type = getattr(hfc, "model_type", "?")
    if type(hfc) not in transformers.MODEL_FOR_CAUSAL_LM_MAPPING:
        raise BadInput(f"{where}: {name} is a {model_type} model, which transformers has no "
                       f"causal LM class for (AutoModelForCausalLM)")
    text = hfc.get_text_config() if hasattr(hfc, "get_text_config") else hfc
    if text is not hfc:   # Gemma 3 and the like: a vision tower beside the language model
        raise BadInput(f"{where}: {name} is a multimodal {model_type} model; fp8train trains "
                       f"language models: name its text-only model or config "
                       f"({type(text).__name__})")
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if getattr(text, key, None):
            raise BadInput(f"{where}: {name} is a mixture-of-experts model ({key} "
                           f"{getattr(text, key)}), which fp8train does not train: its experts "
                           f"are not nn.Linear layers and its router loss would be dropped")
    longest = getattr(text, "max_position_embeddings", None)
    if isinstance(longest, int) and block_size > longest:
        raise BadInput(f"{where}: seq_len {block_size:,} is longer than {name} was built for "
                       f"(max_position_embeddings {longest:,})")
    n_head = getattr(text, "num_attention_heads", None) or getattr(text, "n_head", 0)
    n_embd = getattr(text, "hidden_size", None) or getattr(text, "n_embd", 0)
    head_dim = getattr(text, "head_dim", None) or (n_embd // n_head if n_head else 0)
    return HFModelConfig(
        source=source, init_from=init_from, arch=model_type,
        n_layer=getattr(text, "num_hidden_layers", None) or getattr(text, "n_layer", 0),
        n_head=n_head, n_kv_head=getattr(text, "num_key_value_heads", None) or n_head,
        n_embd=n_embd, head_dim=head_dim, vocab_size=min(vocab_size or text.vocab_size,
                                                         text.vocab_size),
        padded_vocab_size=text.vocab_size, block_size=block_size,
        tie_embeddings=bool(getattr(hfc, "tie_word_embeddings", False)),
        hf_config=json.loads(hfc.to_json_string(use_diff=False)))


def _transformers_model(auto, mcfg: HFModelConfig):
    """(the transformers model, its attention implementation): SDPA (flash attention's kernels
    on a GPU) where the model supports it, else transformers' plain one, "eager" (Gemma 2's
    capped attention scores). Which one is decided on the meta device (nothing allocated, no
    file read); then the model is built, or its weights loaded, once."""
    attention, why = None, None
    for candidate in ("sdpa", "eager"):
        try:
            with torch.device("meta"):
                auto.from_config(mcfg.transformers_config(), attn_implementation=candidate)
            attention = candidate
            break
        except (ValueError, ImportError) as e:   # an attention or class it cannot build
            why = e
    if attention is None:
        raise BadInput(f"model 'hf:{mcfg.source}': transformers cannot build it "
                       f"({one_line(why, 200, first_line=True)})") from None
    kw = dict(dtype=torch.float32, attn_implementation=attention)
    if mcfg.init_from == "pretrained" and torch.get_default_device().type != "meta":
        return load_pretrained(auto, mcfg.source, f"model 'hf:{mcfg.source}'", "model weights",
                               config=mcfg.transformers_config(), **kw), attention
    return auto.from_config(mcfg.transformers_config(), **kw), attention   # fresh weights


class _Recompute:
    """The decoder layers' activation checkpointing, shared by all of them: whether it is on,
    and the function that recomputes a layer in backward. A plain object, not a module, so
    that the layers refer to it without becoming the model's children twice."""
    def __init__(self):
        self.on = False
        self.fn = _recompute_in_backward


class HFCausalLM(nn.Module):
    def __init__(self, mcfg: HFModelConfig):
        super().__init__()
        import transformers
        self.mcfg = mcfg
        transformers.utils.logging.disable_progress_bar()   # no bar per load in the run's log
        self.hf, self.attention = _transformers_model(transformers.AutoModelForCausalLM, mcfg)
        self.hf.train()
        self._recompute = _Recompute()
        self._compiled_body = None
        for layer in self.blocks:   # each layer reads the shared setting (a deep copy: its own)
            layer.fp8train_recompute = self._recompute
            layer.fp8train_body = None   # compile_block's compiled forward
            layer.forward = types.MethodType(_layer_forward, layer)
        if len(self.blocks) != mcfg.n_layer:
            raise BadInput(f"model 'hf:{mcfg.source}': fp8train cannot find its {mcfg.n_layer} "
                           f"decoder layers (found a list of {len(self.blocks)})")
        # Accelerate's FSDP wraps these classes one unit each, as it does for the model itself.
        self._no_split_modules = sorted({type(b).__name__ for b in self.blocks})
        cap = getattr(self._text_config, "final_logit_softcapping", None)
        self.softcap = float(cap) if cap else None

    @property
    def _text_config(self):
        c = self.hf.config
        return c.get_text_config() if hasattr(c, "get_text_config") else c

    @property
    def blocks(self) -> nn.ModuleList:
        """The decoder layers: the module list of the classes in `_no_split_modules` (the unit
        transformers itself keeps whole on one device), else the backbone's longest list."""
        names = set(getattr(self.hf, "_no_split_modules", None) or ())
        lists = [m for m in self.hf.base_model.modules() if isinstance(m, nn.ModuleList) and len(m)]
        for m in lists:
            if type(m[0]).__name__ in names or any(c.__name__ in names for c in type(m[0]).__mro__):
                return m
        return max(lists, key=len) if lists else nn.ModuleList()

    # Activation checkpointing, as GPT has it: a flag and the recompute function.
    @property
    def activation_checkpointing(self) -> bool:
        return self._recompute.on

    @activation_checkpointing.setter
    def activation_checkpointing(self, on: bool) -> None:
        self._recompute.on = bool(on)

    @property
    def checkpoint_fn(self):
        return self._recompute.fn

    @checkpoint_fn.setter
    def checkpoint_fn(self, fn) -> None:
        self._recompute.fn = fn

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None, *,
                last_only: bool = False, penalty_type: str = "none",
                penalty_weight: float = 0.0):
        """As GPT.forward: token ids (B, T) -> logits (B, T, vocab), or (B, 1, vocab) with
        last_only; with `targets`, loss.lm_loss's (total, cross-entropy, weighted penalty)."""
        x = self.hf.base_model(input_ids=idx, use_cache=False).last_hidden_state
        if targets is None:
            return self.logits(x[:, -1:] if last_only else x)
        return self.output_loss(x, targets, penalty_type, penalty_weight)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The output layer (and the model's logit soft-capping): hidden states -> logits."""
        logits = self.hf.get_output_embeddings()(x)
        if self.softcap:
            logits = self.softcap * torch.tanh(logits / self.softcap)
        return logits

    def output_loss(self, x: torch.Tensor, targets: torch.Tensor, penalty_type: str = "none",
                    penalty_weight: float = 0.0):
        """The output layer and the loss from the backbone's (normed) hidden states, a chunk
        of tokens at a time: no micro-batch's worth of fp32 logits in memory."""
        head = self.hf.get_output_embeddings()
        if type(head) is not nn.Linear or head.bias is not None:
            # converted to FP8 (fp8_exclude without lm_head), or with a bias: the layer itself
            return lm_loss(self.logits(x), targets, penalty_type, penalty_weight)
        return chunked_lm_loss(x, head.weight, targets, penalty_type, penalty_weight,
                               softcap=self.softcap)

    def compile_block(self, block: nn.Module, mode) -> None:
        """torch.compile one decoder layer (compile.py, per block): its forward, inside the
        activation checkpointing. One compiled function for every layer: dynamo traces the
        first and its graph serves the others."""
        if self._compiled_body is None:
            self._compiled_body = torch.compile(type(block).forward, mode=mode)
        block.fp8train_body = self._compiled_body

    @property
    def layer_kinds(self) -> list:
        """The kinds of decoder layer (transformers' `layer_types`: sliding or full attention)
        that the model alternates: per-block compile traces a graph for each."""
        return sorted(set(getattr(self._text_config, "layer_types", None) or ()))

    def ties_kept(self) -> bool:
        """Whether a tied output layer is still the embedding (a precision that converted it
        into a layer of its own would have cut the tie)."""
        if not self.mcfg.tie_embeddings:
            return True
        return self.hf.get_output_embeddings().weight is self.hf.get_input_embeddings().weight

    def fused_parts(self) -> dict:
        """transformers' Llama-like models keep q, k, v and gate, up as separate Linears: there
        is nothing for Muon to split."""
        return {}

    def _embeddings(self) -> list:
        """The lookup tables: the input embedding, and learned positions where the model has
        them (by the names transformers gives them)."""
        out = [self.hf.get_input_embeddings().weight]
        for name in ("wpe", "embed_positions"):
            m = getattr(self.hf.base_model, name, None)
            if isinstance(m, nn.Embedding):
                out.append(m.weight)
        return out

    def num_params(self, exclude_embeddings: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= sum(p.numel() for p in self._embeddings())
        return n

    def flops_per_token(self) -> float:
        """As GPT.flops_per_token: 6 per matmul weight (the output layer too, tied or not) plus
        the attention scores and values, 12 * layers * (heads * head_dim) * T. A sliding window
        does less attention work than this counts."""
        lookups = {id(p) for p in self._embeddings()}
        head = self.hf.get_output_embeddings().weight
        matmul = sum(p.numel() for p in self.parameters() if p.dim() == 2 and id(p) not in lookups)
        if id(head) in lookups:   # tied: the lookup table is also the output layer
            matmul += head.numel()
        c = self.mcfg
        return 6.0 * matmul + 12.0 * c.n_layer * c.n_head * c.head_dim * c.block_size

    def not_linear(self) -> list:
        """Names of the modules inside the decoder layers that hold a weight matrix but are not
        nn.Linear (GPT-2's Conv1D): no FP8 backend converts them."""
        out = []
        for i, block in enumerate(self.blocks):
            for name, m in block.named_modules():
                w = getattr(m, "weight", None)
                if isinstance(w, torch.Tensor) and w.dim() == 2 and \
                        not isinstance(m, (nn.Linear, nn.Embedding)):
                    out.append(f"{i}.{name} ({type(m).__name__})")
        return out

    @torch.no_grad()
    def check_logits(self, tolerance: float = 1e-4) -> float:
        """The largest difference between our logits and the transformers model's own on a few
        tokens; BadInput when they differ (a head this adapter does not reproduce)."""
        was = self.training
        self.eval()
        ids = torch.arange(8, device=self.hf.device).remainder(self.mcfg.vocab_size)[None]
        ours, theirs = self(ids).float(), self.hf(input_ids=ids, use_cache=False).logits.float()
        self.train(was)
        diff = (ours - theirs).abs().max().item()
        if not diff <= tolerance * max(1.0, theirs.abs().max().item()):
            raise BadInput(f"model 'hf:{self.mcfg.source}': its output layer does more than "
                           f"fp8train reproduces (logits differ by {diff:.3g}); this "
                           f"{self.mcfg.arch} model cannot be trained here")
        return diff


def _layer_forward(layer: nn.Module, *args, **kwargs):
    """A decoder layer's forward (its compiled body under compile), recomputed in backward when
    activation checkpointing is on: around `forward`, as transformers' own checkpointing does,
    so that FSDP's hooks stay outside the recompute, and outside the compiled body, as GPT's
    blocks are (Transformer Engine's checkpoint disables dynamo inside it). The hidden states
    go in positionally: the recompute function takes the tensors it saves that way."""
    forward = functools.partial(layer.fp8train_body or type(layer).forward, layer)
    recompute = layer.fp8train_recompute
    if not (recompute.on and layer.training and torch.is_grad_enabled()):
        return forward(*args, **kwargs)
    if not args:
        args = (kwargs.pop("hidden_states"),)
    return recompute.fn(functools.partial(forward, **kwargs), *args)


def _recompute_in_backward(fn, *args):
    return checkpoint(fn, *args, use_reentrant=False)


def fresh_weights(mcfg):
    """The model `mcfg` describes, with fresh weights: what the batch probe times and what a
    checkpoint's weights are loaded into (an hf: model's own saved weights would be read for
    nothing)."""
    return dataclasses.replace(mcfg, init_from="scratch") if isinstance(mcfg, HFModelConfig) \
        else mcfg
