"""GPT-style decoder-only transformers: the GPT-2 family (LayerNorm, GELU, learned positions)
and the Llama family (RMSNorm, SwiGLU, RoPE, grouped-query attention, no biases).

A plain nn.Module: precision (bf16/FP8), compile and distribution are applied from outside.
Given targets it returns its loss, not its logits (as nanoGPT's does), computed in
`output_loss`: the final norm, the output layer and the loss, one region that torch.compile
compiles as a graph of its own (compile.py), which fuses the fp32 log-softmax into the output
layer's kernels. Computed after the forward, the logits would be written out in fp32 (6.6 GB
for GPT-2 124M at 32 × 1024), read back by an uncompiled log-softmax and their gradient
written again; on an H200 that left fp8train at 0.86× nanoGPT's tokens/s.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .loss import lm_loss


@dataclass(frozen=True)
class ModelConfig:
    arch: str                 # "gpt2" | "llama"
    n_layer: int
    n_head: int
    n_embd: int
    ffn_hidden_size: int
    vocab_size: int           # real vocabulary; the embedding is padded (see padded_vocab_size)
    block_size: int           # context length
    n_kv_head: Optional[int] = None
    tie_embeddings: bool = True
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    dropout: float = 0.0
    pad_vocab_multiple: int = 128

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_multiple
        return (self.vocab_size + m - 1) // m * m

    def build(self) -> "GPT":
        return GPT(self)


def _llama_ffn(d: int, multiple_of: int = 256) -> int:
    """Llama's SwiGLU width: 2/3 of 4d (same parameters as a 4d GELU MLP), rounded up."""
    h = int(2 * 4 * d / 3)
    return (h + multiple_of - 1) // multiple_of * multiple_of


# Published shapes. vocab_size and block_size come from the tokenizer and seq_len at run time.
PRESETS = {
    # GPT-2 small / medium (Radford et al. 2019): 124M and 350M with tied embeddings.
    "gpt2-124m": dict(arch="gpt2", n_layer=12, n_head=12, n_embd=768, ffn_hidden_size=3072),
    "gpt2-350m": dict(arch="gpt2", n_layer=24, n_head=16, n_embd=1024, ffn_hidden_size=4096),
    # Llama-style 350M: 24 layers, 1024 wide, 16 heads of 64.
    "llama-350m": dict(arch="llama", n_layer=24, n_head=16, n_embd=1024,
                       ffn_hidden_size=_llama_ffn(1024)),
    # Llama 3.2 1B: 16 layers, 2048 wide, 32 heads, 8 KV heads, 8192 SwiGLU, tied embeddings.
    "llama-1b": dict(arch="llama", n_layer=16, n_head=32, n_kv_head=8, n_embd=2048,
                     ffn_hidden_size=8192, rope_theta=500000.0),
    # Small enough for CPU tests and the demo run.
    "tiny": dict(arch="gpt2", n_layer=4, n_head=4, n_embd=128, ffn_hidden_size=512),
    "tiny-llama": dict(arch="llama", n_layer=4, n_head=4, n_kv_head=2, n_embd=128,
                       ffn_hidden_size=384),
}


def model_config_from(preset: str, vocab_size: int, block_size: int, **overrides) -> ModelConfig:
    """The preset's shape with any non-None override applied. A changed width gets the
    family's default MLP width unless that is overridden too."""
    base = dict(PRESETS[preset])
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if "n_embd" in overrides and "ffn_hidden_size" not in overrides:
        d = overrides["n_embd"]
        base["ffn_hidden_size"] = 4 * d if base["arch"] == "gpt2" else _llama_ffn(d)
    base.update(overrides)
    mcfg = ModelConfig(vocab_size=vocab_size, block_size=block_size, **base)
    if mcfg.n_embd % mcfg.n_head:
        raise ValueError(f"n_embd {mcfg.n_embd} is not divisible by n_head {mcfg.n_head}")
    if mcfg.n_head % mcfg.kv_heads:
        raise ValueError(f"n_head {mcfg.n_head} is not divisible by n_kv_head {mcfg.kv_heads}")
    if mcfg.arch == "llama" and mcfg.head_dim % 2:
        raise ValueError(f"RoPE needs an even head dim, got {mcfg.head_dim}")
    return mcfg


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_len: int, theta: float):
        super().__init__()
        self.shape = (head_dim, max_len, theta)
        # Not persistent: recomputed at init, so checkpoints don't depend on it.
        self.register_buffer("cos", None, persistent=False)
        self.register_buffer("sin", None, persistent=False)
        self.rebuild()

    def rebuild(self, device=None) -> None:
        """Compute the tables (again): a model built on the meta device needs real ones."""
        head_dim, max_len, theta = self.shape
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32,
                                                device=device) / head_dim)
        angles = torch.outer(torch.arange(max_len, dtype=torch.float32, device=device), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)  # rotate-half layout
        self.cos, self.sin = angles.cos(), angles.sin()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, H, T, hd)
        T = x.size(-2)
        cos, sin = self.cos[:T].to(x.dtype), self.sin[:T].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, mcfg: ModelConfig):
        super().__init__()
        self.n_head, self.kv_heads, self.head_dim = mcfg.n_head, mcfg.kv_heads, mcfg.head_dim
        bias = mcfg.arch == "gpt2"
        # One fused projection for q, k and v: one large GEMM instead of three.
        self.qkv = nn.Linear(mcfg.n_embd, (mcfg.n_head + 2 * mcfg.kv_heads) * mcfg.head_dim,
                             bias=bias)
        self.proj = nn.Linear(mcfg.n_embd, mcfg.n_embd, bias=bias)
        self.rope = (RotaryEmbedding(mcfg.head_dim, mcfg.block_size, mcfg.rope_theta)
                     if mcfg.arch == "llama" else None)
        self.dropout = mcfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(
            [self.n_head * self.head_dim, self.kv_heads * self.head_dim,
             self.kv_heads * self.head_dim], dim=-1)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.rope is not None:
            q, k = self.rope(q), self.rope(k)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=self.kv_heads != self.n_head)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, mcfg: ModelConfig):
        super().__init__()
        self.swiglu = mcfg.arch == "llama"
        bias = not self.swiglu
        # SwiGLU's gate and up projections fused into one GEMM.
        width = 2 * mcfg.ffn_hidden_size if self.swiglu else mcfg.ffn_hidden_size
        self.fc = nn.Linear(mcfg.n_embd, width, bias=bias)
        self.proj = nn.Linear(mcfg.ffn_hidden_size, mcfg.n_embd, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh")  # GPT-2's GELU
        return self.proj(h)


class Block(nn.Module):
    def __init__(self, mcfg: ModelConfig):
        super().__init__()
        norm = (lambda: nn.LayerNorm(mcfg.n_embd, eps=mcfg.norm_eps)) if mcfg.arch == "gpt2" \
            else (lambda: nn.RMSNorm(mcfg.n_embd, eps=mcfg.norm_eps))
        self.norm1, self.attn = norm(), Attention(mcfg)
        self.norm2, self.mlp = norm(), MLP(mcfg)
        self.drop = nn.Dropout(mcfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x)))
        return x + self.drop(self.mlp(self.norm2(x)))


class GPT(nn.Module):
    def __init__(self, mcfg: ModelConfig):
        super().__init__()
        self.mcfg = mcfg
        V = mcfg.padded_vocab_size
        self.wte = nn.Embedding(V, mcfg.n_embd)
        self.wpe = nn.Embedding(mcfg.block_size, mcfg.n_embd) if mcfg.arch == "gpt2" else None
        self.drop = nn.Dropout(mcfg.dropout)
        self.blocks = nn.ModuleList(Block(mcfg) for _ in range(mcfg.n_layer))
        self.norm_f = (nn.LayerNorm(mcfg.n_embd, eps=mcfg.norm_eps) if mcfg.arch == "gpt2"
                       else nn.RMSNorm(mcfg.n_embd, eps=mcfg.norm_eps))
        # A tied head reuses wte.weight in forward instead of sharing a Parameter, so the
        # state dict holds no aliased tensors (safetensors refuses those).
        self.lm_head = None if mcfg.tie_embeddings else nn.Linear(mcfg.n_embd, V, bias=False)
        self.activation_checkpointing = False
        # How a block is recomputed in backward. A precision backend whose layers carry state
        # across the recompute (Transformer Engine's FP8 scales) swaps in its own.
        self.checkpoint_fn = _recompute_in_backward
        self.apply(self._init_weights)
        # GPT-2: scale the residual projections by 1/sqrt(2 * n_layer) so the residual stream's
        # variance does not grow with depth.
        for block in self.blocks:
            for p in (block.attn.proj.weight, block.mlp.proj.weight):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * mcfg.n_layer))

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None, *,
                last_only: bool = False, penalty_type: str = "none",
                penalty_weight: float = 0.0):
        """Token ids (B, T) -> logits (B, T, padded vocab); (B, 1, padded vocab) with
        last_only, which is all that generation needs. With `targets` (B, T): the loss instead,
        loss.lm_loss's (total, cross-entropy, weighted penalty)."""
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(idx.size(1), device=idx.device))
        x = self.drop(x)
        for block in self.blocks:
            if self.activation_checkpointing and self.training:
                x = self.checkpoint_fn(block, x)
            else:
                x = block(x)
        if targets is None:
            return self.logits(x[:, -1:] if last_only else x)
        return self.output_loss(x, targets, penalty_type, penalty_weight)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm and the output layer: hidden states (B, T, C) -> logits."""
        head = self.wte.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(self.norm_f(x), head)

    def output_loss(self, x: torch.Tensor, targets: torch.Tensor, penalty_type: str = "none",
                    penalty_weight: float = 0.0):
        """The final norm, the output layer and the loss, from the last block's output: one
        region for torch.compile (compile.py), where the fp32 logits never reach memory."""
        return lm_loss(self.logits(x), targets, penalty_type, penalty_weight)

    def fused_parts(self) -> dict:
        """{parameter name: row counts} of the Linears that hold several logical matrices in
        one GEMM: q, k and v (attn.qkv), and SwiGLU's gate and up (mlp.fc)."""
        out = {}
        for i, block in enumerate(self.blocks):
            a, kv = block.attn, block.attn.kv_heads * block.attn.head_dim
            out[f"blocks.{i}.attn.qkv.weight"] = [a.n_head * a.head_dim, kv, kv]
            if block.mlp.swiglu:
                out[f"blocks.{i}.mlp.fc.weight"] = [self.mcfg.ffn_hidden_size] * 2
        return out

    def num_params(self, exclude_embeddings: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.wte.weight.numel()
            if self.wpe is not None:
                n -= self.wpe.weight.numel()
        return n

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 per matmul weight (forward 2, backward 4) plus the
        attention scores and values, 12 * n_layer * n_embd * T (PaLM, appendix B). Embedding
        lookups are free; a tied head is a real matmul and counts."""
        c = self.mcfg
        matmul_params = sum(p.numel() for n, p in self.named_parameters()
                            if p.dim() == 2 and not n.startswith(("wte.", "wpe.")))
        if self.lm_head is None:
            matmul_params += self.wte.weight.numel()
        return 6.0 * matmul_params + 12.0 * c.n_layer * c.n_embd * c.block_size


@torch.no_grad()
def generate(model: nn.Module, idx: torch.Tensor, max_new_tokens: int, vocab_size: int,
             block_size: int, generator: torch.Generator, temperature: float = 0.8,
             top_k: int = 50) -> torch.Tensor:
    """Sample continuations of `idx` (B, T): top-k sampling at `temperature` (top_k 0: the whole
    vocabulary; temperature 0: greedy). Only real vocabulary ids are drawn, never the padding.
    `generator` keeps sampling off the global RNG, so that samples at eval time do not change
    the training run. No KV cache: the context is recomputed for every token, which costs little
    next to training at the lengths samples have."""
    for _ in range(max_new_tokens):
        logits = model(idx[:, -block_size:], last_only=True)[:, -1, :vocab_size].float()
        if temperature == 0:
            nxt = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, vocab_size)).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
        idx = torch.cat([idx, nxt], dim=1)
    return idx


def _recompute_in_backward(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return checkpoint(block, x, use_reentrant=False)
