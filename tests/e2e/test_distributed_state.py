"""State that must agree across ranks, on real torch.distributed over gloo (two CPU processes):

- the non-finite skip under FSDP2 (`fully_shard`): the parameters are DTensors, the gradient
  norm is a DTensor, and the fused AdamW kernel still skips a bad step from the plain 0-d
  found_inf our Health computes, with no host sync. (Accelerate runs FSDP only on CUDA, so the
  trainer's FSDP path itself needs GPUs; this drives the same pieces: fp8train.train.health.Health
  and the trainer's optimizer context.)
- the native FP8 backend's delayed-scaling state: each rank records the amaxes of its own data,
  and the update all-reduces them (max), so both ranks end with the same history and scales,
  those of the larger amax, without DDP broadcasting buffers."""
import json
import subprocess
import sys
import textwrap

import pytest
from support.runs import ROOT

# How each two-rank script ends, once its results are written: both ranks done, then out
# without tearing gloo down. On CPU that teardown after FSDP2's collectives aborts now and then
# ("terminate called without an active exception", seen even after a barrier); it says nothing
# about what the scripts check, and their results are on disk by then.
LEAVE = textwrap.dedent("""
    def leave():
        import os
        dist.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
""")

FSDP_SKIP = textwrap.dedent("""
    import json, sys
    import torch, torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    sys.path.insert(0, sys.argv[1])
    from fp8train.train.health import Health
    from fp8train.train.build import implicit_replication as _implicit_replication

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
        changed.append(any(not torch.equal(a, b) for a, b in zip(before, after, strict=True)))
    out = dict(rank=dist.get_rank(), norm_type=type(norm).__name__, changed=changed,
               interval=health.interval().tolist())
    with open(f"{sys.argv[2]}/rank{dist.get_rank()}.json", "w") as fh:
        json.dump(out, fh)
    leave()
""")


NATIVE_AMAX = textwrap.dedent("""
    import json, sys
    import torch, torch.distributed as dist
    sys.path.insert(0, sys.argv[1])
    from fp8train.config.load import Config
    from fp8train.precision import build_precision

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cpu = torch.device("cpu")
    out = {}
    for trial in (False, True):
        torch.manual_seed(0)   # the same model on both ranks
        prec = build_precision(Config(use_fp8=True, fp8_backend="native", fp8_layers="all",
                                      fp8_exclude=[], fp8_amax_history_len=4), cpu, print)
        if trial:
            prec.for_trials()
        holder = torch.nn.Module()
        holder.fc = torch.nn.Linear(32, 16)
        prec.convert(holder)
        x = torch.randn(8, 32) * (1.0 + 3.0 * rank)   # rank 1's data is 4x larger
        with prec.forward_context(training=True):
            y = holder.fc(x)
        y.sum().backward()
        local = [x.abs().amax().item(), holder.fc.weight.abs().amax().item(), 1.0]
        prec.after_backward()
        out["trial" if trial else "run"] = dict(
            local=local, history=prec.state.amax_history[-1, 0].tolist(),
            scale=prec.state.scale[0].tolist())
    with open(f"{sys.argv[2]}/rank{rank}.json", "w") as fh:
        json.dump(out, fh)
    leave()
""")


def run_two_ranks(tmp_path, script_text: str) -> list:
    """`script_text` in two gloo processes (argv: the repository, the output folder); each rank
    writes rank<N>.json there, then calls leave() (LEAVE)."""
    script = tmp_path / "script.py"
    script.write_text(LEAVE + script_text)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node=2", str(script), str(ROOT), str(tmp_path)],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def test_native_fp8_amaxes_are_reduced_over_ranks_except_in_trials(tmp_path):
    ranks = run_two_ranks(tmp_path, NATIVE_AMAX)
    r0, r1 = (x["run"] for x in ranks)
    assert r0["local"][0] < r1["local"][0]                      # the ranks saw different data
    assert r0["history"] == r1["history"] and r0["scale"] == r1["scale"]
    assert r0["history"][0] == pytest.approx(r1["local"][0])    # the larger input amax
    assert r0["scale"][0] == pytest.approx(448.0 / r1["local"][0])
    t0, t1 = (x["trial"] for x in ranks)                        # trials: each rank its own
    assert t0["history"][0] == pytest.approx(t0["local"][0])
    assert t1["history"][0] == pytest.approx(t1["local"][0])


def test_fused_adamw_skips_a_non_finite_step_under_fsdp2(tmp_path):
    results = run_two_ranks(tmp_path, FSDP_SKIP)
    assert sorted(x["rank"] for x in results) == [0, 1]
    for x in results:
        assert x["norm_type"] == "DTensor"           # what FSDP2's clip_grad_norm_ returns
        assert x["changed"] == [True, False, True]   # the NaN step left every shard untouched
        loss_mean, _, bad, _, worst = x["interval"]
        assert (loss_mean, bad, worst) == (1.0, 1.0, 1.0)
