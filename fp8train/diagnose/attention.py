"""Attention: do SDPA's flash, memory-efficient and cuDNN kernels run on this device in bf16,
forward and backward, and agree with fp32 math attention."""
from __future__ import annotations

import warnings

from ..errors import one_line
from .checks import CheckFailed, run_check

ATTENTION = (("flash", "FLASH_ATTENTION"), ("efficient", "EFFICIENT_ATTENTION"),
             ("cudnn", "CUDNN_ATTENTION"))
ATTN_TOL = 0.02   # bf16 flash/efficient/cuDNN against fp32 math attention (bf16 rounding: ~0.4%)


def check_attention(device) -> dict:
    """Each SDPA kernel, forced with sdpa_kernel, in bf16, forward and backward."""
    import torch
    from torch.nn.attention import SDPBackend
    out = {}
    for key, member in ATTENTION:
        backend = getattr(SDPBackend, member, None)
        if backend is None:
            out[key] = {"ok": False, "missing": True,
                        "error": f"torch {torch.__version__} has no SDPBackend.{member}"}
        else:
            out[key] = run_check(sdpa_once, device, backend)
    return out


def sdpa_once(device, backend) -> dict:
    """One causal attention forward + backward with only `backend` allowed; its relative error
    against fp32 math attention."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ..precision import rel_error   # the trainer's own (inf when not finite)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 8, 512, 64, generator=gen).to(device, torch.bfloat16)
               .requires_grad_() for _ in range(3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with sdpa_kernel(backend):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                o.backward(torch.ones_like(o))   # training needs the backward kernel too
        except RuntimeError as e:
            # torch gives the reasons a kernel was refused as warnings, then a bare
            # "No available kernel"
            why = [one_line(w.message) for w in caught]
            raise RuntimeError("; ".join(why[:3]) or str(e)) from None
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    err = rel_error(o.detach(), ref)
    if not err <= ATTN_TOL:
        raise CheckFailed(f"output relative error {err:.3g} > {ATTN_TOL} against fp32 math")
    return {"rel_err": err}
