"""Training loss: cross-entropy plus an optional penalty on the logits.

Penalties (scaled by penalty_weight, default 0):
  z_loss    mean over tokens of logsumexp(logits)^2 (PaLM, Chowdhery et al. 2022): keeps the
            softmax normaliser near 1, which stabilises bf16/FP8 training of the output layer.
  logit_l2  mean over tokens and vocabulary of logits^2: a plain magnitude penalty that keeps
            every logit small, not just the normaliser.

chunked_lm_loss is the same loss from the hidden states and the output layer's weight, a chunk
of tokens at a time: at Llama 3's or Qwen's vocabulary (128K-152K) the fp32 logits of a whole
micro-batch would outweigh the rest of the activations.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, penalty_type: str = "none",
            penalty_weight: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (total, cross_entropy, weighted penalty), all scalars. Computed in fp32: the
    log-softmax over a 50k vocabulary loses too much in bf16."""
    logits = logits.float()
    ce = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
    if penalty_type == "none" or penalty_weight == 0.0:
        return ce, ce, torch.zeros((), device=ce.device)
    if penalty_type == "z_loss":
        penalty = torch.logsumexp(logits, dim=-1).pow(2).mean()
    elif penalty_type == "logit_l2":
        penalty = logits.pow(2).mean()
    else:
        raise ValueError(f"unknown penalty_type {penalty_type!r}")
    weighted = penalty_weight * penalty
    return ce + weighted, ce, weighted


# F.cross_entropy's default: targets equal to it count neither in the sum nor in the mean.
IGNORE_INDEX = -100
# A chunk's fp32 logits hold about this many elements (256 MiB) by default: small beside the
# whole micro-batch's (8 x 2048 tokens x 128K vocabulary is 8 GiB in fp32), large enough that
# each chunk's GEMM still fills the machine.
CHUNK_LOGITS = 2 ** 26
# The torch.library namespace of this module's two operators (torch names an operator
# "namespace::name"; the package's name keeps them apart from any other library's).
OPS = "fp8train"


def default_chunk_tokens(vocab_size: int) -> int:
    """Rows per chunk for chunked_lm_loss: CHUNK_LOGITS // vocab_size, rounded down to a
    multiple of 64 when that leaves any (a GEMM tile multiple: 512 rows at 128256, 384 at
    152064), at least 1."""
    rows = max(1, CHUNK_LOGITS // vocab_size)
    return rows // 64 * 64 if rows >= 64 else rows


def chunked_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                    penalty_type: str = "none", penalty_weight: float = 0.0, *,
                    softcap: Optional[float] = None, chunk_tokens: Optional[int] = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """lm_loss(F.linear(hidden, weight), targets, ...) without the whole micro-batch's logits:
    the same (total, cross_entropy, weighted penalty), values and gradients (to hidden and
    weight), to fp32 rounding.

    hidden (B, T, C) are the final (normed) hidden states, weight (V, C) the output layer's,
    targets (B, T), IGNORE_INDEX where a token is not scored. softcap: logits become
    softcap * tanh(logits / softcap) first (Gemma 2's final_logit_softcapping). The GEMMs run
    in hidden's dtype, autocast's when autocast is on (as F.linear would), the rest in fp32.
    Not twice differentiable.

    The tokens go in chunks of chunk_tokens rows (default_chunk_tokens(V) when None): the
    forward keeps each chunk's sums and drops its logits, the backward computes them again,
    one more GEMM per chunk, and adds each chunk's weight gradient into one buffer. One chunk's
    logits are alive at a time. The chunk count comes from the shapes alone.

    Why two custom operators (_loss_sums, _loss_grads) and not torch.utils.checkpoint around
    each chunk: torch.compile sees through a checkpoint, and inductor (measured on a CPU) then
    fused the chunks' recomputations into one kernel, every chunk's logits alive at once; made
    separate subgraphs (torch.compiler.nested_compile_region), the chunks kept their weight
    gradients, each the size of the weight, until one final sum. An operator is opaque to the
    compiler: it runs its loop as written, eagerly or compiled."""
    if penalty_type == "none" or penalty_weight == 0.0:
        penalty_type = "none"
    elif penalty_type not in ("z_loss", "logit_l2"):
        raise ValueError(f"unknown penalty_type {penalty_type!r}")
    vocab, width = weight.shape
    rows = default_chunk_tokens(vocab) if chunk_tokens is None else int(chunk_tokens)
    if rows < 1:
        raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
    device = hidden.device.type
    # The operators run outside autocast: cast as F.linear under it would (bf16 copies of
    # fp32 master weights), so that the gradients flow back through the same casts.
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    flat_h = hidden.reshape(-1, width)
    flat_y = targets.reshape(-1)
    ce_sum, penalty_sum = _loss_sums(flat_h, weight, flat_y, penalty_type,
                                     None if softcap is None else float(softcap), rows)
    # lm_loss's denominators: the cross-entropy is a mean over the scored tokens (0/0, NaN,
    # when none is, as F.cross_entropy's), z_loss a mean over all tokens, logit_l2 over all
    # tokens and the vocabulary.
    ce = ce_sum / (flat_y != IGNORE_INDEX).sum()
    if penalty_type == "none":
        return ce, ce, torch.zeros((), device=ce.device)
    per = flat_h.shape[0] if penalty_type == "z_loss" else flat_h.shape[0] * vocab
    weighted = penalty_weight * (penalty_sum / per)
    return ce + weighted, ce, weighted


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, softcap: Optional[float]
                  ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """One chunk's fp32 logits, softcapped, and tanh(raw / softcap), which the softcap's
    derivative needs (None without one). The GEMM in the inputs' dtype, the rest in fp32, in
    place where the buffer is ours."""
    logits = F.linear(hidden, weight).float()
    if softcap is None:
        return logits, None
    tanh = logits.div_(softcap).tanh_()
    return tanh * softcap, tanh


def _scored_targets(targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(whether each token is scored, its target with 0 where not): gather and scatter need a
    valid index, the mask then removes the ignored rows, with no host sync."""
    scored = targets != IGNORE_INDEX
    return scored, torch.where(scored, targets, 0).unsqueeze(1)


@torch.library.custom_op(f"{OPS}::chunked_lm_loss_sums", mutates_args=())
def _loss_sums(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
               penalty_type: str, softcap: Optional[float], rows: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed cross-entropy over the scored tokens, summed penalty), chunk by chunk; hidden
    (N, C), targets (N,)."""
    ce_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
    penalty_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
    with torch.autocast(hidden.device.type, enabled=False):
        for h, y in zip(hidden.split(rows), targets.split(rows)):
            logits, _ = _chunk_logits(h, weight, softcap)
            scored, index = _scored_targets(y)
            picked = logits.gather(1, index).squeeze(1)
            if penalty_type == "logit_l2":
                penalty_sum += logits.pow(2).sum()
            # logsumexp in place, so that a chunk needs one buffer of logits
            top = logits.amax(dim=-1, keepdim=True)
            lse = (logits.sub_(top).exp_().sum(dim=-1, keepdim=True).log_() + top).squeeze(1)
            ce_sum += torch.where(scored, lse - picked, 0.0).sum()
            if penalty_type == "z_loss":
                penalty_sum += lse.pow(2).sum()
            del logits          # before the next chunk's are made, not after
    return ce_sum, penalty_sum


@_loss_sums.register_fake
def _(hidden, weight, targets, penalty_type, softcap, rows):
    return (hidden.new_empty((), dtype=torch.float32),
            hidden.new_empty((), dtype=torch.float32))


@torch.library.custom_op(f"{OPS}::chunked_lm_loss_grads", mutates_args=())
def _loss_grads(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                grad_ce: torch.Tensor, grad_penalty: torch.Tensor, penalty_type: str,
                softcap: Optional[float], rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of grad_ce * ce_sum + grad_penalty * penalty_sum to hidden and weight,
    the logits recomputed a chunk at a time. Per logit x, with p the softmax and lse the
    logsumexp of its row: the scored cross-entropy gives grad_ce * (p - onehot(target)), z_loss
    grad_penalty * 2 * lse * p, logit_l2 grad_penalty * 2 * x; a softcap multiplies by
    1 - tanh^2. The weight's gradient is accumulated in fp32 whatever the weight's dtype: a
    bf16 sum over tens of chunks would round at every one."""
    grad_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    with torch.autocast(hidden.device.type, enabled=False):
        for h, y, gh in zip(hidden.split(rows), targets.split(rows), grad_hidden.split(rows)):
            logits, tanh = _chunk_logits(h, weight, softcap)
            scored, index = _scored_targets(y)
            l2 = logits * (2 * grad_penalty) if penalty_type == "logit_l2" else None
            top = logits.amax(dim=-1, keepdim=True)
            grad = logits.sub_(top).exp_()                    # softmax, in the logits' buffer
            total = grad.sum(dim=-1, keepdim=True)
            grad.div_(total)
            per_row = grad_ce * scored                         # (rows,)
            if penalty_type == "z_loss":
                per_row = per_row + 2 * grad_penalty * (total.log() + top).squeeze(1)
            grad.mul_(per_row.unsqueeze(1))
            grad.scatter_add_(1, index, -(grad_ce * scored).unsqueeze(1))
            if l2 is not None:
                grad.add_(l2)
                del l2
            if tanh is not None:
                grad.mul_(tanh.mul_(tanh).neg_().add_(1))
                del tanh
            grad = grad.to(hidden.dtype)
            torch.mm(grad, weight, out=gh)
            if grad.dtype == torch.float32:
                grad_weight.addmm_(grad.t(), h)
            else:
                grad_weight.add_(grad.t() @ h)
            del logits, grad
    return grad_hidden, grad_weight.to(weight.dtype)


@_loss_grads.register_fake
def _(hidden, weight, targets, grad_ce, grad_penalty, penalty_type, softcap, rows):
    return (torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device),
            torch.empty(weight.shape, dtype=weight.dtype, device=weight.device))


def _save_inputs(ctx, inputs, output) -> None:
    hidden, weight, targets, penalty_type, softcap, rows = inputs
    ctx.save_for_backward(hidden, weight, targets)
    ctx.options = (penalty_type, softcap, rows)


def _loss_sums_backward(ctx, grad_ce, grad_penalty):
    hidden, weight, targets = ctx.saved_tensors
    zero = torch.zeros((), dtype=torch.float32, device=hidden.device)
    grad_hidden, grad_weight = _loss_grads(
        hidden, weight, targets, zero if grad_ce is None else grad_ce,
        zero if grad_penalty is None else grad_penalty, *ctx.options)
    return grad_hidden, grad_weight, None, None, None, None


_loss_sums.register_autograd(_loss_sums_backward, setup_context=_save_inputs)
