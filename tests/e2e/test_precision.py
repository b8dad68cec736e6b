"""FP8 numerics on CPU: the native Linear against fp32 matmuls, TE's delayed-scaling semantics
checked step by step against a plain-Python reference, the hybrid format, layer selection, the
TE recipe as TE's own class builds it, and torchao's conversion."""


import pytest
import torch
from support.precision_shared import CPU, tiny_model

from fp8train.config.load import Config
from fp8train.precision import build_precision


def test_torchao_scale_probe_compiles_without_a_graph_break_and_reads_what_eager_reads():
    """The scale read-out of torchao (and TE) layers runs inside the compiled graph: on an H200
    its tensor hooks broke llama-1b's graph at every layer, which made the first logged step
    fall back to eager frames and recompile for about 35 s. fullgraph=True raises on any graph
    break; the scales and amaxes equal eager's, and the gradient statistics come from the
    compiled backward."""
    pytest.importorskip("torchao")
    torch.manual_seed(0)
    cfg = Config(use_fp8=True, fp8_backend="torchao", fp8_layers="all")
    prec = build_precision(cfg, CPU, warn=pytest.fail)
    model = prec.convert(tiny_model())
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randint(0, 256, (2, 64))

    def watched_step(m):
        prec.watch(True)
        m(x).float().pow(2).mean().backward()
        stats = {k: v.item() for k, v in prec.stats().items()}
        prec.watch(False)
        return stats

    eager, graph = watched_step(model), watched_step(compiled)
    compiled(x).float().pow(2).mean().backward()    # an unwatched step: the other graph
    assert set(graph) == set(eager) and len(eager) == 5 + 12 * len(prec.selection.chosen)
    # Each layer's weight statistics are eager's (the rows are the right layers'); activations
    # and gradients differ by the compiled kernels' rounding, compounded by FP8's, so they are
    # checked for what they must be: each scale is fp8_max / amax of its own tensor (E4M3 448
    # forward, E5M2 57344 for gradients), the amax close to eager's.
    for layer in prec.selection.chosen:
        def get(stats, k):
            return stats[f"fp8/{layer}/{k}"]
        for kind in ("weight", "input"):
            assert get(graph, f"amax_{kind}") == pytest.approx(
                get(eager, f"amax_{kind}"), rel=1e-5 if kind == "weight" else 0.1)
            assert get(graph, f"fwd_scale_{kind}") == pytest.approx(
                448.0 / get(graph, f"amax_{kind}"), rel=1e-5)
        assert get(graph, "amax_grad_output") == pytest.approx(
            get(eager, "amax_grad_output"), rel=0.2)
        assert get(graph, "bwd_scale_grad_output") == pytest.approx(
            57344.0 / get(graph, "amax_grad_output"), rel=1e-5)
    assert graph["fp8/blocks.3.mlp.proj/bwd_scale_grad_output"] > 0
    assert watched_step(compiled) == graph          # the watched graph again, same numbers
