"""After training: export to transformers, sampling, evaluation of a checkpoint.

Real runs (native and torchao FP8 on the CPU, train_fp8.py in a subprocess), real transformers
models loaded with AutoModelForCausalLM, real tokenizers; nothing mocked."""


import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from support.export_shared import transformers
from support.runs import DATA_DIR, ROOT, run_train, tiny_args

from fp8train.observe.metrics_file import read_rows


def _script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


export_main, sample_main, evaluate_main = (_script(n) for n in ("export_hf", "sample", "evaluate"))


def _bpe_tokenizer(path):
    """A byte-level BPE of 320 ids trained on the corpus itself: an HF tokenizer that is not a
    multiple of 128, so the model's vocabulary is padded and the export must cut it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    with open(os.path.join(DATA_DIR, "tinyshakespeare.txt"), encoding="utf-8") as fh:
        text = fh.read()[:200_000]
    raw.train_from_iterator(text.splitlines(), trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>").save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two FP8-trained tiny runs: gpt2 with the native backend evaluating in FP8 (byte
    tokenizer), llama (GQA) with torchao and an HF BPE tokenizer."""
    root = tmp_path_factory.mktemp("after")
    tok = _bpe_tokenizer(root / "tok")
    specs = {"native-gpt2": dict(fp8_backend="native", fp8_eval="true"),
             "torchao-llama": dict(fp8_backend="torchao", model="tiny-llama", tokenizer=tok)}
    out = {}
    for name, kw in specs.items():
        d = root / name
        r = run_train(*tiny_args(d, use_fp8="true", eval_samples=0, **kw))
        assert r.returncode == 0, r.stderr[-3000:]
        out[name] = d
    return out


def _final_val_loss(run_dir):
    rows = read_rows(run_dir, strict=True)
    return [r for r in rows if "val/loss" in r][-1]


@pytest.mark.parametrize("name", ["native-gpt2", "torchao-llama"])
def test_export_of_fp8_trained_run_loads_in_transformers(runs, tmp_path, name):
    from fp8train.data.tokenizers import build_tokenizer
    from fp8train.evaluate import trained
    out = tmp_path / "hf"
    r = subprocess.run([sys.executable, "scripts/export_hf.py", str(runs[name]), str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "check: transformers' logits match ours" in r.stdout
    for f in ("config.json", "model.safetensors", "tokenizer.json", "fp8train_export.json"):
        assert (out / f).is_file(), f
    info = json.loads((out / "fp8train_export.json").read_text())
    assert info["step"] == 12 and info["trained_fp8"].startswith(name.split("-")[0])
    # Readable by whoever may read any other new file here (safetensors' own files are 0600).
    (tmp_path / "probe").write_text("")
    fresh = (tmp_path / "probe").stat().st_mode & 0o777
    written = [p for p in [*out.rglob("*"), *(runs[name] / "checkpoints").rglob("*")]
               if p.is_file()]
    assert {str(p): oct(p.stat().st_mode & 0o777) for p in written} == \
        {str(p): oct(fresh) for p in written}

    # Independently of the script's own check: our model from the checkpoint vs transformers.
    t = trained.load(str(runs[name]))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, t.mcfg.vocab_size, (3, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = t.model(ids)[..., :t.mcfg.vocab_size]
        theirs = hf(input_ids=ids).logits
    assert theirs.shape == ours.shape
    assert (ours - theirs).abs().max().item() < 1e-4
    # The tokenizer beside it encodes as the run's tokenizer did.
    text = "ROMEO:\nO, she doth teach the torches to burn bright! — café"
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok(text, add_special_tokens=False)["input_ids"] == \
        [int(i) for i in build_tokenizer(t.cfg.tokenizer).encode(text)]
    if name == "torchao-llama":   # vocabulary 320 padded to 384 in training, cut to 320
        assert t.mcfg.padded_vocab_size == 384 and hf.config.vocab_size == 320 == len(tok)
        assert "padding_probability_max" in info


def test_our_greedy_sampling_equals_transformers_generate(runs, tmp_path, capsys):
    run = runs["native-gpt2"]
    assert export_main([str(run), str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    assert sample_main([str(run), "--prompt", "KING:", "--temperature", "0",
                        "--max_new_tokens", "24", "--json"]) == 0
    ours = json.loads(capsys.readouterr().out)["sample"]
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = tok("KING:", return_tensors="pt")["input_ids"]
    gen = hf.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0)
    assert tok.decode(gen[0, ids.shape[1]:]) == ours


def test_export_refuses_a_non_empty_directory_and_overwrites_on_request(runs, tmp_path, capsys):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "model-00001-of-00002.safetensors").write_text("stale")
    assert export_main([str(runs["native-gpt2"]), str(out)]) == 2
    assert "exists and is not empty; pass --overwrite" in capsys.readouterr().err
    assert export_main([str(runs["native-gpt2"]), str(out), "--overwrite", "--dtype", "bf16"]) == 0
    assert not (out / "model-00001-of-00002.safetensors").exists()   # no stale shard left
    assert json.loads((out / "fp8train_export.json").read_text())["dtype"] == "bf16"


@pytest.mark.parametrize("name", ["native-gpt2", "torchao-llama"])
def test_evaluate_reproduces_the_logged_final_val_loss(runs, name, capsys):
    """native-gpt2 evaluated in FP8 during training (fp8_eval), so this also rebuilds the FP8
    layers with their saved scales."""
    assert evaluate_main([str(runs[name]), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    logged = _final_val_loss(runs[name])
    assert result["step"] == logged["step"] == 12
    assert result["val/loss"] == pytest.approx(logged["val/loss"], abs=1e-6)
    assert result["logged_val_loss"] == logged["val/loss"]
    assert result["tokens"] == 32 * 64   # eval_sequences x seq_len


def test_evaluate_whole_split_and_the_train_split(runs, capsys):
    run = runs["torchao-llama"]
    assert evaluate_main([str(run), "--whole", "--json", "--batch_size", "32"]) == 0
    whole = json.loads(capsys.readouterr().out)
    assert evaluate_main([str(run), "--split", "train", "--eval_sequences", "16", "--json"]) == 0
    train = json.loads(capsys.readouterr().out)
    assert whole["sequences"] == "all" and whole["tokens"] > 10 * 32 * 64
    assert "logged_val_loss" not in whole and train["tokens"] == 16 * 64
    assert 2.0 < whole["val/loss"] < 7.0 and 2.0 < train["train/loss"] < 7.0


def test_sampling_is_seeded_and_top_k_1_is_greedy(runs, capsys):
    run = str(runs["native-gpt2"])

    def sample(*args):
        assert sample_main([run, "--prompt", "ROMEO:", "--max_new_tokens", "40", "--json",
                            *args]) == 0
        return [json.loads(line)["sample"] for line in capsys.readouterr().out.splitlines()]
    a, b = sample("--num_samples", "2", "--seed", "3"), sample("--num_samples", "2", "--seed", "3")
    assert a == b and a[0] != a[1] and all(len(s.encode()) >= 40 for s in a)
    assert sample("--seed", "4") != sample("--seed", "5")
    assert sample("--top_k", "1", "--seed", "4") == sample("--temperature", "0")


def test_fsdp_sharded_checkpoint_reads_like_the_single_file_one(runs, tmp_path):
    """FSDP checkpoints hold pytorch_model_fsdp_0/, written by torch.distributed.checkpoint as
    Accelerate does ({"model": state_dict}); here written by one process with the same API."""
    import shutil

    import torch.distributed.checkpoint as dcp

    from fp8train.evaluate import trained
    src = trained.find_checkpoint(str(runs["torchao-llama"]))
    ckpt = tmp_path / "step_0000012"
    ckpt.mkdir()
    shutil.copy(os.path.join(src, "config.yaml"), ckpt / "config.yaml")
    state = trained.read_state(src)
    dcp.save({"model": state}, storage_writer=dcp.FileSystemWriter(str(ckpt /
                                                                       "pytorch_model_fsdp_0")))
    back = trained.read_state(str(ckpt))
    assert sorted(back) == sorted(state)
    assert all(torch.equal(back[k], state[k]) for k in state)
    a, b = trained.load(src).model, trained.load(str(ckpt)).model
    ids = torch.randint(0, 300, (1, 32))
    assert torch.equal(a(ids), b(ids))


def _corrupt(run, tmp_path):
    import shutil

    from fp8train.evaluate.trained import find_checkpoint
    bad = tmp_path / "step_0000012"
    shutil.copytree(find_checkpoint(str(run)), bad)
    with open(bad / "model.safetensors", "r+b") as fh:
        fh.seek(-5, 2)
        fh.write(b"XXXXX")
    return bad


def _bad_tokenizer(run, tmp_path):
    import shutil

    from fp8train.evaluate.trained import find_checkpoint
    ckpt = tmp_path / "ckpt"
    shutil.copytree(find_checkpoint(str(run)), ckpt)
    os.remove(ckpt / "manifest.json")   # an edited config no longer matches its checksum
    text = (ckpt / "config.yaml").read_text().replace("tokenizer: byte",
                                                      f"tokenizer: {tmp_path}/no-such-tokenizer")
    (ckpt / "config.yaml").write_text(text)
    return ckpt


def _run_without_checkpoints(tmp_path, name, *folders):
    """A run directory as a run that died before its first checkpoint leaves it."""
    run = tmp_path / name
    for sub in ("",) + folders:
        (run / sub).mkdir(parents=True, exist_ok=True)
    (run / "train.log").write_text("")
    (run / "config.yaml").write_text("model: tiny\n")
    return run


BAD = [
    ("export", lambda run, d: [str(d / "nowhere"), str(d / "out")],
     "nowhere' not found"),
    ("export", lambda run, d: [str(_run_without_checkpoints(d, "crashed")), str(d / "out")],
     "holds no checkpoint (no checkpoints/ in it: the run saved none)"),
    ("export", lambda run, d: [str(_run_without_checkpoints(d, "empty", "checkpoints")),
                               str(d / "out")],
     "holds no checkpoint ("),
    ("export", lambda run, d: [str(_corrupt(run, d)), str(d / "out")],
     "does not match its checksum"),
    ("export", lambda run, d: [str(_bad_tokenizer(run, d)), str(d / "out")],
     "pass --no_tokenizer"),
    ("export", lambda run, d: [str(run / "checkpoints"), str(d / "out")],
     "is not a checkpoint directory"),
    ("evaluate", lambda run, d: [str(run), "--eval_sequences", "0"], "--eval_sequences"),
    ("evaluate", lambda run, d: [str(run), "--data_dir", str(d / "empty")], "not found"),
    ("sample", lambda run, d: [str(run), "--temperature", "-1"], "--temperature"),
    ("sample", lambda run, d: [str(run), "--device", "cuda"], "no CUDA GPU here"),
    ("sample", lambda run, d: [str(run), "--device", "tpu9"], "unknown device"),
]


@pytest.mark.parametrize("tool,args,expect", BAD, ids=[f"{t}-{e[:20]}" for t, _, e in BAD])
def test_bad_input_is_one_line_and_exit_2(runs, tmp_path, capsys, monkeypatch, tool, args,
                                          expect):
    monkeypatch.setenv("FP8TRAIN_OFFLINE", "1")   # a missing corpus is not downloaded here
    main = {"export": export_main, "evaluate": evaluate_main, "sample": sample_main}[tool]
    code = main(args(runs["native-gpt2"], tmp_path))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err and err[-1].startswith("error: ") and expect in err[-1], err
    assert not (tmp_path / "out").exists()   # nothing written on bad input


def test_no_tokenizer_exports_the_model_alone(runs, tmp_path):
    ckpt = _bad_tokenizer(runs["native-gpt2"], tmp_path)
    assert export_main([str(ckpt), str(tmp_path / "out"), "--no_tokenizer"]) == 0
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert not (tmp_path / "out" / "tokenizer.json").exists()
