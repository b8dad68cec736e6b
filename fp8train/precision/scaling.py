"""FP8 numerics shared by the backends: formats, TE's delayed-scaling update, and the
saturation / underflow read-out that tells whether a scale (and so the margin) is right."""
from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}

# fp8_format -> (forward dtype for inputs and weights, backward dtype for grad_output), as in
# Transformer Engine's recipe.Format.
FORMATS = {"hybrid": (E4M3, E5M2), "e4m3": (E4M3, E4M3)}

# Statistics are computed on at most this many values of a tensor (an evenly strided sample),
# so that reading them costs the same for a 124M and a 1B model.
SAMPLE = 1 << 16


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x * scale in `dtype`, saturating at the format's largest value (as TE's cast does)
    instead of overflowing to NaN."""
    fmax = FP8_MAX[dtype]
    return (x.float() * scale).clamp_(-fmax, fmax).to(dtype)


def update_delayed_scaling(amax_history: torch.Tensor, scale: torch.Tensor,
                           fp8_max: torch.Tensor, margin: int, algo: str) -> None:
    """Transformer Engine's DelayedScaling update, in place, for any number of tensors.

    amax_history: [history_len, ...]; row 0 holds the amax of the step just done.
    scale: [...]; fp8_max: [...] (the format's largest value for each tensor).

    The scale for the next step comes from the window of the last history_len amaxes ("max")
    or from the latest one ("most_recent"): scale = fp8_max / amax / 2^margin. An amax of 0,
    inf or NaN keeps the old scale. Then the window moves: row 0 is cleared for the next step
    and the oldest value drops out (TE rolls the history by -1 and zeroes row 0)."""
    amax = amax_history.amax(dim=0) if algo == "max" else amax_history[0]
    new = fp8_max / amax / (2.0 ** margin)
    keep = ~((amax > 0) & torch.isfinite(amax) & torch.isfinite(new))
    scale.copy_(torch.where(keep, scale, new))
    amax_history.copy_(amax_history.roll(-1, dims=0))
    amax_history[0].zero_()


def sample(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1)
    stride = max(1, flat.numel() // SAMPLE)
    return flat[::stride][:SAMPLE]


def quant_stats(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
    """(fraction saturated, fraction underflowing) when `t` is cast to `dtype` with `scale`,
    measured on a strided sample. Saturated: |t * scale| above the format's maximum (clipped).
    Underflow: a non-zero value that becomes 0 in FP8. Both are device tensors: no host sync."""
    s = sample(t).float()
    scaled = s * scale
    # The tolerance ignores float32 rounding of a dynamic scale (fp8_max / amax) * amax.
    saturated = (scaled.abs() > FP8_MAX[dtype] * (1 + 2.0 ** -20)).float().mean()
    q = quantize(s, scale, dtype).float()
    underflow = ((q == 0) & (s != 0)).float().mean()
    return saturated, underflow
