"""The optimizer: AdamW (`optimizer: adamw`), or Muon for the hidden matrices with AdamW for the
rest (`optimizer: muon`), as modded-nanogpt and nanochat split them.

Muon (muon.py) is for the matrices inside the transformer blocks; the embeddings, the output
head (tied to the embedding here), norms and biases stay with AdamW, each with its own learning
rate and weight decay.

torch.optim.Muon computes the same update, but takes its learning rate as a host number and has
no `found_inf` input: it cannot skip a non-finite step on the device, which fp8train does
without a host sync per step (health.py); it also updates one matrix at a time on every rank.
So fp8train carries the update in muon.py (the same coefficients, Nesterov momentum and
scaling; tests compare it with torch.optim.Muon), in one optimizer that is torch's fused AdamW
for its AdamW groups: one object for Accelerate, the checkpoints and the loop."""
from __future__ import annotations

import torch

from ..errors import BadInput
from .muon import NS_STEPS, MuonUpdate


def build_optimizer(model: torch.nn.Module, opt, *, rank: int = 0, world: int = 1,
                    compiled: bool = False) -> torch.optim.Optimizer:
    """The optimizer `opt.name` names. AdamW decays matrices and embeddings only: decaying
    norms' gains and biases toward zero hurts and saves nothing. Fused (CPU and CUDA): one
    kernel for the whole AdamW update, and it can skip a non-finite step on the device (see
    health.py). `opt`: the config's optimizer section. Muon's: `rank` of
    `world` data-parallel ranks orthogonalises its share of the matrices (world 1: all of them,
    no collective: the batch probe's trials), `compiled` under the run's compile: true."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    hidden = [p for _, p in hidden_matrices(model)] if opt.name == "muon" else []
    taken = {id(p) for p in hidden}
    decay = [p for n, p in named if p.dim() >= 2 and id(p) not in taken]
    no_decay = [p for n, p in named if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": opt.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    kw = dict(lr=opt.learning_rate, betas=(opt.beta1, opt.beta2), eps=opt.adam_eps, fused=True)
    if opt.name != "muon":
        return torch.optim.AdamW(groups, **kw)
    # The loop sets each group's LR to the schedule's value x its lr_scale.
    groups.append({"params": hidden, "muon": True, "weight_decay": opt.muon_weight_decay,
                   "momentum": opt.muon_momentum, "lr_scale": opt.muon_lr / opt.learning_rate})
    return MuonAdamW(groups, parts=muon_parts(model, opt), rank=rank, world=world,
                     compiled=compiled, **kw)


def muon_parts(model: torch.nn.Module, opt) -> dict:
    """{parameter: row counts} of the fused projections Muon splits (muon_split_fused), {}
    when it takes every matrix whole."""
    fused = getattr(model, "fused_parts", None)
    if not opt.muon_split_fused or fused is None:
        return {}
    rows = fused()
    return {p: rows[n] for n, p in model.named_parameters() if n in rows}


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


def check_distributed(opt, distributed_type: str) -> None:
    """Muon orthogonalises whole matrices, which FSDP shards: refused there, in one line.
    `opt`: the config's optimizer section."""
    if opt.name == "muon" and distributed_type == "FSDP":
        raise BadInput(f"{opt.source}: key 'optimizer': muon orthogonalises whole "
                       "matrices, which FSDP shards: launch with DDP "
                       "(accelerate_configs/8xh100.yaml) or use optimizer: adamw")


def hidden_matrices(model: torch.nn.Module) -> list:
    """(name, parameter) of the weight matrices inside the transformer blocks (`model.blocks`:
    attention and MLP projections, whatever the model names them): Muon's."""
    inside = {id(p) for block in getattr(model, "blocks", None) or () for p in block.parameters()}
    return [(n, p) for n, p in model.named_parameters()
            if p.requires_grad and p.dim() == 2 and id(p) in inside]


class MuonAdamW(torch.optim.AdamW):
    """Muon for the groups marked `muon` (muon.py; `parts`, `rank`, `world`, `compiled`,
    `ns_dtype`: its settings), torch's AdamW for the others. The loop's `found_inf` (1.0: skip this step)
    reaches both: the fused AdamW kernel takes it, and Muon turns it into factors of 0 on the
    device (momentum, weight decay and update)."""

    def __init__(self, params, *, parts: dict = None, rank: int = 0, world: int = 1,
                 compiled: bool = False, ns_dtype=None, **adamw_kw):
        super().__init__(params, **adamw_kw)
        for group in self.param_groups:
            group.setdefault("muon", False)
            group.setdefault("lr_scale", 1.0)
        self.muon = MuonUpdate(parts or {}, rank, world, compiled, ns_dtype)

    @torch.no_grad()
    def step(self, closure=None):
        groups = self.param_groups
        self.param_groups = [g for g in groups if not g["muon"]]
        try:
            loss = super().step(closure)
        finally:
            self.param_groups = groups
        # fp16's GradScaler hands fused optimizers the gradients still scaled (grad_scale) when
        # nothing unscaled them first (gradient clipping does): Muon unscales its own.
        for group in groups:
            if group["muon"]:
                self.muon.step(group, self.state, getattr(self, "found_inf", None),
                               getattr(self, "grad_scale", None))
        return loss


def muon_flops_per_step(model: torch.nn.Module, opt=None) -> float:
    """The FLOPs of one Muon step's orthogonalisations, over all ranks together (each does its
    share): per m x n matrix (m <= n; a fused projection's parts each, with
    muon_split_fused) and iteration, x x^T (2 m^2 n), the Gram matrix squared (2 m^3) and its
    product with x (2 m^2 n)."""
    parts = {} if opt is None else {id(p): r for p, r in muon_parts(model, opt).items()}
    total = 0.0
    for _, p in hidden_matrices(model):
        for rows in parts.get(id(p), [p.shape[0]]):
            m, n = sorted((rows, p.shape[1]))
            total += NS_STEPS * (4.0 * m * m * n + 2.0 * m ** 3)
    return total
