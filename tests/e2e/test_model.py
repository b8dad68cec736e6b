"""The model compiled whole, in process (tens of seconds of compilation: out of the unit tier,
whose tests/unit/test_model.py checks shapes and the eager forward)."""
import torch

from fp8train.model import GPT, model_config_from


def test_compiled_loss_keeps_no_fp32_logits_for_backward():
    """Compiled with its loss, a bf16 model saves its logits for backward in bf16 only. With the
    loss computed after the compiled forward (fp8train before this test, and Accelerate's
    mixed-precision forward, which returns fp32 logits), a fp32 copy of the logits was saved as
    well: 6.6 GB for GPT-2 124M at 32 × 1024, and most of an H200 run's 39 GB peak."""
    torch.manual_seed(0)
    vocab, batch, seq = 512, 4, 32
    m = GPT(model_config_from("tiny", vocab, seq))
    compiled = torch.compile(m, fullgraph=True)
    x, y = torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch, seq))
    saved = []

    def pack(t):
        saved.append((t.dtype, t.numel()))
        return t

    def saved_logits(fn):
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                torch.autocast("cpu", dtype=torch.bfloat16):
            loss = fn()
        loss.backward()
        return {dtype for dtype, n in saved if n == batch * seq * vocab}

    assert saved_logits(lambda: compiled(x, y)[0]) == {torch.bfloat16}
    from fp8train.loss import lm_loss  # the old way, for contrast: fp32 logits are kept too
    assert torch.float32 in saved_logits(lambda: lm_loss(compiled(x).float(), y)[0])
