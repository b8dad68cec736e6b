"""Speed on a GPU (skipped without CUDA): per-block compile, Muon's batched update, the cost of
fp8 auto. Each test asserts what must hold on any GPU (every block ran compiled from one graph,
the compiled Muon update is the eager one, far fewer kernels, the choice within its budget with
host and device time reported) and prints the numbers docs/records/benchmarks.md records
(first-step seconds per block and whole, kernels and milliseconds per optimizer step, the
choice's wall time). `pytest -s tests/gpu/test_gpu_speed.py` shows them."""
import json
import subprocess
import sys

import pytest
import torch
from gpu_support import (OFFLINE_ENV, backend_skip, free_port, needs_corpus, needs_cuda,
                         needs_fp8, needs_two_gpus, offline_environ, run_train, train_rows)
from support.runs import ROOT, tiny_args

pytestmark = [pytest.mark.gpu, needs_cuda]

RUN = dict(max_steps=20, warmup_steps=5, learning_rate=1e-3, batch_size=16, seq_len=128,
           n_layer=4, log_interval=10, eval_interval=20, checkpoint_interval=20,
           eval_samples=0)


def _counted_run(out, *args):
    """train_fp8.py that writes dynamo's graph count after its first step (tests/support)."""
    counts = out.parent / f"{out.name}.graphs.json"
    env = {**offline_environ(), "FP8TRAIN_GRAPHS_JSON": str(counts)}
    r = subprocess.run([sys.executable, "tests/support/train_counting_graphs.py", *args],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    return r, json.loads(counts.read_text())["graphs"]


@needs_corpus
@pytest.mark.parametrize("backend", [pytest.param("bf16", marks=pytest.mark.gpu_quick),
                                     "native", pytest.param("torchao",
                                                            marks=pytest.mark.gpu_quick), "te"])
def test_every_block_runs_compiled_from_one_graph_on_gpu(tmp_path, backend):
    """compile: true compiles each block (one graph for the four; Transformer Engine's layers
    break it into a few pieces, still shared) and the output layer with the loss; the losses
    follow the eager run's."""
    fp8 = [] if backend == "bf16" else ["--use_fp8", f"--fp8_backend={backend}",
                                        "--fp8_fallback=error", "--fp8_layers=all"]
    if backend != "bf16":
        backend_skip(backend)
        if torch.cuda.get_device_capability() < (8, 9):
            pytest.skip("needs FP8 tensor cores (compute capability 8.9+)")
    eager = tmp_path / "eager"
    assert run_train(*tiny_args(eager, **RUN), *fp8).returncode == 0
    out = tmp_path / "compiled"
    r, graphs = _counted_run(out, *tiny_args(out, **RUN), *fp8, "--compile")
    assert "compile: per block (4 Block blocks" in r.stdout
    if backend == "te":
        assert 2 < graphs <= 12, graphs     # pieces between TE's layers, not one set per block
    else:
        assert graphs == 2, graphs
    first = json.load(open(out / "summary.json"))["first_step_s"]
    print(f"{backend}: first step {first:.1f} s per block, {graphs} graphs")
    for a, b in zip(train_rows(eager), train_rows(out), strict=True):
        assert b["train/loss"] == pytest.approx(a["train/loss"], rel=0.03)


@needs_corpus
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["bf16", "torchao"])
def test_the_first_step_of_llama_1b_per_block_and_whole(tmp_path, backend):
    """llama-1b, 3 steps at micro-batch 4 × 2048 tokens: the first step (its compiles) per
    block and with the whole model compiled. Per block compiles one block instead of sixteen,
    so its first step is the shorter one (the target: 15 s or less on an H200)."""
    fp8 = [] if backend == "bf16" else ["--use_fp8", "--fp8_backend=torchao",
                                        "--fp8_fallback=error", "--fp8_layers=all"]
    if backend != "bf16":
        backend_skip(backend)
    firsts = {}
    for scope in ("blocks", "model"):
        out = tmp_path / scope
        r = run_train("--dataset=synthetic", "--model=llama-1b", f"--output_dir={out}",
                      "--max_steps=3", "--num_epochs=null", "--warmup_steps=1",
                      "--batch_size=4", "--gradient_accumulation_steps=1", "--seq_len=2048",
                      "--log_interval=3", "--eval_interval=3", "--eval_sequences=8",
                      "--eval_samples=0", "--checkpoint_interval=1000", "--compile",
                      f"--compile_scope={scope}", *fp8, timeout=1800)
        assert r.returncode == 0, r.stderr[-3000:]
        firsts[scope] = json.load(open(out / "summary.json"))["first_step_s"]
    print(f"llama-1b {backend}: first step per block {firsts['blocks']:.1f} s, whole model "
          f"{firsts['model']:.1f} s")
    assert firsts["blocks"] < firsts["model"]


@pytest.mark.gpu_quick
def test_muon_on_gpu_is_one_batched_compiled_update_with_few_kernels():
    """A 16-block Llama (64 matrices in 4 shapes, the demo's width): the compiled, batched
    update is torch.optim.Muon's up to bf16 rounding of the iteration, and launches a fraction
    of the CUDA kernels of a matrix at a time; both step times printed."""
    from fp8train.config.load import Config, section
    from fp8train.model import GPT, model_config_from
    from fp8train.optim.optimizer import build_optimizer

    def kernels_and_ms(step):
        step()
        step()    # compiled and warmed up
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        n = sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA")
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            step()
        end.record()
        end.synchronize()
        return n, start.elapsed_time(end) / 10

    torch.manual_seed(0)
    mcfg = model_config_from("llama-350m", 256, 64, n_layer=16)
    model = GPT(mcfg).cuda()
    ref_model = GPT(mcfg).cuda()
    ref_model.load_state_dict(model.state_dict())
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = build_optimizer(model, section(Config(optimizer="muon", muon_split_fused=False),
                                         "optimizer"), compiled=True)
    hidden = [p for n, p in ref_model.named_parameters() if n.startswith("blocks") and
              p.dim() == 2]
    ref = torch.optim.Muon(hidden, lr=opt.param_groups[2]["lr"], weight_decay=0.0)
    gen = torch.Generator("cuda").manual_seed(1)
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        p.grad = torch.randn(p.shape, device="cuda", generator=gen)
        q.grad = p.grad.clone()
    opt.found_inf = torch.zeros((), device="cuda")
    ours = kernels_and_ms(opt.step)
    per_matrix = kernels_and_ms(ref.step)
    print(f"Muon step, 64 matrices of llama-350m's width: ours {ours[0]} kernels "
          f"{ours[1]:.2f} ms; torch.optim.Muon {per_matrix[0]} kernels {per_matrix[1]:.2f} ms")
    assert ours[0] < per_matrix[0] / 3
    # 13 steps each on the same gradients: the same place up to the bf16 iteration's rounding
    for (n, p), q in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        if n.startswith("blocks") and p.dim() == 2:
            assert (p - q).norm() <= 0.05 * (q - start[n]).norm(), n


@needs_corpus
@needs_fp8
@pytest.mark.slow
def test_fp8_auto_on_gpu_reports_its_cost_and_host_time(tmp_path):
    """fp8_backend auto, compiled, on a 4-block model: the table gives each timed candidate's
    host/device ratio, the cost line the seconds and graphs, within fp8_choice_budget_s."""
    out = tmp_path / "run"
    r = run_train(*tiny_args(out, **RUN), "--use_fp8", "--fp8_backend=auto",
                  "--fp8_fallback=error", "--compile")
    assert r.returncode == 0, r.stderr[-3000:]
    timed = [line for line in r.stdout.splitlines() if line.startswith("  ") and "ms (" in line]
    assert timed and all("host/device" in line for line in timed), r.stdout[-3000:]
    cost = next(line for line in r.stdout.splitlines() if " candidates (" in line)
    choice = json.load(open(out / "summary.json"))["fp8_choice"]
    assert choice["graphs"] > 0 and 0 < choice["seconds"] <= 300
    print(cost)


def _muon_on(rank: int, world: int, port: int, out: str) -> None:
    """3 Muon steps of seeded gradients on GPU `rank` of `world` (NCCL), saved."""
    import os

    import torch.distributed as dist

    from fp8train.config.load import Config, section
    from fp8train.model import GPT, model_config_from
    from fp8train.optim.optimizer import build_optimizer
    torch.cuda.set_device(rank)
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("nccl", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = GPT(model_config_from("tiny-llama", 256, 64, n_layer=3)).cuda()
    start = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    opt = build_optimizer(model, section(Config(optimizer="muon"), "optimizer"), rank=rank,
                          world=world, compiled=True)
    gen = torch.Generator("cuda").manual_seed(1)
    for _ in range(3):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, device="cuda", generator=gen)
        opt.found_inf = torch.zeros((), device="cuda")
        opt.step()
    torch.save({"start": start, "end": {n: p.detach().cpu() for n, p in model.named_parameters()}},
               os.path.join(out, f"world{world}_rank{rank}.pt"))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


@needs_two_gpus
def test_two_gpus_share_muon_and_match_one(tmp_path):
    """Muon's share per rank over NCCL (bf16 updates all-gathered), compiled: both ranks hold
    the same weights, and they are where one GPU doing every matrix ends, up to the kernels
    cuBLAS picks for another batch count (on a CPU, bit for bit: tests/e2e/test_optimizer.py)."""
    import torch.multiprocessing as mp
    mp.spawn(_muon_on, args=(2, free_port(), str(tmp_path)), nprocs=2)
    _muon_on(0, 1, 0, str(tmp_path))
    one = torch.load(tmp_path / "world1_rank0.pt")
    ranks = [torch.load(tmp_path / f"world2_rank{rank}.pt") for rank in range(2)]
    for name, end in one["end"].items():
        assert torch.equal(ranks[0]["end"][name], ranks[1]["end"][name]), name
        moved = (end - one["start"][name]).norm()
        assert (ranks[0]["end"][name] - end).norm() <= 0.01 * moved + 1e-12, name


assert OFFLINE_ENV   # the runs above never touch the network (gpu_support.run_train)
