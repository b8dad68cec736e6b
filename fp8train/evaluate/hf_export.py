"""Our GPT as a Hugging Face transformers model: GPT2LMHeadModel for the gpt2 family,
LlamaForCausalLM for the llama family, with the tokenizer beside it.

The two layouts differ only in how tensors are cut and named:
  gpt2   HF keeps q, k, v fused (c_attn) as we do, but in Conv1D layout: weights are (in, out),
         the transpose of nn.Linear's.
  llama  HF splits q/k/v and gate/up into separate Linears; our fused qkv and fc are cut along
         the output dimension. Both use the rotate-half RoPE layout, so no permutation.
The embedding and a separate head are cut to the real vocabulary: the padding rows (never a
target, see ModelConfig.pad_vocab_multiple) would otherwise be ids the tokenizer cannot decode.
"""
from __future__ import annotations

import json
import os

import torch

from ..errors import BadInput
from ..model import ModelConfig
from ..observe.console import drop_torchao_import_noise

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Largest |our logit - transformers' logit| accepted by the check after export, relative to the
# largest |logit| (at least 1). Measured: about 1e-6 in fp32 on CPU (summation order in the
# attention and norm kernels differs).
LOGIT_TOLERANCE = 1e-4


def hf_config(mcfg: ModelConfig, bos: int | None = None, eos: int | None = None):
    """The transformers config of our model shape."""
    import transformers
    common = dict(vocab_size=mcfg.vocab_size, tie_word_embeddings=mcfg.tie_embeddings,
                  bos_token_id=bos, eos_token_id=eos, architectures=None)
    if mcfg.arch == "gpt2":
        if mcfg.kv_heads != mcfg.n_head:
            raise BadInput(f"GPT2LMHeadModel has no grouped-query attention; this model has "
                              f"n_kv_head {mcfg.kv_heads} for {mcfg.n_head} heads")
        c = transformers.GPT2Config(
            n_positions=mcfg.block_size, n_embd=mcfg.n_embd, n_layer=mcfg.n_layer,
            n_head=mcfg.n_head, n_inner=mcfg.ffn_hidden_size, activation_function="gelu_new",
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=mcfg.norm_eps,
            **common)
        c.architectures = ["GPT2LMHeadModel"]
        return c
    c = transformers.LlamaConfig(
        hidden_size=mcfg.n_embd, intermediate_size=mcfg.ffn_hidden_size,
        num_hidden_layers=mcfg.n_layer, num_attention_heads=mcfg.n_head,
        num_key_value_heads=mcfg.kv_heads, head_dim=mcfg.head_dim, hidden_act="silu",
        max_position_embeddings=mcfg.block_size, rms_norm_eps=mcfg.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": mcfg.rope_theta},
        attention_bias=False, mlp_bias=False, **common)
    c.architectures = ["LlamaForCausalLM"]
    return c


def hf_state(state: dict, mcfg: ModelConfig) -> dict:
    """Our plain state dict (trained.plain_state) renamed and cut into transformers' layout."""
    V = mcfg.vocab_size
    out = {}
    if mcfg.arch == "gpt2":
        out["transformer.wte.weight"] = state["wte.weight"][:V]
        out["transformer.wpe.weight"] = state["wpe.weight"]
        for i in range(mcfg.n_layer):
            ours, hf = f"blocks.{i}.", f"transformer.h.{i}."
            for a, b in (("norm1", "ln_1"), ("norm2", "ln_2")):
                for p in ("weight", "bias"):
                    out[f"{hf}{b}.{p}"] = state[f"{ours}{a}.{p}"]
            for a, b in (("attn.qkv", "attn.c_attn"), ("attn.proj", "attn.c_proj"),
                         ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")):
                out[f"{hf}{b}.weight"] = state[f"{ours}{a}.weight"].t().contiguous()  # Conv1D
                out[f"{hf}{b}.bias"] = state[f"{ours}{a}.bias"]
        out["transformer.ln_f.weight"] = state["norm_f.weight"]
        out["transformer.ln_f.bias"] = state["norm_f.bias"]
    else:
        q, kv = mcfg.n_head * mcfg.head_dim, mcfg.kv_heads * mcfg.head_dim
        out["model.embed_tokens.weight"] = state["wte.weight"][:V]
        for i in range(mcfg.n_layer):
            ours, hf = f"blocks.{i}.", f"model.layers.{i}."
            out[f"{hf}input_layernorm.weight"] = state[f"{ours}norm1.weight"]
            out[f"{hf}post_attention_layernorm.weight"] = state[f"{ours}norm2.weight"]
            wq, wk, wv = state[f"{ours}attn.qkv.weight"].split([q, kv, kv], dim=0)
            out[f"{hf}self_attn.q_proj.weight"] = wq
            out[f"{hf}self_attn.k_proj.weight"] = wk
            out[f"{hf}self_attn.v_proj.weight"] = wv
            out[f"{hf}self_attn.o_proj.weight"] = state[f"{ours}attn.proj.weight"]
            gate, up = state[f"{ours}mlp.fc.weight"].chunk(2, dim=0)  # see MLP.forward
            out[f"{hf}mlp.gate_proj.weight"] = gate
            out[f"{hf}mlp.up_proj.weight"] = up
            out[f"{hf}mlp.down_proj.weight"] = state[f"{ours}mlp.proj.weight"]
        out["model.norm.weight"] = state["norm_f.weight"]
    head = state["wte.weight"] if mcfg.tie_embeddings else state["lm_head.weight"]
    out["lm_head.weight"] = head[:V]
    return {k: v.contiguous() for k, v in out.items()}


def write_model(out_dir: str, mcfg: ModelConfig, state: dict, dtype: torch.dtype,
                bos: int | None = None, eos: int | None = None) -> list[str]:
    """config.json and the safetensors weights (sharded above 5 GB, with an index, as
    transformers writes them) of `state` (our layout) in `dtype`; returns the files written.
    A tied head is left out: transformers ties it to the embedding on load."""
    from huggingface_hub import save_torch_state_dict
    config = hf_config(mcfg, bos, eos)
    config.dtype = dtype
    config.save_pretrained(out_dir)
    if mcfg.arch == "llama":
        # transformers 5 reads rope_parameters; 4.x reads rope_theta and would otherwise take
        # its default base of 10000 without a word.
        path = os.path.join(out_dir, "config.json")
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        data["rope_theta"] = mcfg.rope_theta
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=2, sort_keys=True)
            fh.write("\n")
    weights = {k: _own(v.to(dtype)) for k, v in hf_state(state, mcfg).items()
               if not (mcfg.tie_embeddings and k == "lm_head.weight")}
    save_torch_state_dict(weights, out_dir, metadata={"format": "pt"})
    return sorted(f for f in os.listdir(out_dir) if f.endswith((".safetensors", ".json")))


def write_transformers_model(out_dir: str, hf, dtype: torch.dtype) -> list[str]:
    """An hf: model as transformers saves it (`save_pretrained`: its own config.json, weights
    and tied-weight handling), in `dtype`; returns the files written."""
    if dtype != torch.float32:
        import copy
        hf = copy.deepcopy(hf).to(dtype)
    import transformers
    transformers.utils.logging.disable_progress_bar()
    hf.save_pretrained(out_dir)
    return sorted(f for f in os.listdir(out_dir) if f.endswith((".safetensors", ".json")))


def byte_tokenizer():
    """UTF-8 bytes as ids 0-255 in transformers' PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # ByteLevel maps every byte to one printable character (GPT-2's table); a vocabulary of
    # exactly those 256 characters with no merges is the identity on bytes.
    alphabet = _bytes_to_unicode()
    raw = Tokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    raw.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=raw, clean_up_tokenization_spaces=False)


def _bytes_to_unicode() -> dict:
    """GPT-2's byte -> printable character table (the one ByteLevel uses)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return chars


def check_ids(mcfg: ModelConfig, batch: int = 2, seed: int = 0) -> torch.Tensor:
    """Fixed random token ids for comparing two models: up to 128 positions (RoPE and the
    learned positions both matter), cheap on a CPU even for a 1B model."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, mcfg.vocab_size, (batch, min(mcfg.block_size, 128)), generator=gen)


@torch.no_grad()
def compare_logits(ours, hf_model, mcfg: ModelConfig) -> tuple[float, float]:
    """(largest |difference|, largest |logit|) of the two models' logits over the real
    vocabulary, in fp32 on the CPU."""
    ids = check_ids(mcfg)
    a = ours(ids).float()[..., :mcfg.vocab_size]
    b = hf_model(input_ids=ids).logits.float()[..., :mcfg.vocab_size]
    return (a - b).abs().max().item(), a.abs().max().item()


def write_info(out_dir: str, info: dict) -> None:
    with open(os.path.join(out_dir, "fp8train_export.json"), "w", encoding="utf-8") as fh:
        json.dump(info, fh, indent=1)
        fh.write("\n")


def export(path: str, out_dir: str, dtype_name: str = "fp32", tokenizer: bool = True,
           overwrite: bool = False, log=print, warn=print) -> dict:
    """Export the model of `path` (a checkpoint or a run directory) to `out_dir`, load it back
    with AutoModelForCausalLM and compare its logits with ours; returns what fp8train_export.json
    records. BadInput for bad input (before anything is written), ToolFailed when the
    exported model does not reproduce ours."""
    from ..checkpoint.files import give_normal_mode
    from ..errors import ToolFailed
    from . import trained
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        raise BadInput(f"OUT_DIR '{out_dir}' exists and is not empty; pass --overwrite to "
                          f"replace what is there, or name a new directory")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise BadInput(f"OUT_DIR '{out_dir}' exists and is not a directory")
    t = trained.load(path, "cpu", warn=warn, info=log)
    log(f"model: {t.describe()}")
    mcfg, dtype = t.mcfg, DTYPES[dtype_name]
    native = isinstance(mcfg, ModelConfig)   # else an hf: model, a transformers model already
    if native:
        hf_config(mcfg)   # a shape transformers cannot hold fails here, before any file is written
    tok = _tokenizer(t.cfg.tokenizer) if tokenizer else None
    bos = getattr(tok, "bos_token_id", None)
    eos = getattr(tok, "eos_token_id", None)

    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(out_dir):   # --overwrite: no stale shard may survive
        if name.endswith(".safetensors") or name.endswith(".safetensors.index.json"):
            os.remove(os.path.join(out_dir, name))
    if native:
        state = {k: v.detach().cpu() for k, v in t.model.state_dict().items()}
        files = write_model(out_dir, mcfg, state, dtype, bos, eos)
    else:
        files = write_transformers_model(out_dir, t.model.hf, dtype)
    written = [os.path.join(out_dir, f) for f in files]
    if tok is not None:
        written += [str(f) for f in tok.save_pretrained(out_dir)]
    give_normal_mode(written)   # safetensors leaves its files 0600: a team reads the export
    log(f"wrote {out_dir}: {_architecture(t.model)} in {dtype_name}"
        + (f", tokenizer '{t.cfg.tokenizer}'" if tok is not None else ", no tokenizer files"))

    # The check a user would do: load it the standard way, compare with our forward pass.
    drop_torchao_import_noise()
    import transformers
    transformers.utils.logging.disable_progress_bar()
    hf = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    ours = _rounded(t.model, dtype)
    diff, scale = compare_logits(ours, hf, mcfg)
    tolerance = LOGIT_TOLERANCE * max(1.0, scale)
    info = dict(checkpoint=os.path.abspath(t.path), step=t.step, tokens=t.tokens,
                architecture=_architecture(t.model), dtype=dtype_name,
                tokenizer=t.cfg.tokenizer if tok is not None else None,
                trained_precision=t.derived.get("precision"), trained_fp8=t.derived.get("fp8"),
                vocab_size=mcfg.vocab_size, padded_vocab_size=mcfg.padded_vocab_size,
                logit_max_abs_diff=diff, logit_tolerance=tolerance)
    if dtype != torch.float32:
        info["logit_change_from_fp32"] = _max_diff(t.model, ours, mcfg)
    if mcfg.padded_vocab_size > mcfg.vocab_size:
        info["padding_probability_max"] = _padding_mass(t.model, mcfg)
    write_info(out_dir, info)
    if not diff <= tolerance:
        raise ToolFailed(f"the exported model does not reproduce ours: logits differ by up to "
                         f"{diff:.3g} (tolerance {tolerance:.3g}); '{out_dir}' is not usable")
    log(f"check: transformers' logits match ours to {diff:.2g} (tolerance {tolerance:.2g}, "
        f"largest logit {scale:.3g})"
        + (f"; {dtype_name} rounding moves logits by up to {info['logit_change_from_fp32']:.3g} "
           f"from the fp32 weights" if "logit_change_from_fp32" in info else ""))
    if info.get("padding_probability_max", 0) > 1e-3:
        warn(f"the model puts up to {info['padding_probability_max']:.2%} of its probability on "
             f"the {mcfg.padded_vocab_size - mcfg.vocab_size} vocabulary padding ids, which the "
             f"export drops: its probabilities differ from ours by that much")
    return info


def _own(t: torch.Tensor) -> torch.Tensor:
    """`t` in storage of its own: safetensors refuses a view of part of a larger tensor (the
    vocabulary cut, the q/k/v and gate/up splits)."""
    whole = t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return t if whole and t.storage_offset() == 0 else t.clone()


def _architecture(model) -> str:
    """The transformers class the export loads as."""
    hf = getattr(model, "hf", None)
    if hf is not None:
        return type(hf).__name__
    return "GPT2LMHeadModel" if model.mcfg.arch == "gpt2" else "LlamaForCausalLM"


def _tokenizer(name: str):
    """The run's tokenizer as a transformers tokenizer (loaded before anything is written)."""
    if name == "byte":
        return byte_tokenizer()
    from ..data.tokenizers import HFTokenizer
    try:
        return HFTokenizer(name).tok
    except BadInput as e:
        raise BadInput(f"{e}; pass --no_tokenizer to export the model alone") from None


def _rounded(model, dtype: torch.dtype):
    """`model` with its weights rounded to `dtype` (computing in fp32): what the export holds."""
    if dtype == torch.float32:
        return model
    import copy
    out = copy.deepcopy(model)
    with torch.no_grad():
        for p in out.parameters():
            p.copy_(p.to(dtype).float())
    return out


@torch.no_grad()
def _max_diff(a, b, mcfg: ModelConfig) -> float:
    ids = check_ids(mcfg)
    return (a(ids)[..., :mcfg.vocab_size] - b(ids)[..., :mcfg.vocab_size]).abs().max().item()


@torch.no_grad()
def _padding_mass(model, mcfg: ModelConfig) -> float:
    """The largest probability our model gives the padding ids together, over random tokens."""
    probs = torch.softmax(model(check_ids(mcfg)).float(), dim=-1)
    return probs[..., mcfg.vocab_size:].sum(-1).max().item()
