"""`model: hf:<directory>` on the real trainer: tiny Llama, Qwen3 and Gemma models written locally
(support/hf_models.py), trained end to end in FP8 (emulated on CPU), resumed bit-exact, compiled
per decoder layer, under DDP and FSDP2 over gloo, exported with save_pretrained and continued
from that export. This file is also the driver of the FSDP2 run (`accelerate launch
tests/e2e/test_hf_model.py OUT ARGS...`).

Mocked: only Accelerate's FSDP state on a CPU (support/fsdp_on_cpu.py says why)."""
import json
import os
import subprocess
import sys

import pytest

if __name__ == "__main__":   # run by the launcher as a script: tests/ (support/) is one level up
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from support.hf_models import write_model  # noqa: E402
from support.runs import DATA_DIR, ROOT, TORCHRUN, rows, run_train  # noqa: E402

# Models that cannot be trained, or not in FP8, are refused in one line: the bad-input corpus
# (support/bad_cases_model.py).


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_models")
    return {f: write_model(str(root / f), f) for f in ("llama", "qwen3", "gemma")}


def hf_args(out, model_dir, **overrides):
    """A seconds-long run of an hf: model on tinyshakespeare with the model's own tokenizer."""
    kw = dict(model=f"hf:{model_dir}", tokenizer="model", dataset="tinyshakespeare",
              output_dir=out, seq_len=64, batch_size=8, gradient_accumulation_steps=1,
              optimizer="adamw", learning_rate=3e-3, lr_schedule="cosine", min_lr_ratio=0.1,
              warmup_steps=2, max_steps=12, log_interval=2, eval_interval=6,
              checkpoint_interval=6, eval_sequences=32, eval_samples=0)
    kw.update(overrides)
    return [f"--{k}={v}" for k, v in kw.items()]


def losses(run_dir, key="train/loss"):
    return [r[key] for r in rows(run_dir, key)]


def final_params(run_dir):
    from safetensors.torch import load_file
    latest = open(os.path.join(run_dir, "checkpoints", "latest")).read().strip()
    return load_file(os.path.join(run_dir, "checkpoints", latest, "model.safetensors"))


@pytest.fixture(scope="module")
def llama_reference(tmp_path_factory, models):
    """8 steps of the Llama in one process, micro 4 × accum 2: what a resumed run and two DDP
    ranks must reproduce."""
    out = tmp_path_factory.mktemp("llama") / "straight"
    r = run_train(*hf_args(out, models["llama"], **LLAMA))
    assert r.returncode == 0, r.stderr[-3000:]
    return out, r.stdout


# One schedule however far a run goes (lr_decay_steps), so that a stopped run can be resumed.
LLAMA = dict(batch_size=4, gradient_accumulation_steps=2, max_steps=8, lr_decay_steps=8,
             eval_interval=4, checkpoint_interval=4)


def test_llama_trains_and_its_loss_falls(llama_reference):
    out, stdout = llama_reference
    assert "model: hf:" in stdout and "(llama, 2 layers, d=64, 4 heads)" in stdout
    assert "vocab 256 padded to 320" in stdout   # the tokenizer's ids, the model's rows
    train = losses(out)
    assert train[0] > 5.0 and train[-1] < train[0] - 1.0, train


def test_llama_stopped_and_resumed_is_bit_exact(tmp_path, models, llama_reference):
    straight = llama_reference[0]
    stopped = tmp_path / "stopped"
    assert run_train(*hf_args(stopped, models["llama"], **dict(LLAMA, max_steps=4))
                     ).returncode == 0
    r = run_train(*hf_args(stopped, models["llama"], **LLAMA), "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "at step 4" in r.stdout
    pa, pb = final_params(straight), final_params(stopped)
    assert pa.keys() == pb.keys()
    for k in pa:
        assert (pa[k] == pb[k]).all(), k
    assert losses(straight, "val/loss") == losses(stopped, "val/loss")


def test_two_gloo_ranks_under_ddp_equal_one_process(tmp_path, models, llama_reference):
    """DDP (torchrun, 2 CPU processes, micro 4 × accum 1 × 2) against one process (micro 4 ×
    accum 2): the same sequences, so the same losses and parameters up to summation order."""
    import numpy as np
    one, two = llama_reference[0], tmp_path / "two"
    env = dict(os.environ, FP8TRAIN_DATA_DIR=DATA_DIR)
    r = subprocess.run([*TORCHRUN, "--nproc_per_node", "2", "train_fp8.py",
                        *hf_args(two, models["llama"], **dict(LLAMA, gradient_accumulation_steps=1))],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "batch plan: micro 4 × accum 1 × 2 devices" in r.stdout
    pa, pb = final_params(one), final_params(two)
    assert pa.keys() == pb.keys()
    for k in pa:
        np.testing.assert_allclose(pa[k].numpy(), pb[k].numpy(), atol=1e-4, rtol=0)
    np.testing.assert_allclose(losses(one), losses(two), rtol=1e-5)


def test_qwen3_compiled_per_decoder_layer_with_checkpointing(tmp_path, models):
    """compile: true compiles each Qwen3DecoderLayer in place (one graph shared by both) and the
    output layer's chunked loss; activation checkpointing recomputes each compiled layer."""
    out = tmp_path / "run"
    r = run_train(*hf_args(out, models["qwen3"], compile="true", activation_checkpointing="true",
                           max_steps=4, eval_interval=4, checkpoint_interval=4))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "compile: per block (2 Qwen3DecoderLayer blocks, one graph shared by all" in r.stdout
    train = losses(out)
    assert train[-1] < train[0] - 0.3, train


def test_gemma_exports_with_its_tokenizer_and_continues_from_the_export(tmp_path, models):
    """Trained in native FP8 (the output layer left out) with Muon, the loss-gap check,
    fp8_until's hand-over and the micro-batch discovered, the loss falls. The export is the
    transformers model as save_pretrained writes it (tokenizer included,
    loadable by AutoModelForCausalLM); `model: hf:<export> init_from: pretrained` starts from
    those weights: its first evaluation equals the exported run's last."""
    import torch
    import transformers
    first, exported, cont = tmp_path / "first", tmp_path / "export", tmp_path / "continued"
    r = run_train(*hf_args(first, models["gemma"], use_fp8="true", fp8_backend="native",
                           optimizer="muon", fp8_check_interval=2, fp8_until=0.75,
                           max_steps=8, eval_interval=8, eval_samples=1, sample_tokens=8,
                           auto_batch_size="true", target_effective_batch_size=8,
                           max_batch_size=4, gradient_accumulation_steps="null",
                           batch_timing_budget_s=0))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "batch discovery: probing" in r.stdout
    assert "batch plan: micro 4 × accum 2 × 1 device = 8 sequences" in r.stdout
    assert len(rows(first, "val/loss")) == 1 and "sample: " in r.stdout
    assert "FP8: converted 14/15 linear layers" in r.stdout
    assert "hf.lm_head (excluded by fp8_exclude)" in r.stdout
    assert "optimizer: Muon" in r.stdout   # the decoder layers' 14 matrices
    assert "fp8_until: step 6 reached" in r.stdout
    gaps = [row["fp8/loss_gap"] for row in rows(first, "fp8/loss_gap")]
    assert gaps and all(abs(g) < 0.05 for g in gaps), gaps   # FP8 against the base precision
    assert losses(first)[-1] < losses(first)[0] - 0.5
    e = subprocess.run([sys.executable, "scripts/export_hf.py", str(first), str(exported)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert e.returncode == 0, e.stderr[-3000:]
    assert "wrote" in e.stdout and "GemmaForCausalLM" in e.stdout
    assert "check: transformers' logits match ours" in e.stdout
    hf = transformers.AutoModelForCausalLM.from_pretrained(exported)
    tok = transformers.AutoTokenizer.from_pretrained(exported)
    assert type(hf).__name__ == "GemmaForCausalLM" and tok.decode(tok.encode("To be")) == "To be"
    assert torch.equal(hf.lm_head.weight, hf.model.embed_tokens.weight)   # still tied
    # A learning rate too small to move an fp32 weight: step 1 evaluates the export's weights.
    r = run_train(*hf_args(cont, str(exported), init_from="pretrained", learning_rate=1e-12,
                           max_steps=1, eval_interval=1, warmup_steps=0))
    assert r.returncode == 0, r.stderr[-3000:]
    before, after = losses(first, "val/loss")[-1], losses(cont, "val/loss")[0]
    assert abs(before - after) < 1e-5 * before, (before, after)
    assert after < 5.3   # trained, not fresh (ln 320 = 5.77)


def test_fsdp2_on_two_gloo_ranks_shards_each_decoder_layer_and_trains(tmp_path, models):
    """Accelerate's FSDP2 prepare with the launch config that names GPT's `Block`: each Qwen3
    decoder layer is its own unit (the class taken from the model), the tied output layer and
    embedding stay one parameter, torchao's FP8 (its weights all-gathered in FP8) trains it:
    the loss falls, and the sharded checkpoint is written."""
    from support.fsdp_on_cpu import launch
    pytest.importorskip("torchao")
    args = [a for a in hf_args(tmp_path, models["qwen3"], batch_size=4, max_steps=6,
                               eval_interval=6, checkpoint_interval=6, use_fp8="true",
                               fp8_backend="torchao")
            if not a.startswith("--output_dir=")]
    r, ranks = launch("tests/e2e/test_hf_model.py", tmp_path, args)
    for rank in ranks:
        assert rank["rc"] == 0
        assert rank["sharded_blocks"] == ["FSDPQwen3DecoderLayer"] * 2
        assert rank["tied"] is True
    train = losses(tmp_path / "run")
    assert train[-1] < train[0] - 0.5, train
    assert (tmp_path / "run" / "checkpoints" / "step_0000006" / "pytorch_model_fsdp_0").is_dir()


def _drive(out_dir: str, argv: list) -> int:
    """One rank of the FSDP2 run: the trainer as train_fp8.py runs it, with Accelerate's FSDP
    state put back on the CPU; what the prepared model looks like goes to rank<i>.json."""
    sys.path.insert(0, str(ROOT))
    import accelerate
    import torch
    from support import fsdp_on_cpu

    from fp8train.train import cli

    seen = {}
    fsdp_on_cpu.install()
    prepare = accelerate.Accelerator.prepare

    def watched_prepare(self, *objs, **kw):
        result = prepare(self, *objs, **kw)
        model = next(o for o in result if isinstance(o, torch.nn.Module))
        seen["sharded_blocks"] = [type(b).__name__ for b in model.blocks]
        seen["tied"] = model.hf.lm_head.weight is model.hf.get_input_embeddings().weight
        return result

    accelerate.Accelerator.prepare = watched_prepare
    rank = int(os.environ.get("RANK", "0"))
    rc = cli.main([*argv, f"--output_dir={out_dir}/run"])
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(dict(rc=rc, **seen), fh)
    return 0


if __name__ == "__main__":
    sys.exit(_drive(sys.argv[1], sys.argv[2:]))
