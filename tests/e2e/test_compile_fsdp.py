"""Per-block compile under FSDP2, on the real trainer over two gloo ranks. This file is also the
driver those processes run: each runs `fp8train.train.cli.main` twice on the same seed and
data, eagerly and with `--compile` (per block), in fp32.

Mocked, because it cannot exist here: Accelerate shards with FSDP only on CUDA
(support/fsdp_on_cpu.py puts its FSDP2 state back on a CPU). Everything else is real:
Accelerate's FSDP2 prepare (fully_shard per Block), the compile of each sharded block after it,
the gloo all-gathers and reduce-scatters between the compiled blocks, the loop, the evaluation.
"""
import json
import os
import sys

import pytest

if __name__ == "__main__":   # run by the launcher as a script: tests/ (support/) is one level up
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from support.fsdp_on_cpu import launch  # noqa: E402
from support.runs import ROOT, tiny_args  # noqa: E402

WORLD, STEPS = 2, 4
RUN = dict(batch_size=4, gradient_accumulation_steps=1, warmup_steps=1, max_steps=STEPS,
           log_interval=2, eval_interval=STEPS, checkpoint_interval=STEPS, eval_sequences=16,
           eval_samples=0)
MODES = {"eager": [], "compiled": ["--compile"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compile_fsdp")
    args = [a for a in tiny_args(tmp, **RUN) if not a.startswith("--output_dir=")]
    r, ranks = launch("tests/e2e/test_compile_fsdp.py", tmp, args, WORLD, timeout=600)
    return dict(tmp=tmp, stdout=r.stdout, ranks=ranks)


def _rows(run_dir, key):
    return {row["step"]: row[key] for row in map(json.loads, open(run_dir / "metrics.jsonl"))
            if key in row}


def test_sharded_blocks_are_compiled_after_fully_shard_and_train_like_eager(runs):
    """Every rank compiled its sharded blocks in place (each is FSDP2's and compiled), ran one
    graph for both blocks and one for the output layer and loss, and the losses and the
    evaluation follow the eager FSDP2 run up to kernel fusion."""
    for rank in runs["ranks"]:
        assert rank["eager"]["rc"] == rank["compiled"]["rc"] == 0
        assert rank["compiled"]["blocks"] == [["FSDPBlock", True]] * 2
        assert rank["eager"]["blocks"] == [["FSDPBlock", False]] * 2
        assert rank["compiled"]["graphs"] >= 2 and rank["eager"]["graphs"] == 0
    assert "compile: per block (2 Block blocks" in runs["stdout"]
    tmp = runs["tmp"]
    for key in ("train/loss", "val/loss"):
        eager, compiled = _rows(tmp / "eager", key), _rows(tmp / "compiled", key)
        assert sorted(eager) == sorted(compiled) and eager
        for step in eager:
            assert compiled[step] == pytest.approx(eager[step], rel=1e-4)


def _drive(out_dir: str, argv: list) -> int:
    sys.path.insert(0, str(ROOT))
    import accelerate
    import torch
    import torch.distributed as dist
    from support import fsdp_on_cpu

    from fp8train.train import cli

    seen: dict = {}
    fsdp_on_cpu.install()   # the mock (see the module docstring)
    prepare = accelerate.Accelerator.prepare

    def watched_prepare(self, *objs, **kw):
        result = prepare(self, *objs, **kw)
        seen["model"] = next(o for o in result if isinstance(o, torch.nn.Module))
        return result

    accelerate.Accelerator.prepare = watched_prepare
    close = cli._close_process_group
    cli._close_process_group = lambda: None   # both runs share the process group
    out = {}
    for mode, extra in MODES.items():
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        rc = cli.main([*argv, f"--output_dir={out_dir}/{mode}", *extra])
        out[mode] = dict(rc=rc, graphs=torch._dynamo.utils.counters["stats"]["unique_graphs"],
                         blocks=[[type(b).__name__, b._compiled_call_impl is not None]
                                 for b in seen["model"].blocks])
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as fh:
        json.dump(out, fh)
    dist.barrier()   # both ranks done before either tears the group down
    close()
    return 0


if __name__ == "__main__":
    sys.exit(_drive(sys.argv[1], sys.argv[2:]))
