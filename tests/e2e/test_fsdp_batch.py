"""The micro-batch probe under FSDP2 (fp8train/batch/sharded.py), proven on the real trainer
over two gloo ranks. This file is also the driver those processes run.

`accelerate launch --config_file accelerate_configs/fsdp_8xh100.yaml --num_processes 2` starts
2 CPU processes; each runs `fp8train.train.cli.main` twice with auto_batch_size and the same
probe_memory_limit_gb: once as DDP (every parameter, gradient and AdamW moment whole on each
rank, as the probe counted FSDP runs before), once under FSDP2 (support/fsdp_on_cpu.py: the one
mock, Accelerate's FSDP needs CUDA). Then, on the FSDP2 run's own prepared model and optimizer,
one more real training step at the micro-batch the plan chose, measured part by part: the
rank's parameter, gradient and optimizer-state shards (their local tensors) and the
activations autograd saved (each storage once, the gathered parameters left to the gathered
term); with the units gathered at once as the accounting counts them, the step stays within
the budget. The model: 8 Blocks of width 256 at seq_len 32, where the state (about 0.1 GB
whole) weighs against a few MB of activations per sequence."""
import json
import os
import sys

import pytest

if __name__ == "__main__":   # run by the launcher as a script: tests/ (support/) is one level up
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from support.fsdp_on_cpu import launch  # noqa: E402
from support.runs import ROOT  # noqa: E402

WORLD, LIMIT_GB, HEADROOM = 2, 0.15, 0.1
ARGS = ["--config=configs/test_auto_batch.yaml", "--n_layer=8", "--n_embd=256", "--seq_len=32",
        f"--probe_memory_limit_gb={LIMIT_GB}", f"--memory_headroom={HEADROOM}",
        "--target_effective_batch_size=64", "--batch_timing_budget_s=0.01", "--max_steps=2",
        "--eval_interval=2", "--checkpoint_interval=2", "--eval_sequences=8", "--eval_samples=0"]
MODES = ("ddp", "fsdp")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp_batch")
    r, ranks = launch("tests/e2e/test_fsdp_batch.py", tmp, ARGS, WORLD)
    return dict(tmp=tmp, stdout=r.stdout, ranks=ranks)


def _micro(run_dir) -> int:
    import yaml
    return yaml.safe_load(open(run_dir / "config.yaml"))["derived"]["micro_batch_size"]


def test_the_fsdp2_plan_takes_a_larger_micro_batch_than_the_unsharded_probe(runs):
    ddp, fsdp = _micro(runs["tmp"] / "ddp"), _micro(runs["tmp"] / "fsdp")
    assert fsdp > ddp >= 1, (ddp, fsdp)
    assert "batch discovery under FSDP2 (2 ranks): each trial's unsharded peak counted as " \
        "sharded" in runs["stdout"]
    assert all(r["fsdp"]["rc"] == 0 and r["ddp"]["rc"] == 0 for r in runs["ranks"])


def test_a_real_fsdp2_step_at_that_micro_batch_stays_within_the_budget(runs):
    """Each rank's measured shards are what the accounting counted as its share (to the
    padding), and shards + activations + the gathered units fit the probe's budget."""
    budget = LIMIT_GB * 1e9 * (1 - HEADROOM)
    for rank in runs["ranks"]:
        step = rank["fsdp"]["step"]
        assert step["micro"] == _micro(runs["tmp"] / "fsdp")
        shards = step["param_bytes"] + step["grad_bytes"] + step["optimizer_bytes"]
        assert step["param_bytes"] == step["grad_bytes"]
        assert step["optimizer_bytes"] == pytest.approx(2 * step["param_bytes"], rel=0.01)
        assert shards <= step["counted_shard_bytes"] <= shards * 1.01
        assert step["activation_bytes"] > 0
        total = shards + step["activation_bytes"] + step["counted_gathered_bytes"]
        assert total <= budget, (total, budget, step)


def _drive(out_dir: str, argv: list) -> int:
    sys.path.insert(0, str(ROOT))
    import accelerate
    import torch.distributed as dist
    from support import fsdp_on_cpu

    from fp8train.train import cli
    mode = {"now": None}
    fsdp_on_cpu.install(lambda: mode["now"] == "fsdp")
    seen: dict = {}
    prepare = accelerate.Accelerator.prepare

    def watched_prepare(self, *objs, **kw):
        result = prepare(self, *objs, **kw)
        seen["model"] = next(o for o in result if hasattr(o, "parameters"))
        seen["optimizer"] = next(o for o in result if hasattr(o, "param_groups"))
        return result

    accelerate.Accelerator.prepare = watched_prepare
    close = cli._close_process_group
    cli._close_process_group = lambda: None   # both runs share the process group
    out = {}
    for name in MODES:
        mode["now"] = name
        rc = cli.main([*argv, f"--output_dir={out_dir}/{name}"])
        out[name] = {"rc": rc}
        if name == "fsdp":
            out[name]["step"] = _measure_step(seen, out_dir, argv)
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as fh:
        json.dump(out, fh)
    dist.barrier()   # both ranks done before either tears the group down
    close()
    return 0


def _local_bytes(t) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def _measure_step(seen: dict, out_dir: str, argv: list) -> dict:
    """One more training step of the FSDP2 run's prepared model at its plan's micro-batch."""
    import torch
    import yaml

    from fp8train.batch.decide import new_model
    from fp8train.batch.sharded import fsdp_dtypes, sharding
    from fp8train.model import model_config_from
    saved = yaml.safe_load(open(os.path.join(out_dir, "fsdp", "config.yaml")))
    micro, seq_len = saved["derived"]["micro_batch_size"], saved["seq_len"]
    model, optimizer = seen["model"], seen["optimizer"]
    model.train()
    seen_storages, activations = set(), [0]

    def pack(t):
        # The parameters each module holds now (FSDP2 swaps in the gathered ones for its
        # forward): weights saved for backward, often as views, are the gathered term's.
        gathered = {p.untyped_storage().data_ptr() for m in model.modules()
                    for p in m.parameters(recurse=False) if not hasattr(p, "to_local")}
        st = t.untyped_storage()
        if st.data_ptr() not in gathered and st.data_ptr() not in seen_storages:
            seen_storages.add(st.data_ptr())
            activations[0] += st.nbytes()
        return t

    x = torch.randint(0, 256, (micro, seq_len), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x, x)[0]
    loss.backward()
    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values()
             if torch.is_tensor(v) and v.dim() > 0]
    mcfg = model_config_from("tiny", saved["derived"]["data"]["vocab_size"], seq_len,
                             n_layer=saved["n_layer"], n_embd=saved["n_embd"])
    with torch.device("meta"):
        counted = sharding(new_model(mcfg, False), WORLD, *fsdp_dtypes("no", False))
    return dict(micro=micro, param_bytes=sum(_local_bytes(p) for p in params),
                grad_bytes=sum(_local_bytes(p.grad) for p in params if p.grad is not None),
                optimizer_bytes=sum(_local_bytes(v) for v in state),
                activation_bytes=activations[0], counted_shard_bytes=counted.shard_bytes,
                counted_gathered_bytes=counted.gathered_bytes)


if __name__ == "__main__":
    sys.exit(_drive(sys.argv[1], sys.argv[2:]))
