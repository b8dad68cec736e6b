"""End to end through the real entry point (`python train_fp8.py ...` in a subprocess, real
Accelerate, real tinyshakespeare): training, evaluation, checkpoints, exact resume."""
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import yaml
from safetensors.torch import load_file
from support.runs import DATA_DIR, ROOT, TORCHRUN, rows, run_train, tiny_args, untimed

CONTRACT_TRAIN_KEYS = {"step", "tokens", "train/loss", "train/lr", "train/grad_norm",
                       "train/tokens_per_sec"}
CONTRACT_VAL_KEYS = {"step", "tokens", "val/loss", "val/ppl"}


def final_params(run_dir):
    latest = open(os.path.join(run_dir, "checkpoints", "latest")).read().strip()
    return load_file(os.path.join(run_dir, "checkpoints", latest, "model.safetensors"))


def assert_same_training(a, b):
    """Two runs that saw the same data: parameters and losses equal up to float summation
    order (measured differences ~5e-6)."""
    pa, pb = final_params(a), final_params(b)
    assert pa.keys() == pb.keys()
    for k in pa:
        np.testing.assert_allclose(pa[k].numpy(), pb[k].numpy(), atol=1e-4, rtol=0)
    for key in ("train/loss", "val/loss"):
        la = [x[key] for x in rows(a) if key in x]
        lb = [x[key] for x in rows(b) if key in x]
        assert la and len(la) == len(lb)
        np.testing.assert_allclose(la, lb, rtol=1e-5)


def byte_unigram_entropy() -> float:
    raw = np.frombuffer(open(os.path.join(DATA_DIR, "tinyshakespeare.txt"), "rb").read(), np.uint8)
    p = np.bincount(raw, minlength=256) / len(raw)
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


# Trained here (no FP8TRAIN_DEMO_RUN), the demo takes minutes on every core: it runs alone.
TRAINS_THE_DEMO = not os.environ.get("FP8TRAIN_DEMO_RUN")


@pytest.mark.slow
@(pytest.mark.alone if TRAINS_THE_DEMO else pytest.mark.usefixtures())
def test_demo_config_trains_well_below_the_unigram_baseline(tmp_path):
    """The README's quick-start command, with only the run directory moved. CI runs that very
    command just before the tests and names its run directory in FP8TRAIN_DEMO_RUN: then that
    run is checked (its config must be the demo config) instead of training it a second time."""
    given = os.environ.get("FP8TRAIN_DEMO_RUN")
    if given:
        out = Path(given)
        resolved = yaml.safe_load(open(out / "config.yaml"))
        demo = yaml.safe_load(open(ROOT / "configs" / "test_fp8.yaml"))
        assert {k: resolved[k] for k in demo} == demo, "FP8TRAIN_DEMO_RUN is not the demo run"
        console = (out / "train.log").read_text()
    else:
        out = tmp_path / "demo"
        # Under pytest-xdist the suite's processes get one thread each: this one gets them all.
        every_core = {"OMP_NUM_THREADS": str(len(os.sched_getaffinity(0)))}
        r = run_train("--config", "configs/test_fp8.yaml", "--output_dir", out,
                      env=every_core if os.environ.get("PYTEST_XDIST_WORKER") else None)
        assert r.returncode == 0, r.stderr[-3000:]
        console = r.stdout
    assert "batch plan: micro 24 × accum 1 × 1 device" in console
    log = rows(out)
    train = [x for x in log if "train/loss" in x]
    val = [x for x in log if "val/loss" in x]
    assert train and val and all(CONTRACT_TRAIN_KEYS <= set(x) for x in train)
    assert all(CONTRACT_VAL_KEYS <= set(x) for x in val)
    assert "train/mfu" not in train[-1]  # CPU: no peak to compare with, so no MFU at all
    cfg = yaml.safe_load(open(out / "config.yaml"))
    final = val[-1]
    assert final["step"] == cfg["derived"]["total_steps"] == cfg["max_steps"]
    unigram = byte_unigram_entropy()  # 3.31 nats
    assert final["val/loss"] < unigram - 1.0, (final, unigram)
    assert final["val/ppl"] == pytest.approx(math.exp(final["val/loss"]), rel=1e-6)
    assert train[-1]["train/loss"] < train[0]["train/loss"]
    assert cfg["derived"]["precision"] == "fp32" and cfg["derived"]["world_size"] == 1
    # The demo trains its Linears in FP8 (native backend, emulated here) and logs the scales.
    assert cfg["derived"]["fp8"] == "native (emulated on CPU)"
    assert cfg["derived"]["fp8_layers"] == 16
    assert all({"fp8/fwd_scale", "fp8/bwd_scale", "fp8/amax"} <= set(x) for x in train)
    ckpt = out / "checkpoints"
    latest = (ckpt / "latest").read_text().strip()
    assert latest == f"step_{final['step']:07d}"
    assert {"model.safetensors", "optimizer.bin", "random_states_0.pkl",
            "train_state.json"} <= set(os.listdir(ckpt / latest))
    assert len([d for d in os.listdir(ckpt) if d.startswith("step_")]) == 3  # keep_checkpoints
    assert "done at step" in (out / "train.log").read_text()


def test_resume_is_bit_exact(tmp_path):
    """N steps straight == N/2 steps, stop, resume to N: same params, same losses. Dropout is
    on so that the restored RNG state matters too. The schedule is wsd, stopped in the middle of
    its decay (steps 6 to 12 of 12; the cosine's resume is in every other resume test)."""
    common = dict(lr_decay_steps=12,  # the schedule must not depend on where we stop
                  dropout=0.1, lr_schedule="wsd", lr_decay_fraction=0.75)
    a, b = tmp_path / "straight", tmp_path / "stopped"
    assert run_train(*tiny_args(a, max_steps=12, **common)).returncode == 0
    r1 = run_train(*tiny_args(b, max_steps=6, **common))
    assert r1.returncode == 0, r1.stderr[-2000:]
    r2 = run_train(*tiny_args(b, max_steps=12, **common), "--resume")
    assert r2.returncode == 0, r2.stderr[-2000:]
    assert "resumed from" in r2.stdout and "at step 6" in r2.stdout
    pa, pb = final_params(a), final_params(b)
    assert pa.keys() == pb.keys()
    for k in pa:
        assert (pa[k] == pb[k]).all(), k
    # Evaluations match exactly; so do train rows whose averaging window (the steps since the
    # previous log line) is the same in both runs: not step 8, whose window the stop cut.
    pick = lambda rs, key, steps: [untimed(x) for x in rs if key in x and x["step"] in steps]
    assert pick(rows(a), "val/loss", {6, 12}) == pick(rows(b), "val/loss", {6, 12})
    assert pick(rows(a), "train/loss", {4, 12}) == pick(rows(b), "train/loss", {4, 12})
    assert len(pick(rows(a), "train/loss", {4, 12})) == 2


def test_micro_batch_split_does_not_change_training(tmp_path):
    """Same effective batch as 8 × 2 or 16 × 1: the same sequences, the same update (up to
    float summation order)."""
    a, b = tmp_path / "a", tmp_path / "b"
    assert run_train(*tiny_args(a, batch_size=8, gradient_accumulation_steps=2)).returncode == 0
    assert run_train(*tiny_args(b, batch_size=16, gradient_accumulation_steps=1)).returncode == 0
    assert_same_training(a, b)


def test_existing_checkpoints_are_never_overwritten_silently(tmp_path):
    out = tmp_path / "run"
    assert run_train(*tiny_args(out, max_steps=6)).returncode == 0
    r = run_train(*tiny_args(out, max_steps=6))
    assert r.returncode == 2 and "already holds checkpoints" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = run_train(*tiny_args(out, max_steps=6), "--resume=auto")
    assert r.returncode == 0 and "nothing to do" in r.stdout
    r = run_train(*tiny_args(out, max_steps=8, learning_rate=0.01), "--resume")
    assert r.returncode == 2 and "learning_rate 0.003 -> 0.01" in r.stderr   # refused ...
    r = run_train(*tiny_args(out, max_steps=8, learning_rate=0.01), "--resume",
                  "--allow_config_change")                                  # ... unless allowed
    assert r.returncode == 0 and "differ from the checkpoint's" in r.stderr
    assert "learning_rate 0.003 -> 0.01" in r.stderr and "max_steps" not in r.stderr
    # a longer run stretches the cosine: allowed, but the LR jump is said, with its numbers
    assert "the LR schedule is now 8 steps long, the checkpoint's run had 6" in r.stderr
    assert "the LR at step 7 is" in r.stderr
    r = run_train(*tiny_args(out, max_steps=12, n_layer=3, learning_rate=0.01), "--resume",
                  "--allow_config_change")                                  # another model
    assert r.returncode == 2 and "cannot resume from" in r.stderr and "Traceback" not in r.stderr
    assert len([line for line in r.stderr.splitlines() if line.startswith("error:")]) == 1


def test_max_hours_stops_with_a_checkpoint_and_resumes(tmp_path):
    out = tmp_path / "run"
    r = run_train(*tiny_args(out, max_hours=1e-7))
    assert r.returncode == 0 and "stopped early: max_hours" in r.stdout
    step = rows(out)[-1]["step"]
    assert step == 1  # one process checks the clock after every step
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_0000001"
    r = run_train(*tiny_args(out), "--resume")
    assert r.returncode == 0 and rows(out)[-1]["step"] == 12


def test_penalty_is_logged_separately(tmp_path):
    out = tmp_path / "run"
    r = run_train(*tiny_args(out, max_steps=4, penalty_type="z_loss", penalty_weight=1e-3,
                             model="tiny-llama"))
    assert r.returncode == 0, r.stderr[-2000:]
    last = [x for x in rows(out) if "train/loss" in x][-1]
    assert last["train/penalty"] > 0
    assert last["train/total_loss"] == pytest.approx(last["train/loss"] + last["train/penalty"])


@pytest.mark.parametrize("extra,expected", [
    (["--dataset=openwebtext"], "dataset 'openwebtext' is not prepared"),
    (["--warmup_steps=500", "--max_steps=null", "--num_epochs=0.01"], "key 'warmup_steps'"),
])
def test_bad_input_found_at_start_stops_with_exit_2(tmp_path, extra, expected):
    r = run_train(*tiny_args(tmp_path / "run"), *extra)
    assert r.returncode == 2, r.stdout + r.stderr
    assert expected in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_missing_dataset_offline_exits_2_naming_the_path(tmp_path):
    r = run_train(*tiny_args(tmp_path / "run", data_dir=tmp_path / "empty"),
                  env={"FP8TRAIN_OFFLINE": "1"})
    assert r.returncode == 2
    assert str(tmp_path / "empty" / "tinyshakespeare.txt") in r.stderr
    assert "Traceback" not in r.stderr


def test_two_processes_match_one_process_with_the_same_effective_batch(tmp_path):
    """DDP over gloo (torchrun, 2 CPU processes, micro 4 × accum 1 × 2) against one process
    (micro 4 × accum 2 × 1): the same sequences, so the same losses and parameters up to float
    summation order (measured difference ~3e-6)."""
    import subprocess
    one, two = tmp_path / "one", tmp_path / "two"
    assert run_train(*tiny_args(one, batch_size=4, gradient_accumulation_steps=2,
                                max_steps=8)).returncode == 0
    env = dict(os.environ, FP8TRAIN_DATA_DIR=DATA_DIR)
    r = subprocess.run([*TORCHRUN, "--nproc_per_node", "2",
                        "train_fp8.py", *tiny_args(two, batch_size=4,
                                                   gradient_accumulation_steps=1, max_steps=8)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "batch plan: micro 4 × accum 1 × 2 devices" in r.stdout
    assert r.stdout.count("done at step 8") == 1  # rank 0 alone prints
    assert os.path.isfile(two / "checkpoints" / "step_0000008" / "random_states_1.pkl")
    assert_same_training(one, two)


def test_bf16_autocast_on_cpu_tracks_fp32(tmp_path):
    """precision: bf16 really runs under bf16 autocast (on CPU here, as on GPU): the losses
    differ from fp32 a little, not a lot."""
    a, b = tmp_path / "fp32", tmp_path / "bf16"
    assert run_train(*tiny_args(a, precision="fp32", max_steps=8)).returncode == 0
    r = run_train(*tiny_args(b, precision="bf16", max_steps=8))
    assert r.returncode == 0, r.stderr[-2000:]
    assert yaml.safe_load(open(b / "config.yaml"))["derived"]["precision"] == "bf16"
    la = [x["val/loss"] for x in rows(a) if "val/loss" in x]
    lb = [x["val/loss"] for x in rows(b) if "val/loss" in x]
    assert la != lb
    np.testing.assert_allclose(la, lb, rtol=0.02)


@pytest.mark.slow
def test_compiled_model_trains_and_checkpoints_like_eager(tmp_path):
    """--compile compiles each block (one graph for both, and one for the output layer and
    loss): the first step ran those graphs (counted by dynamo: a compile that silently does not
    run fails here), with eager's numbers (up to kernel fusion), and checkpoints that either
    mode can load (no _orig_mod. prefixes). The whole-model scope: tests/e2e/test_compile.py."""
    import subprocess
    import sys
    a, b = tmp_path / "eager", tmp_path / "compiled"
    assert run_train(*tiny_args(a, max_steps=4, eval_interval=4)).returncode == 0
    counts = tmp_path / "graphs.json"
    r = subprocess.run([sys.executable, "tests/support/train_counting_graphs.py",
                        *tiny_args(b, max_steps=4, eval_interval=4), "--compile"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, FP8TRAIN_DATA_DIR=DATA_DIR,
                                FP8TRAIN_GRAPHS_JSON=str(counts)))
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(counts.read_text())["graphs"] == 2
    assert "compile: per block (2 Block blocks" in r.stdout
    pa, pb = final_params(a), final_params(b)
    assert pa.keys() == pb.keys()
    np.testing.assert_allclose([x["val/loss"] for x in rows(a) if "val/loss" in x],
                               [x["val/loss"] for x in rows(b) if "val/loss" in x], rtol=1e-3)
    r = run_train(*tiny_args(b, max_steps=8, eval_interval=4), "--resume")  # eager resume
    assert r.returncode == 0 and "at step 4" in r.stdout


def test_a_data_error_on_rank_0_stops_every_rank(tmp_path):
    """Rank 0 fetches the corpus while the others wait; when it fails, all ranks get the error
    (no rank left waiting at a barrier)."""
    import subprocess
    env = dict(os.environ, FP8TRAIN_OFFLINE="1")
    r = subprocess.run([*TORCHRUN, "--nproc_per_node", "2",
                        "train_fp8.py", *tiny_args(tmp_path / "run",
                                                   data_dir=tmp_path / "nothing-here")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "error: dataset 'tinyshakespeare' not found" in r.stderr
    assert "exitcode  : 2" in r.stderr  # rank 0 exited through the one-line error path


def test_output_dir_that_cannot_be_created_exits_2(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    r = run_train(*tiny_args(blocker / "run"))
    assert r.returncode == 2 and "key 'output_dir': cannot create" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_uneven_eval_batches_over_two_ranks_give_the_one_process_val_loss(tmp_path):
    """20 validation sequences in micro-batches of 4 = 5 batches over 2 ranks: rank 1 runs a
    weight-0 extra forward (so every rank does the same number, as FSDP needs) and the val
    loss is still the mean over exactly the 20 sequences."""
    import subprocess
    kw = dict(batch_size=4, max_steps=2, warmup_steps=1, eval_sequences=20, eval_interval=2,
              eval_samples=0)
    one, two = tmp_path / "one", tmp_path / "two"
    assert run_train(*tiny_args(one, gradient_accumulation_steps=2, **kw)).returncode == 0
    env = dict(os.environ, FP8TRAIN_DATA_DIR=DATA_DIR)
    r = subprocess.run([*TORCHRUN, "--nproc_per_node", "2",
                        "train_fp8.py", *tiny_args(two, gradient_accumulation_steps=1, **kw)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    val = lambda d: [x["val/loss"] for x in rows(d) if "val/loss" in x]
    np.testing.assert_allclose(val(two), val(one), rtol=1e-5)


def test_what_ends_a_run_is_in_train_log_too(tmp_path):
    """train.log is what the console showed: a refused resume (exit 2) and a run that fails on
    its way (its last checkpoint cannot be written: exit 1) end it with their error line."""
    def error_line(r):
        return [line for line in r.stderr.splitlines() if line.startswith("error: ")][-1]

    short = dict(max_steps=2, warmup_steps=1, eval_sequences=8)
    out = tmp_path / "run"
    assert run_train(*tiny_args(out, **short)).returncode == 0
    r = run_train(*tiny_args(out, **dict(short, max_steps=4, learning_rate=0.01)), "--resume")
    assert r.returncode == 2 and "learning_rate 0.003 -> 0.01" in r.stderr
    assert (out / "train.log").read_text().rstrip().endswith(error_line(r))
    failing = tmp_path / "failing"
    r = run_train(*tiny_args(failing, **short, checkpoint_interval=100),
                  env={"FP8TRAIN_FAULTS": "fail@save:2"})
    assert r.returncode == 1 and "could not be written" in r.stderr
    assert (failing / "train.log").read_text().rstrip().endswith(error_line(r))
