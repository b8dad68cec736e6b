"""The optimizer: AdamW (`optimizer: adamw`), or Muon for the hidden matrices with AdamW for the
rest (`optimizer: muon`), as modded-nanogpt and nanochat split them.

Muon (Keller Jordan, 2024) updates a 2-D weight with its momentum orthogonalised by a quintic
Newton-Schulz iteration, scaled by sqrt(max(1, rows / cols)). It is for the matrices inside the
transformer blocks; the embeddings, the output head (tied to the embedding here), norms and
biases stay with AdamW, each with its own learning rate and weight decay.

torch.optim.Muon computes the same update, but takes its learning rate as a host number and has
no `found_inf` input: it cannot skip a non-finite step on the device, which fp8train does
without a host sync per step (health.py). So fp8train carries the update here (the same
coefficients, Nesterov momentum and scaling; tests compare it with torch.optim.Muon), in one
optimizer that is torch's fused AdamW for its AdamW groups: one object for Accelerate, the
checkpoints and the loop."""
from __future__ import annotations

import math

import torch

from ..errors import BadInput

# torch.optim.Muon's (and Keller Jordan's) quintic Newton-Schulz coefficients and step count.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5


def build_optimizer(model: torch.nn.Module, opt) -> torch.optim.Optimizer:
    """The optimizer of `opt.optimizer`. AdamW decays matrices and embeddings only: decaying
    norms' gains and biases toward zero hurts and saves nothing. Fused (CPU and CUDA): one
    kernel for the whole AdamW update, and it can skip a non-finite step on the device (see
    health.py). `opt`: the config's optimizer section (or the whole config)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    hidden = [p for n, p in named if is_hidden_matrix(n, p)] if opt.optimizer == "muon" else []
    taken = {id(p) for p in hidden}
    decay = [p for n, p in named if p.dim() >= 2 and id(p) not in taken]
    no_decay = [p for n, p in named if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": opt.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    kw = dict(lr=opt.learning_rate, betas=(opt.beta1, opt.beta2), eps=opt.adam_eps, fused=True)
    if opt.optimizer != "muon":
        return torch.optim.AdamW(groups, **kw)
    # The loop sets each group's LR to the schedule's value x its lr_scale.
    groups.append({"params": hidden, "muon": True, "weight_decay": opt.muon_weight_decay,
                   "momentum": opt.muon_momentum, "lr_scale": opt.muon_lr / opt.learning_rate})
    return MuonAdamW(groups, **kw)


def describe(optimizer: torch.optim.Optimizer, opt) -> str:
    """The optimizer in one line, for the log."""
    counts = {}
    for g in optimizer.param_groups:
        kind = "muon" if g.get("muon") else "adamw"
        counts[kind] = counts.get(kind, 0) + sum(p.numel() for p in g["params"])
    adamw = f"AdamW (fused, peak lr {opt.learning_rate:g}) for {counts['adamw'] / 1e6:.2f}M " \
        "parameters"
    if "muon" not in counts:
        return f"optimizer: {adamw}"
    return (f"optimizer: Muon (peak lr {opt.muon_lr:g}, momentum {opt.muon_momentum:g}) for the "
            f"blocks' matrices, {counts['muon'] / 1e6:.2f}M parameters; {adamw} (embeddings, "
            "norms, biases)")


def check_distributed(cfg, distributed_type: str) -> None:
    """Muon orthogonalises whole matrices, which FSDP shards: refused there, in one line."""
    if cfg.optimizer == "muon" and distributed_type == "FSDP":
        raise BadInput(f"{cfg.source}: key 'optimizer': muon orthogonalises whole matrices, "
                       "which FSDP shards: launch with DDP (accelerate_configs/8xh100.yaml) "
                       "or use optimizer: adamw")


def is_hidden_matrix(name: str, p: torch.Tensor) -> bool:
    """A weight matrix inside a transformer block (attention and MLP projections): Muon's."""
    return p.dim() == 2 and name.split(".")[0] == "blocks"


class MuonAdamW(torch.optim.AdamW):
    """Muon for the groups marked `muon`, torch's AdamW for the others. The loop's `found_inf`
    (1.0: skip this step) reaches both: the fused AdamW kernel takes it, and Muon turns it into
    factors of 0 on the device (momentum, weight decay and update)."""

    def __init__(self, params, **adamw_kw):
        super().__init__(params, **adamw_kw)
        for group in self.param_groups:
            group.setdefault("muon", False)
            group.setdefault("lr_scale", 1.0)

    @torch.no_grad()
    def step(self, closure=None):
        groups = self.param_groups
        self.param_groups = [g for g in groups if not g["muon"]]
        try:
            loss = super().step(closure)
        finally:
            self.param_groups = groups
        found_inf = getattr(self, "found_inf", None)
        # fp16's GradScaler hands fused optimizers the gradients still scaled (grad_scale) when
        # nothing unscaled them first (gradient clipping does): Muon unscales its own.
        grad_scale = getattr(self, "grad_scale", None)
        shared = _StepFactors(found_inf, grad_scale)   # converted once per device, not per matrix
        for group in groups:
            if group["muon"]:
                for p in group["params"]:
                    if p.grad is not None:
                        self._muon_update(p, group, shared)
        return loss

    def _muon_update(self, p: torch.Tensor, group: dict, shared: "_StepFactors") -> None:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            # Steps applied (AdamW's loading of a state dict expects one in every state).
            state["step"] = torch.zeros((), device=p.device)
        buf, grad, lr, mom = state["momentum_buffer"], p.grad, group["lr"], group["momentum"]
        if shared.grad_scale is not None:
            grad = grad / shared.scale_for(p.device, grad.dtype)
        scale = lr * math.sqrt(max(1.0, p.shape[0] / p.shape[1]))
        found_inf = shared.found_inf
        if found_inf is None:
            ok = 1.0
        else:       # a skipped step: its non-finite gradient read as 0, every factor 0
            ok, bad, zero = shared.skip_for(p.device, grad.dtype)
            grad = torch.where(bad, zero, grad)
        state["step"].add_(ok)
        buf.lerp_(grad, (1.0 - mom) * ok if found_inf is None else ((1.0 - mom) * ok).to(p.dtype))
        update = newton_schulz(grad.lerp(buf, mom)).to(p.dtype)      # Nesterov
        p.mul_(1.0 - lr * group["weight_decay"] * ok)
        if found_inf is None:
            p.add_(update, alpha=-scale)
        else:
            p.sub_(update * (scale * ok))


def muon_flops_per_step(model: torch.nn.Module) -> float:
    """The FLOPs of one Muon step's orthogonalisations: per m x n matrix (m <= n) and
    iteration, x x^T (2 m^2 n), the Gram matrix squared (2 m^3) and its product with x
    (2 m^2 n)."""
    total = 0.0
    for name, p in model.named_parameters():
        if p.requires_grad and is_hidden_matrix(name, p):
            m, n = sorted(p.shape)
            total += NS_STEPS * (4.0 * m * m * n + 2.0 * m ** 3)
    return total


def newton_schulz(g: torch.Tensor, steps: int = NS_STEPS) -> torch.Tensor:
    """The orthogonalised `g` (about U V^T of its SVD, singular values in ~[0.5, 1.5]): the
    quintic Newton-Schulz iteration in bfloat16, as torch.optim.Muon computes it."""
    a, b, c = NS_COEFFICIENTS
    x = g.bfloat16()
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


class _StepFactors:
    """The loop's found_inf and GradScaler's grad_scale as Muon's updates of one step use them,
    moved and converted once per device and dtype (a 1B model has ~150 matrices)."""

    def __init__(self, found_inf, grad_scale):
        self.found_inf, self.grad_scale = found_inf, grad_scale
        self.cache: dict = {}

    def scale_for(self, device, dtype) -> torch.Tensor:
        key = ("scale", device, dtype)
        if key not in self.cache:
            self.cache[key] = self.grad_scale.to(device=device, dtype=dtype)
        return self.cache[key]

    def skip_for(self, device, dtype):
        """(1 - found_inf as float32, found_inf > 0, a zero of `dtype`), on `device`."""
        key = ("skip", device, dtype)
        if key not in self.cache:
            f = self.found_inf.to(device)
            self.cache[key] = (1.0 - f.to(torch.float32), f > 0,
                               torch.zeros((), device=device, dtype=dtype))
        return self.cache[key]
