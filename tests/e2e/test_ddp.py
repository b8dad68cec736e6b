"""DDP, proven on the real trainer: torchrun starts 2 CPU processes (gloo) that run
`fp8train.train.cli.main` exactly as `train_fp8.py` does. This file is also the driver those processes
run (`python -m torch.distributed.run --nproc_per_node 2 tests/e2e/test_ddp.py OUT ARGS...`): it
observes the run from outside the trainer, through Accelerate and torch, never through
test-only code in fp8train:

- `Accelerator.prepare` is wrapped to get the DDP model and register a DDP communication hook
  that counts gradient all-reduces (one call per gradient bucket);
- `Accelerator.backward` is wrapped to record, for every micro-step, Accelerate's
  `sync_gradients`, DDP's `require_backward_grad_sync` (False inside `no_sync`) and how many
  all-reduces that backward launched;
- `BatchStream.next` is wrapped to record the micro-batches each rank trains on;
- after `main()` returns, each rank saves its parameters (rank 0 alone writes checkpoints, so
  they cannot show that the ranks agree).

"Same losses and parameters as one process with micro × accumulation × world equal" is
tests/e2e/test_train.py::test_two_processes_match_one_process_with_the_same_effective_batch; not
repeated here.
"""
import os
import subprocess
import sys

import pytest

if __name__ == "__main__":   # run by the launcher as a script: tests/ (support/) is one level up
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from support.runs import DATA_DIR, ROOT, tiny_args  # noqa: E402

WORLD, MICRO, ACCUM, STEPS = 2, 4, 3, 6
EFFECTIVE = MICRO * ACCUM * WORLD


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    """One real 2-process run (micro 4 × accum 3 × 2 ranks, 6 steps, dropout on so that the
    ranks' forward passes differ; the checkpoint of step 3 written in the background) and what
    each rank recorded."""
    import torch
    tmp = tmp_path_factory.mktemp("ddp")
    out = tmp / "run"
    args = tiny_args(out, batch_size=MICRO, gradient_accumulation_steps=ACCUM, max_steps=STEPS,
                     dropout=0.1, log_interval=3, eval_interval=STEPS,
                     checkpoint_interval=3, checkpoint_async="true", eval_samples=0)
    env = dict(os.environ, FP8TRAIN_DATA_DIR=DATA_DIR, PYTHONUNBUFFERED="1")
    # --standalone: a free port, so that it cannot collide with another torchrun on the machine.
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node", str(WORLD), "tests/e2e/test_ddp.py", str(tmp), *args],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert f"micro {MICRO} × accum {ACCUM} × {WORLD} devices" in r.stdout
    ranks = [torch.load(tmp / f"rank{i}.pt") for i in range(WORLD)]
    assert [x["rc"] for x in ranks] == [0] * WORLD
    return dict(out=out, args=args, ranks=ranks, stdout=r.stdout)


def test_every_rank_ends_with_the_same_parameters(ddp_run):
    """After 6 steps both ranks hold bit-identical parameters (the averaged gradient is the
    same everywhere, so is the AdamW update), equal to the checkpoint rank 0 wrote."""
    import torch
    from safetensors.torch import load_file
    p0, p1 = (x["params"] for x in ddp_run["ranks"])
    assert p0.keys() == p1.keys() and len(p0) > 10
    for k in p0:
        assert torch.equal(p0[k], p1[k]), k
    saved = load_file(ddp_run["out"] / "checkpoints" / f"step_{STEPS:07d}" / "model.safetensors")
    assert saved.keys() == p0.keys()
    for k in p0:
        assert torch.equal(saved[k], p0[k]), k
    # The run trained: the parameters are not the seeded initialisation any more.
    init = ddp_run["ranks"][0]["init_params"]
    assert any(not torch.equal(init[k], p0[k]) for k in p0)


def test_a_background_checkpoint_holds_every_ranks_rng_and_is_agreed_by_both(ddp_run):
    """checkpoint_async under DDP: each rank writes its RNG states at the step, rank 0's thread
    the rest; its outcome is agreed at the next save (a collective on both ranks), which saves
    the last step synchronously."""
    from fp8train.checkpoint.files import read_manifest
    from fp8train.checkpoint.verify import verify
    ckpt = ddp_run["out"] / "checkpoints" / "step_0000003"
    assert verify(str(ckpt))[0] is None and read_manifest(str(ckpt))["async"] is True
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= set(os.listdir(ckpt))
    assert "checkpoint step 3 saved in the background (" in ddp_run["stdout"]
    assert f"checkpoint step {STEPS} saved (" in ddp_run["stdout"]


def test_ddp_keeps_gradients_in_its_buckets_and_does_not_rebroadcast_buffers(ddp_run):
    """Gradients as views of DDP's all-reduce buckets (no second copy of every gradient, which
    the micro-batch probe does not model) and no broadcast of every buffer before every forward
    (the model's buffers, its RoPE tables, are the same on every rank; this run is fp32)."""
    for rank in ddp_run["ranks"]:
        assert rank["options"] == dict(gradient_as_bucket_view=True, broadcast_buffers=False,
                                       grads_are_bucket_views=True)


def test_gradients_are_all_reduced_only_on_the_last_micro_step(ddp_run):
    """Gradient accumulation runs the first ACCUM - 1 micro-steps under no_sync: no all-reduce;
    the last one syncs, one all-reduce per gradient bucket, the same on every rank. (DDP
    rebuilds its buckets after the first step, so the count per step may change once.)"""
    per_step = []
    for rank in ddp_run["ranks"]:
        micro = rank["micro"]
        assert len(micro) == STEPS * ACCUM
        for step in range(STEPS):
            for m in range(ACCUM):
                sync, ddp_sync, allreduces = micro[step * ACCUM + m]
                last = m == ACCUM - 1
                assert sync is last and ddp_sync is last, (step, m, micro)
                assert (allreduces > 0) is last, (step, m, micro)
        per_step.append([a for _, _, a in micro[ACCUM - 1::ACCUM]])
        assert rank["allreduces"] == sum(per_step[-1])
    assert per_step[0] == per_step[1]


def test_ranks_read_disjoint_slices_of_the_single_process_order(ddp_run):
    """Rank r trains on sequences step × E + r × micro × accum + m × micro ... of the run's
    order (E = effective batch): the two ranks never read the same window, and together they
    read exactly what one process with the same effective batch reads, in its order."""
    import torch

    from fp8train.data.loader import load_tokens
    from fp8train.data.tokenizers import build_tokenizer
    from fp8train.data.windows import RandomWindows
    from fp8train.train.preflight import load_checked
    argv = [a.replace("--config=", f"--config={ROOT}{os.sep}") for a in ddp_run["args"]]
    cfg = load_checked(argv + [f"--data_dir={DATA_DIR}"])   # the run's config, read as it read it
    splits = load_tokens(cfg.dataset, cfg.data_dir, build_tokenizer(cfg.tokenizer), cfg.seq_len,
                         cfg.val_fraction, log=lambda _: None)
    sampler = RandomWindows(splits.train, cfg.seq_len, cfg.seed)
    total = STEPS * EFFECTIVE
    assert total < sampler.n_windows  # one epoch: every window at most once
    starts = sampler.starts(0, total)
    assert len(set(starts.tolist())) == total
    expected, _ = sampler.batch(0, total)   # one process, the same effective batch, in order

    seen_starts = []
    for r, rank in enumerate(ddp_run["ranks"]):
        batches = rank["batches"]
        assert batches.shape == (STEPS * ACCUM, MICRO, cfg.seq_len)
        for step in range(STEPS):
            for m in range(ACCUM):
                first = step * EFFECTIVE + r * MICRO * ACCUM + m * MICRO
                assert torch.equal(batches[step * ACCUM + m], expected[first:first + MICRO]), \
                    (r, step, m)
                seen_starts.append(set(starts[first:first + MICRO].tolist()))
    rank0 = set().union(*seen_starts[:STEPS * ACCUM])
    rank1 = set().union(*seen_starts[STEPS * ACCUM:])
    assert not rank0 & rank1
    assert rank0 | rank1 == set(starts.tolist())
    # By content too: no sequence rank 0 trained on is one rank 1 trained on.
    rows = [{tuple(s.tolist()) for s in rank["batches"].flatten(0, 1)}
            for rank in ddp_run["ranks"]]
    assert not rows[0] & rows[1]


# --- the driver: run by torchrun, one process per rank -------------------------------------------

def _drive(out_dir: str, argv: list) -> int:
    sys.path.insert(0, str(ROOT))
    import accelerate
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    from fp8train.data import windows as data
    from fp8train.train.cli import main

    seen = dict(model=None, init=None, options=None, allreduces=0, micro=[], batches=[])

    def counting_allreduce(state, bucket):
        seen["allreduces"] += 1
        return default_hooks.allreduce_hook(state, bucket)

    prepare = accelerate.Accelerator.prepare

    def watched_prepare(self, *objs, **kw):
        result = prepare(self, *objs, **kw)
        for obj in result if isinstance(result, tuple) else (result,):
            if isinstance(obj, DistributedDataParallel):
                obj.register_comm_hook(None, counting_allreduce)
                seen["model"] = obj
                seen["options"] = dict(gradient_as_bucket_view=obj.gradient_as_bucket_view,
                                       broadcast_buffers=obj.broadcast_buffers)
                seen["init"] = {k: v.detach().clone() for k, v in obj.module.state_dict().items()}
        return result

    backward = accelerate.Accelerator.backward

    def watched_backward(self, loss, **kw):
        sync, ddp_sync = self.sync_gradients, seen["model"].require_backward_grad_sync
        before = seen["allreduces"]
        backward(self, loss, **kw)
        seen["micro"].append((sync, ddp_sync, seen["allreduces"] - before))

    next_batch = data.BatchStream.next

    def watched_next(self):
        x, y = next_batch(self)
        seen["batches"].append(x.clone())
        return x, y

    accelerate.Accelerator.prepare = watched_prepare
    accelerate.Accelerator.backward = watched_backward
    data.BatchStream.next = watched_next
    rc = main(argv)
    model = seen["model"].module
    # After the run's last step, are the gradients still the views of DDP's buckets (the loop's
    # zero_grad keeps them) rather than tensors of their own?
    seen["options"]["grads_are_bucket_views"] = all(
        p.grad is not None and p.grad._base is not None
        for p in model.parameters() if p.requires_grad)
    torch.save(dict(rc=rc, params={k: v.detach().clone() for k, v in model.state_dict().items()},
                    init_params=seen["init"], micro=seen["micro"],
                    allreduces=seen["allreduces"], batches=torch.stack(seen["batches"]),
                    options=seen["options"]),
               os.path.join(out_dir, f"rank{os.environ['RANK']}.pt"))
    return rc


if __name__ == "__main__":
    sys.exit(_drive(sys.argv[1], sys.argv[2:]))
