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


def current_scale(amax: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """Current scaling's scale for a tensor of this amax: fp8_max / amax, as TE's
    Float8CurrentScaling computes it (compute_scale_from_amax: an amax of 0 or non-finite
    gives 1, a scale beyond float32 is clamped to its largest value). TE's recipe defaults:
    no power-of-2 rounding, no amax epsilon (te_scale has both)."""
    return te_scale(amax, fp8_max)


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


# Transformer Engine's current and block scaling (Float8CurrentScaling, Float8BlockScaling)
# compute each scale from the amax of the tensor, or of the tile, being cast. Block scaling
# tiles the 2-D view of a tensor (leading dims flattened, as TE's quantizer does): 1 x BLOCK
# along the last dim for inputs and gradients, BLOCK x BLOCK for weights.
BLOCK = 128
_FP32_MAX = torch.finfo(torch.float32).max
_EXPONENT_BITS = -8388608   # 0xFF800000 as int32: sign and exponent of a float32, no mantissa


def te_scale(amax: torch.Tensor, fp8_max: float, pow2: bool = False, epsilon: float = 0.0,
             value_for_inf: float = _FP32_MAX) -> torch.Tensor:
    """TE's compute_scale_from_amax (common/recipe/recipe_common.cuh), elementwise: an amax
    below `epsilon` is raised to it; an amax of 0, inf or NaN gives scale 1; fp8_max / amax
    beyond float32 becomes `value_for_inf`; with `pow2` the scale is rounded down to a power of
    two (its mantissa bits cleared)."""
    amax = amax.float()
    amax = torch.where(amax < epsilon, torch.full_like(amax, epsilon), amax)
    bad = (amax == 0) | ~torch.isfinite(amax)
    # A true division, rounded once (TE's __fdiv_rn): `fp8_max / tensor` is computed by torch
    # as fp8_max * (1 / tensor), which can be one ulp off.
    scale = torch.full_like(amax, fp8_max) / torch.where(bad, torch.ones_like(amax), amax)
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, value_for_inf), scale)
    if pow2:
        scale = (scale.view(torch.int32) & _EXPONENT_BITS).view(torch.float32)
    return torch.where(bad, torch.ones_like(scale), scale)


def block_amax(t: torch.Tensor, tile: tuple) -> torch.Tensor:
    """max |t| of each (rows, cols) tile of t's 2-D view [prod(leading dims), last dim], as a
    grid of tiles. Tiles at the edges may be partial (TE pads its scale grid, not the data)."""
    t2 = t.detach().reshape(-1, t.shape[-1])
    (rows, cols), (tr, tc) = t2.shape, tile
    pad_r, pad_c = -rows % tr, -cols % tc
    a = t2.abs()
    if pad_r or pad_c:   # zeros leave a maximum of absolute values as it is
        a = torch.nn.functional.pad(a, (0, pad_c, 0, pad_r))
    return a.reshape((rows + pad_r) // tr, tr, (cols + pad_c) // tc, tc).amax(dim=(1, 3)).float()


def block_scales(t: torch.Tensor, tile: tuple, fp8_max: float, pow2: bool = True,
                 epsilon: float = 0.0) -> torch.Tensor:
    """The scale TE's block scaling gives each tile of `t` (a grid, see block_amax). TE clamps
    an infinite scale at the largest value of the input's dtype, not float32's: the two differ
    only for a tile whose amax is below 1e-36, and not at all with pow2."""
    return te_scale(block_amax(t, tile), fp8_max, pow2, epsilon)


def sample_with_scales(t: torch.Tensor, scales: torch.Tensor, tile: tuple):
    """The strided sample `sample` takes of `t`, and each sampled value's own tile scale out of
    the grid `scales` (same strides for both)."""
    n, cols = t.numel(), t.shape[-1]
    stride = max(1, n // SAMPLE)
    idx = torch.arange(0, n, stride, device=t.device)[:SAMPLE]
    values = t.detach().reshape(-1)[idx]
    return values, scales[idx // cols // tile[0], idx % cols // tile[1]]


def quant_stats_blocks(t: torch.Tensor, scales: torch.Tensor, tile: tuple, dtype: torch.dtype):
    """quant_stats with each value cast with its own tile's scale (`scales`: the grid of
    block_scales), on the same strided sample."""
    values, per_value = sample_with_scales(t, scales, tile)
    return quant_stats(values, per_value, dtype)
