"""The end-of-run FP8 verdict (fp8train/precision/verdict.py, summary.json's fp8_verdict) and
compare_runs.py's FP8-against-its-twin rows. Every number is checked against arithmetic done by
hand in the comments. No CUDA here: where a verdict for a GPU run is wanted, the facts of a CPU
run get `emulated=False` (the one thing a GPU would change) and injected layer timings."""
import dataclasses
import importlib.util
import json

import pytest
import torch
from support.runs import ROOT

from fp8train.checkpoint.train_state import TrainState
from fp8train.evaluate.evaluator import EvalRecord
from fp8train.config.load import Config
from fp8train.model import GPT, model_config_from
from fp8train.train import summary
from fp8train.precision import build_precision
from fp8train.precision.verdict import Fp8Facts, describe, facts_of, verdict

A, B, KEPT = (256, 512, False), (512, 256, False), (128, 128, False)
# Converted: 2 layers of A and 1 of B, 6 * 256 * 512 = 786,432 FLOPs per token each; the model's
# total is set so that they are 60% of it: 3 * 786,432 / 0.6.
FLOPS = 3 * 786_432 / 0.6
# Per layer, forward + backward: A 2 ms -> 1 ms (2x), B 3 ms -> 2 ms (1.5x); KEPT loses.
TIMINGS = {A: (2e-3, 1e-3), B: (3e-3, 2e-3), KEPT: (1e-3, 1.2e-3)}


def timed_facts(**kw) -> Fp8Facts:
    f = Fp8Facts(asked=True, label="te", recipe="delayed", base="bf16",
                 converted={"l0": A, "l1": A, "l2": B}, total_linears=4,
                 layer_policy="auto: 2/3 shapes in FP8 (timed at 8,192 tokens)",
                 timings=TIMINGS, timed_tokens=8192)
    return dataclasses.replace(f, **kw)


# 4,096 tokens a step at 102,400 tokens/s: a 40 ms step; 2 micro-batches a step.
STEP = dict(tokens_per_sec=102_400.0, tokens_per_step=4096, accum=2)


def test_timed_run_gets_per_shape_gains_the_flop_bound_and_the_amdahl_estimate():
    v = verdict(timed_facts(), FLOPS, **STEP)
    assert v["status"] == "fp8" and v["layers_converted"] == 3 and v["layers_total"] == 4
    assert v["flop_share"] == pytest.approx(0.6)
    rows = {r["shape"]: r for r in v["timed_shapes"]}
    assert rows["256 × 512"]["speedup"] == pytest.approx(2.0)
    assert rows["256 × 512"]["layers_converted"] == 2
    assert rows["128 × 128"]["layers_converted"] == 0      # timed, kept in bf16
    # One micro-batch through the converted layers: bf16 2*2 + 3 = 7 ms, FP8 2*1 + 2 = 4 ms.
    assert v["converted_gemm_speedup"] == pytest.approx(7 / 4)
    # If the step were its FLOPs: 1 / (0.4 + 0.6 / 1.75) = 1.34615...
    assert v["flop_bound"] == pytest.approx(1 / (0.4 + 0.6 / 1.75))
    # Measured step 40 ms holds 2 x 4 = 8 ms of FP8 GEMMs; in bf16 they would take 2 x 7 = 14:
    # bf16 step 40 - 8 + 14 = 46 ms, speed-up 46 / 40 = 1.15, which is Amdahl's
    # 1 / (1 - 14/46 + (8/46) / 2 + (6/46) / 1.5).
    step = v["step"]
    assert step["measured_step_ms"] == pytest.approx(40.0)
    assert step["bf16_step_estimate_ms"] == pytest.approx(46.0)
    assert step["converted_share_of_bf16_step"] == pytest.approx(14 / 46)
    assert step["expected_speedup"] == pytest.approx(1.15)
    assert step["expected_speedup"] == pytest.approx(
        1 / (1 - 14 / 46 + (8 / 46) / 2 + (6 / 46) / 1.5))
    lines = describe(v)
    assert lines[0] == ("summary: FP8 verdict: te (delayed), 3/4 Linears converted, 60.0% of the "
                        "training FLOPs per token")
    assert "256 × 512 2.00×, 512 × 256 1.50×, 128 × 128 0.83× (kept)" in lines[1]
    assert lines[1].endswith("the converted GEMMs together 1.75×")
    assert "at most 1.35× for the whole step" in lines[2]
    assert lines[3].startswith("summary: FP8 expected step speed-up ≈ 1.15× (estimate: the "
                               "converted GEMMs, 30.4% of an estimated 46.0 ms bf16 step, take "
                               "8.0 ms of this run's 40.0 ms step in FP8)")


def test_what_is_not_known_is_not_claimed():
    # Not timed (fp8_layers all): the FLOP bound at FP8's 2x peak, 1 / (0.4 + 0.3), no estimate.
    v = verdict(timed_facts(timings=None, timed_tokens=None, layer_policy="all"), FLOPS, **STEP)
    assert v["flop_bound"] == pytest.approx(1 / 0.7) and v["flop_bound_gain"] == 2.0
    assert v["step"] is None and v["timed_shapes"] is None
    assert "layers not timed: fp8_layers all" in v["note"]
    assert "not measured" in describe(v)[1]
    # Timed, but no steady state: the gains stand, the step estimate does not.
    v = verdict(timed_facts(), FLOPS, None, 4096, 2)
    assert v["converted_gemm_speedup"] == pytest.approx(1.75) and v["step"] is None
    assert "no steady-state step time" in v["note"]
    # Timings that cannot describe the run (8 ms of FP8 GEMMs in a 4 ms step): no estimate.
    v = verdict(timed_facts(), FLOPS, 1_024_000.0, 4096, 2)
    assert v["step"] is None and "take longer than the measured step" in v["note"]


@pytest.mark.parametrize("facts, status, says", [
    (dict(emulated=True), "emulated", "emulated on CPU"),
    (dict(disabled=True), "switched_off", "switched off after non-finite steps"),
    (dict(disabled=True, off_reason="at fp8_until, for the cool-down"), "switched_off",
     "switched off at fp8_until, for the cool-down"),
    (dict(converted={}), "no_layers", "converted none of the 4 Linear layers"),
])
def test_emulated_switched_off_or_empty_fp8_claims_no_speed_up(facts, status, says):
    v = verdict(timed_facts(**facts), FLOPS, **STEP)
    assert v["status"] == status and says in v["note"]
    assert v["step"] is None and v["flop_bound"] is None and v["converted_gemm_speedup"] is None
    assert not any("≈" in line or "at most" in line for line in describe(v))


def test_a_fallback_says_fp8_did_not_run_and_a_plain_run_has_no_verdict():
    v = verdict(Fp8Facts(asked=True, base="fp32", fallback="te: Transformer Engine needs a "
                         "CUDA GPU"), FLOPS, **STEP)
    assert v["status"] == "fallback" and v["flop_share"] is None and v["step"] is None
    assert describe(v) == ["summary: FP8 verdict: FP8 did not run (te: Transformer Engine needs "
                           "a CUDA GPU): the run trained in fp32 throughout"]
    assert verdict(Fp8Facts(asked=False), FLOPS, **STEP) is None and describe(None) == []


def test_facts_of_a_real_model_count_flops_as_mfu_does_and_keep_the_policy_timings(tmp_path):
    """tiny at 2 layers, seq_len 64, byte vocabulary (256, tied head), every eligible Linear
    converted by the native backend on CPU. Per block qkv 128x384, proj 128x128, fc 128x512,
    proj 512x128: 196,608 weights, 393,216 for two blocks, 6 FLOPs each per token = 2,359,296;
    the total adds the tied head 6 * 256 * 128 and attention 12 * 2 * 128 * 64: 2,752,512.
    Share 6/7. fp8_layers auto gets injected timings (policy.py's timer hook), since nothing is
    timed on a CPU."""
    model = GPT(model_config_from("tiny", vocab_size=256, block_size=64, n_layer=2))
    flops = model.flops_per_token()
    assert flops == 2_752_512
    cfg = Config(use_fp8=True, fp8_backend="native", output_dir=str(tmp_path))
    prec = build_precision(cfg, torch.device("cpu"), warn=pytest.fail)
    times = {(128, 384, True): (2e-3, 1e-3), (128, 128, True): (1e-3, 2e-3),
             (128, 512, True): (3e-3, 1.5e-3), (512, 128, True): (3e-3, 1.5e-3)}
    prec.timer = lambda shape: times[shape]
    prec.set_tokens(256)
    model = prec.convert(model)
    facts = facts_of(prec, model)
    assert facts.emulated and prec.layer_timings == times
    assert facts.converted["blocks.0.attn.qkv"] == (128, 384, True)
    # auto kept the two 128 x 128 projections (FP8 slower): 6 converted, 6/7 - 6*2*16,384/flops.
    assert len(facts.converted) == 6 and "blocks.1.attn.proj" not in facts.converted
    v = verdict(dataclasses.replace(facts, emulated=False), flops, 512.0, 512, 1)
    assert v["flop_share"] == pytest.approx((2_359_296 - 6 * 2 * 16_384) / 2_752_512)
    # Converted per micro-batch: 2 x (2 + 3 + 3) = 16 ms in bf16, 2 x (1 + 1.5 + 1.5) = 8 ms in
    # FP8; the step (512 tokens at 512 tokens/s) is 1 s: bf16 1 - 0.008 + 0.016 = 1.008 s.
    assert v["converted_gemm_speedup"] == pytest.approx(2.0)
    assert v["step"]["expected_speedup"] == pytest.approx(1.008)


class _Ended:
    """A precision as a run ends: what it derived, and its state (fp8_until's hand-over)."""

    def __init__(self, state=None, **derived):
        self._state, self._derived = dict(state or {}), derived

    def derived(self):
        return dict(self._derived)

    def state_dict(self):
        return dict(self._state)


def _state(steady_tokens=40_960, steady_seconds=0.4):
    st = TrainState()
    st.step, st.tokens, st.train_seconds, st.wall_seconds = 10, 40_960, 0.5, 0.6
    st.steady_tokens, st.steady_seconds = steady_tokens, steady_seconds
    return st


FACTS = dict(target_val_loss=None, world_size=1, total_steps=10, flops_per_token=FLOPS,
             peak_flops=None, micro_batch_size=2, gradient_accumulation_steps=2,
             effective_batch_size=4, tokens_per_step=4096, model="tiny", n_params=1000)
OUTCOME = dict(status="completed", exit_code=0, final_val=(10, 3.0), latest_checkpoint=None,
               peak_memory_gb=None)


def test_summary_adds_the_verdict_and_its_lines_and_keeps_its_keys():
    """summary.build from the run's steady state: 40,960 tokens in 0.4 s = 102,400 tokens/s,
    the 40 ms step of the hand-checked case above."""
    plain = summary.build(FACTS, _state(), EvalRecord(), _Ended(precision="bf16", fp8="off"),
                          OUTCOME)
    assert plain["fp8_verdict"] is None and plain["tokens_fp8"] is None
    assert not any("FP8" in line for line in summary.describe(plain))
    s = summary.build(FACTS, _state(), EvalRecord(),
                      _Ended(dict(handed_over_tokens=32_768), precision="bf16", fp8="te",
                             fp8_layers=3), OUTCOME, fp8=timed_facts())
    assert set(s) == set(plain)
    assert s["tokens_per_sec"] == pytest.approx(102_400.0)
    assert s["fp8_verdict"]["step"]["expected_speedup"] == pytest.approx(1.15)
    assert (s["tokens_fp8"], s["tokens_after_fp8"]) == (32_768, 40_960 - 32_768)
    json.dumps(s)   # summary.json takes it as it is
    assert any(line.startswith("summary: FP8 expected step speed-up ≈ 1.15×")
               for line in summary.describe(s))


# --- compare_runs.py: FP8 against its twin --------------------------------------------------------

def _compare_module():
    spec = importlib.util.spec_from_file_location("compare_runs",
                                                  ROOT / "scripts" / "compare_runs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run_dir(path, use_fp8, tokens_per_sec, vals, verdict_=None):
    """A run directory as train_fp8.py writes it: config.yaml, summary.json, metrics.jsonl
    (train rows between the val rows; each val row with its step, tokens and times)."""
    path.mkdir()
    (path / "config.yaml").write_text(f"model: tiny\nlearning_rate: 0.003\nuse_fp8: "
                                      f"{'true' if use_fp8 else 'false'}\nfp8_backend: te\n")
    (path / "summary.json").write_text(json.dumps(dict(
        status="completed", steps=400, total_steps=400, tokens=400 * 4096,
        tokens_per_sec=tokens_per_sec, precision="bf16", fp8="te" if use_fp8 else "off",
        fp8_layers_converted=36 if use_fp8 else 0, fp8_verdict=verdict_)))
    rows = []
    for step, loss, train_s in vals:
        rows.append({"step": step, "tokens": step * 4096, "train/loss": loss + 0.1})
        rows.append({"step": step, "tokens": step * 4096, "val/loss": loss,
                     "time/train_s": train_s, "time/wall_s": train_s + 5})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _table(stdout):
    return {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in stdout.splitlines() if line.startswith("| ") and "---" not in line}


def test_compare_runs_reports_tokens_and_time_to_the_same_loss_for_fp8_and_its_twin(
        tmp_path, capsys):
    # best val/loss: FP8 2.2, bf16 2.3 -> both reached 2.3. FP8 first <= 2.3 at step 200 (100 s;
    # its loss rose again after), bf16 at step 300 (180 s): 100 / 180 = 0.556. Tokens/s 1170 /
    # 1000 = 1.170.
    fp8 = _run_dir(tmp_path / "fp8", True, 1170.0,
                   [(100, 3.0, 50.0), (200, 2.25, 100.0), (300, 2.4, 150.0), (400, 2.2, 200.0)],
                   verdict_={"status": "fp8", "step": {"expected_speedup": 1.1234}})
    bf16 = _run_dir(tmp_path / "bf16", False, 1000.0,
                    [(100, 3.1, 60.0), (200, 2.4, 120.0), (300, 2.3, 180.0), (400, 2.35, 240.0)])
    mod = _compare_module()
    assert mod.main([str(fp8), str(bf16), "--out", str(tmp_path / "cmp"), "--no_plot"]) == 0
    t = _table(capsys.readouterr().out)
    assert t[""] == ["fp8", "bf16"]
    assert t["twin without FP8"] == ["bf16", "twin of fp8"]
    assert t["tokens/s FP8 / twin"] == ["1.170×", "–"]
    assert t["val/loss both reached"] == ["2.3000", "–"]
    assert t["training time to it (FP8 / twin)"][0] == "0:01:40 (step 200) / 0:03:00 (step 300)"
    assert t["time to it FP8 / twin"] == ["0.556×", "–"]
    assert t["FP8 verdict (this run's own)"][0] == "≈1.12× expected (estimate)"

    # A twin without val rows: the rows say why instead of a number. The same --out again
    # keeps the earlier comparison unless --overwrite says to replace it.
    (bf16 / "metrics.jsonl").write_text(json.dumps({"step": 10, "train/loss": 3.0}) + "\n")
    before = (tmp_path / "cmp" / "compare.md").read_text()
    assert mod.main([str(fp8), str(bf16), "--out", str(tmp_path / "cmp"), "--no_plot"]) == 2
    assert capsys.readouterr().err == (f"error: '{tmp_path / 'cmp'}' holds an earlier comparison "
                                       "(compare.md); pass --overwrite to replace it, or --out "
                                       "another folder\n")
    assert (tmp_path / "cmp" / "compare.md").read_text() == before
    (tmp_path / "cmp" / "val_loss.png").write_bytes(b"a plot of other runs")
    assert mod.main([str(fp8), str(bf16), "--out", str(tmp_path / "cmp"), "--no_plot",
                     "--overwrite"]) == 0
    assert not (tmp_path / "cmp" / "val_loss.png").exists()
    t = _table(capsys.readouterr().out)
    assert t["time to it FP8 / twin"][0] == "n/a (bf16: no val rows)"
    assert t["tokens/s FP8 / twin"][0] == "1.170×"


def test_compare_runs_writes_under_runs_by_default(tmp_path, monkeypatch, capsys):
    """Without --out the comparison goes to runs/compare (ignored by git, beside the runs),
    not into the current folder."""
    runs = [_run_dir(tmp_path / name, fp8, 1000.0, [(100, 3.0, 50.0)])
            for name, fp8 in (("a", True), ("b", False))]
    summary = json.loads((runs[0] / "summary.json").read_text())
    summary["hellaswag"] = dict(acc=0.28, acc_norm=0.295, acc_norm_by="token", examples=10042,
                                step=400)
    (runs[0] / "summary.json").write_text(json.dumps(summary))
    monkeypatch.chdir(tmp_path)
    assert _compare_module().main([str(r) for r in runs]) == 0
    t = _table(capsys.readouterr().out)
    assert t["HellaSwag acc / acc_norm"] == ["0.2800 / 0.2950 (10,042 examples, step 400)", "–"]
    assert (tmp_path / "runs" / "compare" / "compare.md").is_file()
    assert (tmp_path / "runs" / "compare" / "val_loss.png").is_file()
    assert not (tmp_path / "compare").exists()


def test_each_fp8_run_finds_the_twin_that_differs_only_in_precision_keys():
    from fp8train.analysis.compare import twins
    configs = [dict(use_fp8=True, fp8_backend="te", learning_rate=1e-3, output_dir="a"),
               dict(use_fp8=False, fp8_backend="te", learning_rate=2e-3, output_dir="b"),
               dict(use_fp8=False, precision="bf16", learning_rate=1e-3, output_dir="c"),
               dict(use_fp8=True, fp8_backend="torchao", learning_rate=3e-3, output_dir="d")]
    pairs, notes = twins(list("abcd"), [{}] * 4, configs)
    assert pairs == {0: 2}    # b differs in learning_rate; d has no twin
    assert len(notes) == 1 and notes[0].startswith("d: no single run without FP8")
    # With one run without FP8, every FP8 run is compared with it.
    assert twins(list("ab"), [{}, {}], [configs[3], configs[1]])[0] == {0: 1}


def test_an_fp32_base_gets_no_untimed_bound_and_unknown_shapes_no_step_estimate():
    """Without timings the bound assumes FP8's peak is twice the base's, true of bf16 and fp16
    only (over TF32 it is 4x): an fp32 base gets no bound. A converted layer whose shape is
    unknown (a wrapper renamed it) would leave its GEMMs out of the step estimate: none then."""
    v = verdict(timed_facts(base="fp32", timings=None, timed_tokens=None, layer_policy="all"),
                FLOPS, **STEP)
    assert v["flop_share"] == pytest.approx(0.6) and v["flop_bound"] is None
    assert not [line for line in describe(v) if "bound" in line]
    v = verdict(timed_facts(converted={"l0": A, "l1": A, "l2": B, "l3": None}), FLOPS, **STEP)
    assert v["flop_share"] is None and v["step"] is None
    assert v["converted_gemm_speedup"] == pytest.approx(7 / 4)   # the timed shapes themselves
    assert v["note"].startswith("no step speed-up estimate (1 converted layers of unknown shape)")
