"""The non-finite skip under FSDP2, on real `fully_shard` over gloo (two CPU processes): the
parameters are DTensors, the gradient norm is a replicated DTensor, and the fused AdamW kernel
still skips a bad step from the plain 0-d found_inf our Health computes, with no host sync.
(Accelerate runs FSDP only on CUDA, so the trainer's FSDP path itself needs GPUs; this drives
the same pieces: fp8train.health.Health and the trainer's optimizer context.)"""
import json
import subprocess
import sys
import textwrap

from conftest import ROOT

SCRIPT = textwrap.dedent("""
    import json, sys
    import torch, torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    sys.path.insert(0, sys.argv[1])
    from fp8train.health import Health
    from fp8train.trainer import _implicit_replication

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    health = Health(torch.device("cpu"), spike_factor=0.0)
    changed = []
    for scale in (1.0, float("nan"), 1.0):
        before = [p.full_tensor().clone() for p in model.parameters()]
        model(torch.randn(4, 16)).sum().mul(scale).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.found_inf = health.step(norm, torch.tensor(1.0), torch.tensor(0.0))
        with _implicit_replication():
            opt.step()
        opt.zero_grad(set_to_none=True)
        after = [p.full_tensor() for p in model.parameters()]
        changed.append(any(not torch.equal(a, b) for a, b in zip(before, after)))
    out = dict(rank=dist.get_rank(), norm_type=type(norm).__name__, changed=changed,
               interval=health.interval().tolist())
    with open(f"{sys.argv[2]}/rank{dist.get_rank()}.json", "w") as fh:
        json.dump(out, fh)
    dist.destroy_process_group()
""")


def test_fused_adamw_skips_a_non_finite_step_under_fsdp2(tmp_path):
    script = tmp_path / "fsdp_skip.py"
    script.write_text(SCRIPT)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node=2", str(script), str(ROOT), str(tmp_path)],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert sorted(x["rank"] for x in results) == [0, 1]
    for x in results:
        assert x["norm_type"] == "DTensor"           # what FSDP2's clip_grad_norm_ returns
        assert x["changed"] == [True, False, True]   # the NaN step left every shard untouched
        loss_mean, _, bad, _, worst = x["interval"]
        assert (loss_mean, bad, worst) == (1.0, 1.0, 1.0)
