"""FP8 weight all-gather under FSDP2 (key fp8_fsdp_all_gather, torchao tensorwise), proven on
the real trainer over gloo. This file is also the driver those processes run.

`accelerate launch --config_file accelerate_configs/fsdp_8xh100.yaml --num_processes 2` starts
2 CPU processes; each runs `fp8train.train.cli.main` twice on the same seed and data: with the default
(FP8 all-gather on under FSDP2) and with fp8_fsdp_all_gather: false (the weights gathered in
fp32, then cast to FP8 by each layer).

Mocked, because it cannot exist here: Accelerate shards with FSDP only on CUDA
(support/fsdp_on_cpu.py puts its FSDP2 state back on a CPU). Everything else is real: our
backend's convert, Accelerate's FSDP2 prepare (fully_shard per Block, its optimizer re-mapping),
the gloo all-gathers, the training loop, evaluation and the sharded checkpoint.

Observed from outside fp8train, by wrapping library functions that still run:
- torch.distributed.all_gather_single (what FSDP2 calls): the bytes of every all-gather;
- torchao's WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather: whether each FP8 cast of a
  weight shard had a precomputed scale;
- TorchAO.after_optimizer_step: how many FP8 casts came before the first optimizer step;
- Accelerator.prepare and TorchAO.convert: the prepared model and our backend, for the checks
  after each run (parameters, scales, a rollback's remedy).
"""


import json
import os
import sys

import pytest

if __name__ == "__main__":   # run by the launcher as a script: tests/ (support/) is one level up
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from support.fsdp_on_cpu import launch  # noqa: E402
from support.runs import ROOT, tiny_args  # noqa: E402

pytest.importorskip("torchao")


WORLD, STEPS = 2, 6


RUN = dict(use_fp8="true", fp8_backend="torchao", fp8_layers="all", batch_size=4,
           gradient_accumulation_steps=1, warmup_steps=2, max_steps=STEPS, log_interval=3,
           eval_interval=STEPS, checkpoint_interval=STEPS, eval_sequences=16, eval_samples=0,
           fp8_check_interval=2)


MODES = {"fp8": [], "fp32": ["--fp8_fsdp_all_gather=false"]}


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp_fp8")
    args = [a for a in tiny_args(tmp, **RUN) if not a.startswith("--output_dir=")]
    r, ranks = launch("tests/e2e/test_fsdp_fp8.py", tmp, args, WORLD, timeout=300)
    for rank in ranks:
        assert {m: rank[m]["rc"] for m in MODES} == {"fp8": 0, "fp32": 0}
    return dict(tmp=tmp, stdout=r.stdout, ranks=ranks)


def _rows(run_dir, key):
    return {row["step"]: row for row in map(json.loads, open(run_dir / "metrics.jsonl"))
            if key in row}


def test_the_all_gather_carries_fp8_weights(fsdp_runs):
    """Byte for byte: FSDP2 issues the same all-gathers in both runs (same units, same order).
    Each Block's all-gather carries its converted weights at 1 byte per element with the FP8
    all-gather, 4 (fp32) without; every other all-gather (embeddings, final norm) and every
    other tensor of a Block (biases, norms) is the same size in both."""
    for rank in fsdp_runs["ranks"]:
        fp8, fp32 = rank["fp8"]["gathers"], rank["fp32"]["gathers"]
        weights = rank["fp8"]["fp8_weight_elements_per_block"]   # per rank: a shard
        assert len(fp8) == len(fp32)
        saved = [b32 - b8 for b8, b32 in zip(fp8, fp32, strict=True)]
        assert set(saved) == {0, 3 * weights}, (fp8, fp32)
        # Each of the 2 Blocks is gathered at least in forward and in backward, every step.
        assert saved.count(3 * weights) >= 2 * 2 * STEPS
    assert "FSDP2 all-gathers the weights in FP8" in fsdp_runs["stdout"]


def test_the_loss_gap_check_runs_on_every_rank_under_fsdp2(fsdp_runs):
    """fp8_check_interval 2: both ranks run the check's forward (its all-gathers included) at
    steps 2, 4, 6 and the run ends; the gap is small in both runs (with the FP8 all-gather the
    high-precision pass computes with the FP8-rounded weights, ao.plain_weight)."""
    tmp = fsdp_runs["tmp"]
    gaps = {m: _rows(tmp / m, "fp8/loss_gap") for m in MODES}
    for mode in MODES:
        assert sorted(gaps[mode]) == [2, 4, 6]
        assert all(abs(r["fp8/loss_gap"]) < 0.02 for r in gaps[mode].values()), gaps[mode]


def test_scales_are_precomputed_after_each_optimizer_step(fsdp_runs):
    """Before the first optimizer step no weight has a precomputed scale (torchao then
    all-reduces each weight's amax inside its all-gather); from the first step on every FP8
    cast of a weight shard uses the scale TorchAO.after_optimizer_step precomputed, and at the
    end each layer's scale is fp8_max / amax of its final weight over both ranks."""
    for rank in fsdp_runs["ranks"]:
        run = rank["fp8"]
        flags, first = run["precomputed"], run["casts_before_first_step"]
        assert first >= 8 and not any(flags[:first])          # 8 converted layers
        assert len(flags) > first and all(flags[first:])
        assert len(run["scales"]) == 8
        for scale, amax in run["scales"].values():
            assert scale == pytest.approx(448.0 / amax, rel=1e-6)
        assert rank["fp32"]["precomputed"] == []              # no FP8 all-gather at all


def test_losses_and_weights_match_the_fp32_all_gather(fsdp_runs):
    """Same numerics: in both runs each weight is cast to FP8 with the scale of its whole
    tensor (fp8_max / global amax; torchao computes it in float64 both ways), so the GEMMs see
    the same FP8 bytes. Observed: bit-identical; the tolerance (1e-6 relative) leaves room
    only for float rounding of the scale, far below the ~1e-2 effect of a wrong scale.
    Every parameter trained (Accelerate's FSDP2 prepare paired each optimizer slot with its own
    sharded weight, see ao.expose_storage), and the parameters at the end agree."""
    import torch
    tmp = fsdp_runs["tmp"]
    fp8, fp32 = _rows(tmp / "fp8", "train/loss"), _rows(tmp / "fp32", "train/loss")
    assert sorted(fp8) == sorted(fp32) == [3, 6]
    for step in fp8:
        assert fp8[step]["train/loss"] == pytest.approx(fp32[step]["train/loss"], rel=1e-6)
        for key in ("fp8/blocks.0.attn.qkv/fwd_scale_weight",
                    "fp8/blocks.1.mlp.proj/amax_weight"):
            # The probe reads the weight as gathered in FP8: same statistics.
            assert fp8[step][key] == pytest.approx(fp32[step][key], rel=1e-5)
        assert fp8[step]["fp8/saturated"] == 0.0
    for rank in fsdp_runs["ranks"]:
        assert all(rank["fp8"]["changed"].values()) and len(rank["fp8"]["changed"]) > 10
    a, b = (torch.load(tmp / f"{mode}_params.pt") for mode in MODES)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-6, atol=0, msg=name)


def test_evaluation_sees_the_weights_as_gathered_in_fp8(fsdp_runs):
    """Evaluation runs the converted layers as plain Linears (fp8_eval: false). Under the FP8
    all-gather their weight arrives in FP8 and is dequantized: val/loss then measures weights
    that carry the E4M3 rounding (up to 2^-4 relative per element), so it differs from the fp32
    gather's in the 4th or 5th digit; 1e-3 still catches a scale applied wrongly."""
    tmp = fsdp_runs["tmp"]
    fp8, fp32 = _rows(tmp / "fp8", "val/loss")[STEPS], _rows(tmp / "fp32", "val/loss")[STEPS]
    assert fp8["val/loss"] == pytest.approx(fp32["val/loss"], rel=1e-3)
    assert fp8["val/loss"] != fp32["val/loss"]
    derived = {m: _derived(tmp / m / "config.yaml") for m in MODES}
    assert derived["fp8"]["fp8_fsdp_all_gather"] is True
    assert derived["fp32"]["fp8_fsdp_all_gather"] is False
    assert (tmp / "fp8" / "checkpoints" / f"step_{STEPS:07d}" / "pytorch_model_fsdp_0").is_dir()


def test_the_sharded_checkpoint_reads_back_in_a_fresh_process(fsdp_runs):
    """Its converted weights' shards are torchao's weight wrapper, whose classes torch's
    weights_only loading allows only once torchao.float8 is imported: evaluate.py, sample.py
    and export_hf.py, which never import torchao themselves, read it through
    trained.read_state in a fresh process, and get the fp32-gather run's weights."""
    import subprocess
    import sys
    tmp = fsdp_runs["tmp"]
    step = f"step_{STEPS:07d}"
    code = ("import sys, torch; from fp8train.evaluate.trained import read_state; "
            "assert 'torchao' not in sys.modules; "
            "a, b = (read_state(p) for p in sys.argv[1:]); "
            "w = 'blocks.0.attn.qkv.weight'; "
            "assert type(a[w]) is torch.Tensor and a.keys() == b.keys(), type(a[w]); "
            "torch.testing.assert_close(a[w], b[w], rtol=1e-6, atol=0); print('read')")
    r = subprocess.run([sys.executable, "-c", code, str(tmp / "fp8" / "checkpoints" / step),
                        str(tmp / "fp32" / "checkpoints" / step)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "read", r.stderr[-3000:]


def test_a_rollback_refreshes_the_scales_and_trains_without_fp8(fsdp_runs):
    """After a rollback restores other weights (here: every converted weight doubled), the
    remedy (fp8_recovery: bf16) precomputes the scales again: halved, so the doubled weights
    are not clipped at the next all-gather. The converted layers then train as plain Linears
    on the dequantized FP8-gathered weight, and the gradients reach the sharded weights."""
    for rank in fsdp_runs["ranks"]:
        rb = rank["fp8"]["rollback"]
        assert "FP8 switched off" in rb["remedy"]
        assert rb["before"] is not None and rb["after"] == pytest.approx(rb["before"] / 2,
                                                                         rel=1e-6)
        assert rb["loss_finite"] and rb["grads"]


def _derived(path) -> dict:
    import yaml
    return yaml.safe_load(open(path))["derived"]


def _drive(out_dir: str, argv: list) -> int:
    sys.path.insert(0, str(ROOT))
    import accelerate
    import torch
    import torch.distributed as dist
    from support import fsdp_on_cpu
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor as Wrapped

    from fp8train.precision import ao
    from fp8train.train import cli

    seen: dict = {}

    fsdp_on_cpu.install()   # the mock (see the module docstring)
    prepare = accelerate.Accelerator.prepare

    def watched_prepare(self, *objs, **kw):
        model = next(o for o in objs if isinstance(o, torch.nn.Module))
        block = model.blocks[0]
        seen["fp8_weight_elements_per_block"] = sum(
            p.numel() for p in block.parameters() if isinstance(p, Wrapped)) // WORLD
        result = prepare(self, *objs, **kw)
        seen["model"] = next(o for o in result if isinstance(o, torch.nn.Module))
        seen["start"] = _full_params(seen["model"])
        return result

    convert = ao.TorchAO.convert

    def watched_convert(self, model):
        seen["prec"] = self
        return convert(self, model)

    step = ao.TorchAO.after_optimizer_step

    def watched_step(self):
        seen.setdefault("casts_before_first_step", len(seen["precomputed"]))
        step(self)

    gather = dist.all_gather_single

    def watched_gather(output_tensor, input_tensor, *args, **kw):
        seen["gathers"].append(input_tensor.numel() * input_tensor.element_size())
        return gather(output_tensor, input_tensor, *args, **kw)

    pre_gather = Wrapped.fsdp_pre_all_gather

    def watched_pre_gather(self, mesh):
        seen["precomputed"].append(self._precomputed_scale is not None)
        return pre_gather(self, mesh)

    accelerate.Accelerator.prepare = watched_prepare
    ao.TorchAO.convert = watched_convert
    ao.TorchAO.after_optimizer_step = watched_step
    dist.all_gather_single = watched_gather
    Wrapped.fsdp_pre_all_gather = watched_pre_gather
    close = cli._close_process_group
    cli._close_process_group = lambda: None   # both runs share the process group

    out = {}
    for mode, extra in MODES.items():
        seen.clear()
        seen.update(gathers=[], precomputed=[])
        rc = cli.main([*argv, f"--output_dir={out_dir}/{mode}", *extra])
        out[mode] = _after_run(rc, seen, out_dir, mode, Wrapped)
        if mode == "fp8":
            out[mode]["rollback"] = _rollback(seen)
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as fh:
        json.dump(out, fh)
    dist.barrier()   # both ranks done before either tears the group down
    close()
    return 0


def _scale(local):
    """The scale torchao precomputed for this weight shard (None: none yet)."""
    scale = local._precomputed_scale
    return None if scale is None else scale.item()


def _full_params(model) -> dict:
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _after_run(rc: int, seen: dict, out_dir: str, mode: str, wrapped) -> dict:
    import torch
    import torch.distributed as dist
    model, prec = seen["model"], seen["prec"]
    end = _full_params(model)
    if dist.get_rank() == 0:
        torch.save(end, os.path.join(out_dir, f"{mode}_params.pt"))
    scales = {}
    for name, m in prec.modules.items():
        local = m.weight._local_tensor   # a shard; torchao keeps the scale on it
        if isinstance(local, wrapped):
            amax = local.detach().abs().max().float()
            dist.all_reduce(amax, op=dist.ReduceOp.MAX)
            scales[name] = (_scale(local), amax.item())
    return dict(rc=rc, gathers=list(seen["gathers"]), precomputed=list(seen["precomputed"]),
                casts_before_first_step=seen.get("casts_before_first_step"),
                fp8_weight_elements_per_block=seen["fp8_weight_elements_per_block"],
                changed={n: not torch.equal(seen["start"][n], end[n]) for n in end},
                scales=scales)


def _rollback(seen: dict) -> dict:
    """What a rollback does to the FP8-gathered weights, on the run's own model and backend:
    other weights (here the converted ones doubled), then the bf16 remedy, then one step."""
    import torch
    model, prec = seen["model"], seen["prec"]
    layer = next(iter(prec.modules.values()))
    with torch.no_grad():
        for m in prec.modules.values():
            m.weight.mul_(2)
    before = _scale(layer.weight._local_tensor)
    remedy = prec.recover("bf16")
    after = _scale(layer.weight._local_tensor)
    model.train()
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    with prec.forward_context(training=True):
        loss = model(tokens).float().logsumexp(-1).mean()
    loss.backward()
    grads = all(m.weight.grad is not None and bool(m.weight.grad.full_tensor().abs().sum() > 0)
                for m in prec.modules.values())
    return dict(remedy=remedy, before=before, after=after,
                loss_finite=bool(torch.isfinite(loss)), grads=grads)


if __name__ == "__main__":
    sys.exit(_drive(sys.argv[1], sys.argv[2:]))
