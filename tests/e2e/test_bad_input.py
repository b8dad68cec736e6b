"""Bad input, end to end: every failure a user can cause with a config file, a command-line
flag, a data path or a checkpoint path ends `python train_fp8.py ...` with exit code 2 and
exactly one line on stderr, "error: ...", naming the file, key or path; never a traceback.

The corpus is the CASES table below: one row per bad input. To add one, append a Case:

    Case("short-id", argv=["--seq_len=7"], expect="key 'seq_len'")

`argv` follows the fast tiny-run arguments (conftest.tiny_args with FAST; prefix="bare":
only `--output_dir={d}/out`), so a case that is wrongly accepted trains for seconds in a
temporary folder, not for hours in runs/. In argv, expect, files and env these placeholders
are replaced:

    {d}       the case's own empty temporary directory
    {corpus}  tinyshakespeare.txt from the test data dir (conftest.DATA_DIR)
    {run}     (needs_run=True) a private copy of a real tiny run that finished 2 steps with
              checkpoints at steps 1 and 2 (made once per session by train_fp8.py itself)

`files` creates inputs under {d} (text, bytes, or DIR for a directory); `setup(d)` builds
what files cannot express. All cases run as real subprocesses, a few at a time, from one
session fixture (each one that imports torch costs seconds); each test only checks its
result.
"""
from __future__ import annotations

import shutil
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from support import (bad_cases_checkpoint, bad_cases_config, bad_cases_data, bad_cases_model,
                     bad_cases_prepare, bad_cases_run, bad_cases_tools)
from support.bad_input_kit import (CORPUS, DEAD_PROXY, DIR, FAST, OFFLINE_TOKENIZERS, TIMEOUT,
                                   WORKERS, Case, corrupt_checkpoint,
                                   corrupt_checkpoint_without_manifest, meta_not_json,
                                   meta_without_vocab, missing_shard, prepared_with_gpt2,
                                   short_val_split, truncated_shard, write_files, yaml_case)
from support.runs import run_train, tiny_args

# --- the corpus: the general cases here; each area adds its own in tests/support/bad_cases_<area>.py ---

CASES = [
    # config files ------------------------------------------------------------------------------
    Case("config-missing", ["--config", "{d}/nope.yaml"], prefix="bare",
         expect="config file '{d}/nope.yaml' not found"),
    Case("config-is-a-directory", ["--config", "{d}/cfg"], prefix="bare", files={"cfg": DIR},
         expect="config file '{d}/cfg' is a directory"),
    Case("config-empty", ["--config", "{d}/x.yaml"], prefix="bare", files={"x.yaml": ""},
         expect="{d}/x.yaml: file is empty"),
    yaml_case("config-invalid-yaml", "seq_len: 64\nfp8_exclude: [lm_head, wte\n",
              expect="{d}/x.yaml: not valid YAML (line 3"),
    yaml_case("config-invalid-yaml-mapping-value", "seq_len: 64\nbatch_size: 8: 16\n",
              expect="{d}/x.yaml: not valid YAML (line 2"),
    yaml_case("config-list-not-mapping", "- seq_len: 64\n- batch_size: 8\n",
              expect="{d}/x.yaml: expected a mapping of key: value, got a list"),
    yaml_case("config-scalar-not-mapping", "just some text\n",
              expect="{d}/x.yaml: expected a mapping of key: value, got a str"),
    yaml_case("config-unknown-key", "seq_len: 64\nlerning_rate: 0.1\n",
              expect="unknown key 'lerning_rate' in {d}/x.yaml (did you mean 'learning_rate'?)"),
    yaml_case("config-wrong-type", "seq_len: long\n",
              expect="{d}/x.yaml: key 'seq_len' must be an integer >= 8, got 'long'"),
    yaml_case("config-null-for-required", "batch_size: null\n",
              expect="{d}/x.yaml: key 'batch_size' must be an integer >= 1, got None"),
    yaml_case("config-out-of-range", "batch_size: 0\n",
              expect="{d}/x.yaml: key 'batch_size' must be an integer >= 1, got 0"),
    yaml_case("config-bad-choice", "precision: fp64\n",
              expect="{d}/x.yaml: key 'precision' must be one of auto, bf16, fp32, fp16, got 'fp64'"),
    yaml_case("config-nested-mapping", "model:\n  n_layer: 2\n  n_head: 2\n",
              expect=("{d}/x.yaml: key 'model'", "no nesting")),
    yaml_case("config-not-utf8", b"dataset: caf\xe9.txt\n",
              expect="cannot read config file '{d}/x.yaml'"),
    yaml_case("config-cross-key-names-the-file", "max_steps: 50\nwarmup_steps: 100\n",
              expect="{d}/x.yaml: key 'warmup_steps' (100) must be smaller than max_steps (50)"),

    # cross-key validation ------------------------------------------------------------------------
    Case("warmup-not-below-max-steps", ["--warmup_steps=10", "--max_steps=10"],
         expect="key 'warmup_steps' (10) must be smaller than max_steps (10)"),
    Case("penalty-weight-without-type", ["--penalty_weight=0.1"],
         expect="--penalty_weight=0.1: key 'penalty_weight' (0.1) applies only with "
                "penalty_type: z_loss or logit_l2, but penalty_type is 'none', so it would do "
                "nothing; remove it or change penalty_type"),
    Case("auto-batch-without-target", ["--auto_batch_size"],
         expect="key 'auto_batch_size' (true) applies only with target_effective_batch_size "
                "set, but target_effective_batch_size is null"),
    Case("n-embd-not-divisible-by-n-head", ["--n_embd=100", "--n_head=3"],
         expect="key 'n_embd' (100) must be divisible by n_head (3)"),
    Case("no-epochs-and-no-max-steps", ["--num_epochs=null", "--max_steps=null"],
         expect="keys 'num_epochs' and 'max_steps' are both null"),
    Case("fp8-seq-len-not-multiple-of-16", ["--use_fp8", "--seq_len=24"],
         expect="key 'seq_len' (24) must be a multiple of 16 with use_fp8"),
    Case("lr-scaling-without-reference", ["--lr_scaling=sqrt"],
         expect="key 'lr_scaling' ('sqrt') applies only with lr_reference_batch_size set, "
                "but lr_reference_batch_size is null"),
    Case("n-head-does-not-divide-preset-width", ["--n_head=5"],       # found once torch is up
         expect="model 'tiny': n_embd 128 is not divisible by n_head 5"),
    Case("target-batch-inconsistent", ["--target_effective_batch_size=5"],
         expect="but target_effective_batch_size is 5"),

    # command line --------------------------------------------------------------------------------
    Case("cli-unknown-option", ["--lerning_rate=0.1"],
         expect="unknown option '--lerning_rate' in the command line "
                "(did you mean '--learning_rate'?)"),
    Case("cli-option-missing-value", ["--seq_len"],
         expect="option '--seq_len' needs a value (an integer >= 8)"),
    Case("cli-option-missing-value-before-option", ["--max_steps", "--seq_len=32"],
         expect="option '--max_steps' needs a value"),
    Case("cli-positional-argument", ["stray.yaml"],
         expect="unexpected argument 'stray.yaml' on the command line"),
    Case("cli-single-dash", ["-seq_len=32"], expect="unexpected argument '-seq_len=32'"),
    Case("cli-bad-bool", ["--use_fp8=maybe"],
         expect="the command line: key 'use_fp8' must be true or false, got 'maybe'"),
    Case("cli-wrong-type", ["--batch_size=two"],
         expect="the command line: key 'batch_size' must be an integer >= 1, got 'two'"),
    Case("cli-config-without-path", ["--config"], expect="option '--config' needs a file path"),
    Case("cli-config-followed-by-option", ["--config", "--seq_len=32"], prefix="bare",
         expect="option '--config' needs a file path"),

    # data ----------------------------------------------------------------------------------------
    Case("dataset-txt-missing", ["--dataset={d}/missing.txt"],
         expect="key 'dataset': file '{d}/missing.txt' not found"),
    Case("dataset-unknown-name", ["--dataset=shakespeare"],
         expect="key 'dataset': 'shakespeare' is neither a known dataset"),
    Case("dataset-dir-without-meta", ["--dataset={d}/prep"],
         files={"prep/train_000000.bin": b"\0" * 64},
         expect="key 'dataset': directory '{d}/prep' has no meta.json"),
    Case("dataset-corpus-too-short", ["--dataset={d}/short.txt"],
         files={"short.txt": "To be, or not to be.\n"},
         expect="key 'dataset': '{d}/short.txt' gives 19 training tokens, fewer than "
                "seq_len + 1 = 33"),
    Case("dataset-val-split-too-short", ["--dataset={d}/short.txt"],
         files={"short.txt": "x" * 40},
         expect="key 'dataset': '{d}/short.txt' gives 4 validation tokens"),
    Case("dataset-empty-txt", ["--dataset={d}/empty.txt"], files={"empty.txt": ""},
         expect="key 'dataset': '{d}/empty.txt' gives 0 training tokens"),
    Case("dataset-txt-not-utf8", ["--dataset={d}/latin1.txt"],
         files={"latin1.txt": b"caf\xe9 au lait\n" * 200},
         expect="key 'dataset': cannot read '{d}/latin1.txt' as UTF-8 text"),
    Case("data-dir-without-tinyshakespeare-offline",
         ["--dataset=tinyshakespeare", "--data_dir={d}/empty"], files={"empty": DIR},
         env={"FP8TRAIN_OFFLINE": "1"},
         expect="dataset 'tinyshakespeare' not found at '{d}/empty/tinyshakespeare.txt' "
                "(offline mode is set)"),
    Case("data-dir-without-tinyshakespeare-download-fails",
         ["--dataset=tinyshakespeare", "--data_dir={d}/empty"], files={"empty": DIR},
         env=DEAD_PROXY,
         expect="dataset 'tinyshakespeare' not found at '{d}/empty/tinyshakespeare.txt' "
                "(download failed"),
    Case("data-dir-is-a-file", ["--dataset=tinyshakespeare", "--data_dir={d}/afile"],
         files={"afile": "not a folder\n"}, env=DEAD_PROXY,
         expect="not found at '{d}/afile/tinyshakespeare.txt'"),
    Case("data-dir-without-prepared-fineweb", ["--dataset=fineweb-edu", "--data_dir={d}/empty"],
         files={"empty": DIR},
         expect="dataset 'fineweb-edu' is not prepared: '{d}/empty/fineweb-edu/meta.json' "
                "not found; run: python scripts/prepare_data.py"),
    Case("tokenizer-unknown-offline", ["--tokenizer=no-such-org/no-such-tokenizer"],
         env=OFFLINE_TOKENIZERS,
         expect="key 'tokenizer': cannot load tokenizer 'no-such-org/no-such-tokenizer'"),
    Case("tokenizer-dir-without-tokenizer", ["--tokenizer={d}/tok"],
         files={"tok/readme.txt": "nothing here\n"}, env=OFFLINE_TOKENIZERS,
         expect="key 'tokenizer': cannot load tokenizer '{d}/tok'"),
    Case("prepared-meta-without-vocab-size", ["--dataset={d}/prep"], setup=meta_without_vocab,
         expect="'{d}/prep/meta.json' is not a valid prepared-dataset description"),
    Case("prepared-meta-not-json", ["--dataset={d}/prep"], setup=meta_not_json,
         expect="'{d}/prep/meta.json' is not valid JSON"),
    Case("prepared-with-another-tokenizer", ["--dataset={d}/prep"], setup=prepared_with_gpt2,
         expect="key 'tokenizer' is 'byte' but '{d}/prep' was prepared with tokenizer 'gpt2'"),
    Case("prepared-shard-truncated", ["--dataset={d}/prep"], setup=truncated_shard,
         expect="shard '{d}/prep/train_000000.bin' is truncated or corrupt"),
    Case("prepared-shard-missing", ["--dataset={d}/prep"], setup=missing_shard,
         expect="shard '{d}/prep/val_000000.bin' listed in meta.json is missing"),
    Case("prepared-split-too-short", ["--dataset={d}/prep"], setup=short_val_split,
         expect="dataset '{d}/prep': the val split has 20 tokens, fewer than seq_len + 1 = 33"),

    # output directory and checkpoints ------------------------------------------------------------
    Case("output-dir-is-a-file", ["--output_dir={d}/afile"], files={"afile": "x\n"},
         expect="key 'output_dir': cannot create '{d}/afile'"),
    Case("batch-cache-dir-is-a-file",
         ["--auto_batch_size", "--target_effective_batch_size=4",
          "--gradient_accumulation_steps=null", "--max_batch_size=4",
          "--batch_cache_dir={d}/afile"], files={"afile": "x\n"},
         expect="key 'batch_cache_dir': '{d}/afile' is not a directory"),
    Case("resume-path-missing", ["--resume={d}/nope"],
         expect="key 'resume': checkpoint '{d}/nope' not found"),
    Case("resume-dir-not-a-checkpoint", ["--resume={d}/notckpt"],
         files={"notckpt/notes.txt": "hello\n"},
         expect="key 'resume': '{d}/notckpt' is not a checkpoint directory"),
    Case("resume-file-not-a-checkpoint", ["--resume={d}/model.pt"], files={"model.pt": "x"},
         expect="key 'resume': '{d}/model.pt' is not a checkpoint directory"),
    Case("resume-run-dir-without-checkpoints", ["--resume={d}/oldrun"],
         files={"oldrun/checkpoints": DIR}, expect=("key 'resume'", "'{d}/oldrun'")),
    Case("resume-never-over-checkpoints", ["--output_dir={run}"], needs_run=True,
         expect="output_dir already holds checkpoints (latest: "
                "'{run}/checkpoints/step_0000002')"),
    # Refused as a config change, or (with the change allowed) when the weights do not load:
    # either way the one line names the checkpoint.
    Case("resume-other-model-shape", ["--output_dir={d}/new", "--resume={run}", "--n_layer=3"],
         needs_run=True, expect="'{run}/checkpoints/step_0000002'"),
    Case("resume-auto-other-model-width", ["--output_dir={run}", "--n_embd=64", "--resume"],
         needs_run=True, expect="'{run}/checkpoints/step_0000002'"),
    # Caught by the checkpoint manifest (size and SHA-256 of every file) before loading.
    Case("resume-corrupt-checkpoint", ["--output_dir={d}/new",
                                       "--resume={run}/checkpoints/step_0000002"],
         needs_run=True, setup=corrupt_checkpoint,
         expect="'{run}/checkpoints/step_0000002'"),
    Case("resume-corrupt-checkpoint-without-manifest",
         ["--output_dir={d}/new", "--resume={run}/checkpoints/step_0000002"],
         needs_run=True, setup=corrupt_checkpoint_without_manifest,
         expect="cannot resume from '{run}/checkpoints/step_0000002'"),
]
CASES += (bad_cases_config.CASES + bad_cases_data.CASES + bad_cases_prepare.CASES
          + bad_cases_checkpoint.CASES + bad_cases_run.CASES + bad_cases_tools.CASES
          + bad_cases_model.CASES)


# --- running them --------------------------------------------------------------------------------

def _fill(text: str, d: Path, run: Path) -> str:
    for name, value in (("{d}", d), ("{corpus}", CORPUS), ("{run}", run)):
        text = text.replace(name, str(value))
    return text


def _materialise(case: Case, d: Path, run: Path) -> tuple[list, dict]:
    write_files(d, case.files, lambda text: _fill(text, d, run))
    if case.setup:
        case.setup(d)
    fast = {k: _fill(str(v), d, run) for k, v in FAST.items()}
    prefix = tiny_args(d / "out", **fast) if case.prefix == "tiny" else [f"--output_dir={d}/out"]
    argv = prefix + [_fill(a, d, run) for a in case.argv]
    return argv, {k: _fill(v, d, run) for k, v in case.env.items()}


def _run_case(case: Case, d: Path, trained):
    run = d / "trained"
    try:
        if case.needs_run:
            base_dir, base = trained.result()
            if base.returncode != 0:
                return ("the tiny training run that makes the checkpoints failed (exit "
                        f"{base.returncode}):\n{base.stderr[-3000:]}")
            shutil.copytree(base_dir, run)
        argv, env = _materialise(case, d, run)
        return run_train(*argv, env=env, timeout=TIMEOUT)
    except Exception:
        return traceback.format_exc()


def _train_base(root: Path):
    out = root / "trained"
    fast = {k: _fill(str(v), root, out) for k, v in FAST.items()}
    return out, run_train(*tiny_args(out, **fast), timeout=TIMEOUT)


@pytest.fixture(scope="session")
def outcomes(request, tmp_path_factory):
    """Launch every selected case at once on a small thread pool (the training run that makes
    the checkpoints first). Returns (root, {case id: CompletedProcess, or why it could not be
    run}); case X ran in root / X."""
    selected = [item.callspec.params["case"] for item in request.session.items
                if isinstance(getattr(item, "callspec", None) and
                              item.callspec.params.get("case"), Case)]
    root = tmp_path_factory.mktemp("bad_input")
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        trained = pool.submit(_train_base, root) if any(c.needs_run for c in selected) else None
        futures = {}
        for case in sorted(selected, key=lambda c: c.needs_run):  # those waiting go last
            d = root / case.id
            d.mkdir()
            futures[case.id] = pool.submit(_run_case, case, d, trained)
        return root, {cid: f.result() for cid, f in futures.items()}


def test_corpus_is_large_and_ids_are_unique():
    assert len(CASES) >= 28
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.skipif(not CORPUS.is_file(), reason=f"no test corpus at {CORPUS}")
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=c.marks) for c in CASES])
def test_bad_input_is_one_line_and_exit_2(case, outcomes):
    root, results = outcomes
    r, d = results[case.id], root / case.id
    if isinstance(r, str):
        pytest.fail(f"case could not be run: {r}")
    shown = f"exit {r.returncode}\n--- stderr:\n{r.stderr[-4000:]}\n--- stdout:\n{r.stdout[-2000:]}"
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout, shown
    assert r.returncode == 2, shown
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), shown
    expected = case.expect if isinstance(case.expect, tuple) else (case.expect,)
    for e in expected:
        assert _fill(e, d, d / "trained") in lines[0], shown
