"""A transformers model on a GPU (`model: hf:<directory>`): a Qwen3-0.6B-shaped config (28
decoder layers, width 1024, 16 heads of 128, 8 KV heads, a 151,936-token tied vocabulary) with
random weights, written locally, trained compiled in bf16 and in FP8 (torchao, native). Skipped
without CUDA; the FP8 runs without FP8 tensor cores. The corpus is read from disk, never
downloaded (gpu_support.run_train)."""
import math

import pytest
import torch
import yaml
from gpu_support import backend_skip, needs_corpus, needs_cuda, needs_fp8, run_train, train_rows
from support.hf_models import write_model

pytestmark = [pytest.mark.gpu, needs_cuda, needs_corpus]

QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                 num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, max_position_embeddings=40960, tie_word_embeddings=True,
                 rope_theta=1000000.0)
STEPS = 40


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """The shape alone (config.json) and the byte tokenizer: fresh weights, no download."""
    import transformers
    d = tmp_path_factory.mktemp("qwen3_06b")
    write_model(str(d), "qwen3")
    transformers.Qwen3Config(**QWEN3_06B).save_pretrained(d)
    return str(d)


def args(out, model_dir, **kw):
    base = dict(model=f"hf:{model_dir}", tokenizer="model", dataset="tinyshakespeare",
                output_dir=out, seq_len=512, batch_size=8, gradient_accumulation_steps=1,
                optimizer="adamw", learning_rate=1e-3, warmup_steps=5, max_steps=STEPS,
                log_interval=5, eval_interval=STEPS, checkpoint_interval=STEPS,
                eval_sequences=32, eval_samples=1, compile="true")
    base.update(kw)
    return [f"--{k}={v}" for k, v in base.items()]


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory, qwen3_dir):
    out = tmp_path_factory.mktemp("bf16") / "run"
    r = run_train(*args(out, qwen3_dir))
    assert r.returncode == 0, r.stderr[-3000:]
    return out, r.stdout


def test_qwen3_shape_trains_compiled_in_bf16(bf16_run):
    """Compiled per decoder layer; the 151,936-token loss in chunks; the loss falls from
    ln(V); MFU is counted from the model's own shape."""
    out, stdout = bf16_run
    assert "compile: per block (28 Qwen3DecoderLayer blocks" in stdout
    derived = yaml.safe_load(open(out / "config.yaml"))["derived"]
    assert derived["precision"] == "bf16" and derived["padded_vocab_size"] == 151936
    rows = train_rows(out)
    assert rows[0]["train/loss"] > math.log(151936) - 1.5
    assert rows[-1]["train/loss"] < rows[0]["train/loss"] - 2.0
    assert 0 < rows[-1].get("train/mfu", 0.5) < 1


@needs_fp8
@pytest.mark.parametrize("backend", ["torchao", "native"])
def test_qwen3_shape_trains_compiled_in_fp8_and_tracks_bf16(tmp_path, qwen3_dir, bf16_run,
                                                            backend):
    """FP8 converts the decoder layers' 196 Linears (the tied output layer stays bf16), runs
    compiled, and ends within 0.1 nats of the bf16 run's loss."""
    backend_skip(backend)
    out = tmp_path / backend
    r = run_train(*args(out, qwen3_dir, use_fp8="true", fp8_backend=backend))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "FP8: converted 196/197 linear layers" in r.stdout
    ours, ref = train_rows(out)[-1]["train/loss"], train_rows(bf16_run[0])[-1]["train/loss"]
    assert abs(ours - ref) < 0.1, (ours, ref)


def test_chunked_loss_holds_less_memory_than_the_whole_logits():
    """At 151,936 tokens of vocabulary and 8 × 2048 tokens, the plain loss holds the fp32
    logits and their gradient (about 10 GB each); the chunked loss a chunk's. Same loss."""
    from fp8train.loss import chunked_lm_loss, lm_loss
    V, C, N = 151936, 1024, 8 * 2048
    torch.manual_seed(0)
    h = torch.randn(1, N, C, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(V, C, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
    y = torch.randint(0, V, (1, N), device="cuda")

    def peak(fn):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = fn()
        loss.backward()
        torch.cuda.synchronize()
        h.grad = w.grad = None
        return loss.item(), (torch.cuda.max_memory_allocated() - base) / 2**30

    plain, plain_gb = peak(lambda: lm_loss(torch.nn.functional.linear(h, w), y)[0])
    chunked, chunked_gb = peak(lambda: chunked_lm_loss(h, w, y)[0])
    assert chunked == pytest.approx(plain, rel=1e-3)
    assert chunked_gb < plain_gb / 4, (chunked_gb, plain_gb)
