"""Checkpoints from an untrusted source: a crafted pickle in any file of a checkpoint (with a
manifest that matches it, as its author can write one) runs no code on resume (a named
checkpoint or --resume auto), export, evaluation or sampling: every file loads with safetensors,
torch.load(weights_only=True) or json, and what is still unpickled without restriction (TE's
`_extra_state`, DCP metadata and items) is checked first. Real checkpoints of fp32, native-FP8
and torchao runs and DCP directories pass. Real runs, real payloads."""


import hashlib
import importlib.util
import io
import json
import os
import pickle
import shutil
import sys
import tarfile
import types

import pytest
import torch
from support.runs import ROOT, run_train, tiny_args
from support.safe_artifacts_shared import OpensFile, RunsCommand, _payloads, _why

from fp8train.checkpoint.files import MANIFEST_FORMAT, TRAIN_STATE
from fp8train.checkpoint.safe_load import (DCP_METADATA_GLOBALS, TE_EXTRA_STATE_GLOBALS,
                                           rng_globals, unsafe_content)
from fp8train.checkpoint.verify import verify

# Two checkpoints (steps 1 and 2) per run, in seconds.
SHORT = dict(max_steps=2, checkpoint_interval=1, eval_interval=100, eval_sequences=8,
             eval_samples=0, warmup_steps=1, batch_size=8, gradient_accumulation_steps=1,
             log_interval=1)


BACKENDS = {"fp32": {}, "native": dict(use_fp8="true", fp8_backend="native"),
            "torchao": dict(use_fp8="true", fp8_backend="torchao")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from concurrent.futures import ThreadPoolExecutor
    root = tmp_path_factory.mktemp("safe")
    with ThreadPoolExecutor(len(BACKENDS)) as pool:   # three processes, mostly start-up
        done = {name: pool.submit(run_train, *tiny_args(root / name, **SHORT, **kw))
                for name, kw in BACKENDS.items()}
    for name, future in done.items():
        r = future.result()
        assert r.returncode == 0, r.stderr[-3000:]
    return {name: root / name for name in BACKENDS}


def _craft(ckpt, name, obj):
    """Replace `name` in checkpoint `ckpt` by torch.save(obj) and make the manifest match; for
    model.safetensors, the pickle goes where one is unpickled: a Transformer Engine
    `_extra_state` tensor."""
    path = os.path.join(ckpt, name)
    if name.endswith(".safetensors"):
        from safetensors.torch import load_file, save_file
        state = load_file(path)
        state["blocks.0.attn.qkv._extra_state"] = torch.frombuffer(
            bytearray(pickle.dumps({"recipe": obj})), dtype=torch.uint8)
        save_file(state, path, metadata={"format": "pt"})
    else:
        torch.save(obj, path)
    _match_manifest(ckpt, name)


def _match_manifest(ckpt, name):
    path = os.path.join(ckpt, name)
    manifest_path = os.path.join(ckpt, "manifest.json")
    manifest = json.load(open(manifest_path))
    data = open(path, "rb").read()
    manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    with open(manifest_path, "w") as fh:
        json.dump(manifest, fh)


def _error_lines(text):
    return [line for line in text.splitlines() if line.startswith("error:")]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")   # DCP in one process
def test_real_checkpoints_are_safe(runs, tmp_path):
    import torch.distributed.checkpoint as dcp

    from fp8train.evaluate import trained
    for name, run in runs.items():
        ckpts = sorted((run / "checkpoints").glob("step_*"))
        assert len(ckpts) == 2, name
        for ckpt in ckpts:
            assert unsafe_content(str(ckpt)) is None, (name, ckpt)
            assert verify(str(ckpt))[0] is None
    # FSDP's layout, written by torch.distributed.checkpoint as Accelerate does (one process)
    src = str(sorted((runs["native"] / "checkpoints").glob("step_*"))[-1])
    state = trained.read_state(src)
    optim = torch.load(os.path.join(src, "optimizer.bin"), weights_only=True)
    ckpt = tmp_path / "step_0000002"
    ckpt.mkdir()
    shutil.copy(os.path.join(src, "config.yaml"), ckpt / "config.yaml")
    dcp.save({"model": state}, storage_writer=dcp.FileSystemWriter(str(ckpt /
                                                                       "pytorch_model_fsdp_0")))
    dcp.save({"optimizer": optim}, storage_writer=dcp.FileSystemWriter(str(ckpt / "optimizer_0")))
    assert unsafe_content(str(ckpt)) is None
    back = trained.read_state(str(ckpt))
    assert sorted(back) == sorted(state) and all(torch.equal(back[k], state[k]) for k in state)


def test_the_train_state_is_json_and_every_tensor_file_loads_weights_only(runs):
    """No object of ours is pickled: the counters are train_state.json, and every torch.save file
    loads with torch.load(weights_only=True), the RNG states with NumPy's generator array (the
    four types of rng_globals) and nothing more; the model is safetensors."""
    import numpy as np
    from safetensors.torch import load_file
    for name, run in runs.items():
        for ckpt in sorted((run / "checkpoints").glob("step_*")):
            files = sorted(p.name for p in ckpt.iterdir())
            assert files == ["config.yaml", "manifest.json", "model.safetensors", "optimizer.bin",
                             "random_states_0.pkl", TRAIN_STATE], (name, files)
            manifest = json.loads((ckpt / "manifest.json").read_text())
            assert manifest["format"] == MANIFEST_FORMAT == 2
            assert sorted(manifest["files"]) == [f for f in files if f != "manifest.json"]
            counters = json.loads((ckpt / TRAIN_STATE).read_text())
            assert counters["step"] == manifest["step"] and counters["tokens"] == manifest["tokens"]
            assert counters["data_position"] * 64 == counters["tokens"]   # seq_len 64
            assert load_file(str(ckpt / "model.safetensors"))
            optim = torch.load(ckpt / "optimizer.bin", weights_only=True)
            assert optim["state"] and all(isinstance(t, torch.Tensor) for per in
                                          optim["state"].values() for t in per.values())
            with pytest.raises(pickle.UnpicklingError, match="numpy"):
                torch.load(ckpt / "random_states_0.pkl", weights_only=True)
            assert len(rng_globals()) == 4 and all(g.__module__.startswith("numpy")
                                                   for g in rng_globals())
            with torch.serialization.safe_globals(rng_globals()):
                rng = torch.load(ckpt / "random_states_0.pkl", weights_only=True)
            assert rng["step"] == manifest["step"]   # Accelerate's micro-step count, accum 1
            assert isinstance(rng["numpy_random_seed"][1], np.ndarray) and \
                isinstance(rng["torch_manual_seed"], torch.Tensor)


@pytest.mark.parametrize("name", ["random_states_0.pkl", "optimizer.bin", "model.safetensors",
                                  "custom_checkpoint_0.pkl"])
def test_resume_from_a_crafted_checkpoint_exits_2(runs, tmp_path, name):
    marker = tmp_path / "MARKER"
    run = tmp_path / "run"
    shutil.copytree(runs["fp32"], run)
    ckpt = run / "checkpoints" / "step_0000002"
    obj, global_name = _payloads(marker)[name]
    _craft(ckpt, name, obj)
    problem, _ = verify(str(ckpt))
    assert problem and name in problem and global_name in problem   # not a checksum mismatch
    r = run_train(*tiny_args(run, **SHORT, resume=ckpt))
    assert r.returncode == 2, r.stderr[-2000:]
    errors = _error_lines(r.stderr)
    assert len(errors) == 1 and name in errors[0] and global_name in errors[0], r.stderr[-2000:]
    assert not marker.exists()


def test_a_pickle_in_place_of_the_train_state_is_never_unpickled(runs, tmp_path, capsys):
    """train_state.json is read as JSON: a pickle there fails to parse (resume: one line, exit
    2); export, sampling and evaluation do not read it."""
    marker = tmp_path / "MARKER"
    run = tmp_path / "run"
    shutil.copytree(runs["fp32"], run)
    ckpt = run / "checkpoints" / "step_0000002"
    _craft(ckpt, TRAIN_STATE, OpensFile(str(marker)))
    assert verify(str(ckpt))[0] is None   # nothing in it is unpickled: not unsafe
    r = run_train(*tiny_args(run, **SHORT, resume=ckpt))
    assert r.returncode == 2, r.stderr[-2000:]
    errors = _error_lines(r.stderr)
    assert len(errors) == 1 and f"{TRAIN_STATE} cannot be read" in errors[0], r.stderr[-2000:]
    assert _script("evaluate")([str(ckpt)]) == 0
    assert not marker.exists()


def test_a_checkpoint_of_the_previous_format_is_refused_in_one_line(runs, tmp_path, capsys):
    """Format 1 (the counters in Accelerate's custom_checkpoint_0.pkl) does not resume: one line,
    exit 2, nothing moved aside; its model still evaluates."""
    run = tmp_path / "run"
    shutil.copytree(runs["fp32"], run)
    for ckpt in (run / "checkpoints").glob("step_*"):
        counters = json.loads((ckpt / TRAIN_STATE).read_text())
        (ckpt / TRAIN_STATE).unlink()
        torch.save(counters, ckpt / "custom_checkpoint_0.pkl")
        manifest = json.loads((ckpt / "manifest.json").read_text())
        manifest["format"] = 1
        del manifest["files"][TRAIN_STATE]
        (ckpt / "manifest.json").write_text(json.dumps(manifest))
        _match_manifest(ckpt, "custom_checkpoint_0.pkl")
        assert verify(str(ckpt))[0] is None
    for resume in ("auto", run / "checkpoints" / "step_0000002"):
        r = run_train(*tiny_args(run, **SHORT, resume=resume))
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
        errors = _error_lines(r.stderr)
        assert len(errors) == 1 and "cannot resume from" in errors[0] \
            and "step_0000002': it was written by another version" in errors[0] \
            and "(checkpoint format 1;" in errors[0], r.stderr[-2000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == \
        ["latest", "step_0000001", "step_0000002"]
    assert _script("evaluate")([str(run)]) == 0


def test_resume_auto_sets_a_crafted_checkpoint_aside(runs, tmp_path):
    marker = tmp_path / "MARKER"
    run = tmp_path / "run"
    shutil.copytree(runs["fp32"], run)
    newest = run / "checkpoints" / "step_0000002"
    _craft(newest, "custom_checkpoint_0.pkl", _payloads(marker)["custom_checkpoint_0.pkl"][0])
    r = run_train(*tiny_args(run, **SHORT, resume="auto"))
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout + r.stderr
    warned = [line for line in out.splitlines() if "step_0000002" in line and "unusable" in line]
    assert warned and "custom_checkpoint_0.pkl" in warned[0] and "io.open" in warned[0] \
        and "moved aside" in warned[0], out[-3000:]
    assert "resumed from" in out and "step_0000001" in out
    assert (run / "checkpoints" / "step_0000002.corrupt").is_dir()
    assert unsafe_content(str(newest)) is None          # written anew by the resumed run
    assert not marker.exists()


def _script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


@pytest.mark.parametrize("name", ["random_states_0.pkl", "optimizer.bin", "model.safetensors"])
@pytest.mark.parametrize("tool", ["export_hf", "evaluate", "sample"])
def test_tools_refuse_a_crafted_checkpoint(runs, tmp_path, capsys, tool, name):
    marker = tmp_path / "MARKER"
    ckpt = tmp_path / "step_0000002"
    shutil.copytree(runs["native"] / "checkpoints" / "step_0000002", ckpt)
    obj, global_name = _payloads(marker)[name]
    _craft(ckpt, name, obj)
    args = {"export_hf": [str(ckpt), str(tmp_path / "out")], "evaluate": [str(ckpt)],
            "sample": [str(ckpt), "--prompt", "ROMEO:", "--max_new_tokens", "4"]}[tool]
    assert _script(tool)(args) == 2
    errors = _error_lines(capsys.readouterr().err)
    assert len(errors) == 1 and name in errors[0] and global_name in errors[0], errors
    assert not marker.exists() and not (tmp_path / "out").exists()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")   # torch.jit
def test_other_torch_formats_are_refused(runs, tmp_path):
    src = runs["fp32"] / "checkpoints" / "step_0000002"
    legacy = tmp_path / "legacy"
    shutil.copytree(src, legacy)
    torch.save({"step": 1}, legacy / "custom_checkpoint_0.pkl",
               _use_new_zipfile_serialization=False)   # torch.load would try tar and pickle
    assert "not a torch.save zip archive" in unsafe_content(str(legacy))
    tar = io.BytesIO()
    with tarfile.open(fileobj=tar, mode="w") as fh:   # torch.load's oldest format
        payload = pickle.dumps(RunsCommand("true"))
        member = tarfile.TarInfo("pickle")
        member.size = len(payload)
        fh.addfile(member, io.BytesIO(payload))
    (legacy / "custom_checkpoint_0.pkl").write_bytes(tar.getvalue())
    assert "tar archive" in unsafe_content(str(legacy))
    (legacy / "custom_checkpoint_0.pkl").write_bytes(b"moments" * 100)   # fails at byte 0
    assert unsafe_content(str(legacy)) is None
    # An RNG file must load: Accelerate would skip one that does not, without a word.
    (legacy / "random_states_0.pkl").write_bytes(b"moments" * 100)
    assert "random_states_0.pkl' is not a torch.save zip archive" in unsafe_content(str(legacy))
    script = tmp_path / "script"
    shutil.copytree(src, script)
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), str(script / "optimizer.bin"))
    assert "TorchScript" in unsafe_content(str(script))


@pytest.fixture
def fake_te_recipe(monkeypatch):
    """transformer_engine.common.recipe as far as its pickles need it (TE needs a GPU)."""
    import dataclasses
    import enum
    from typing import NamedTuple
    mod = types.ModuleType("transformer_engine.common.recipe")

    class _FormatHelper(NamedTuple):
        max_fwd: float
        max_bwd: float

    class Format(enum.Enum):
        E4M3 = _FormatHelper(448, 448)
        HYBRID = _FormatHelper(448, 57344)

    @dataclasses.dataclass
    class DelayedScaling:
        margin: int = 0
        fp8_format: Format = Format.HYBRID
        amax_history_len: int = 16

    for cls in (_FormatHelper, Format, DelayedScaling):
        cls.__module__, cls.__qualname__ = mod.__name__, cls.__name__
        setattr(mod, cls.__name__, cls)
    for name in ("transformer_engine", "transformer_engine.common"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    return mod


def test_transformer_engine_extra_state_is_checked(runs, tmp_path, fake_te_recipe):
    """TE pickles its FP8 state into `_extra_state` tensors (CPU tensors inside as
    _load_from_bytes blobs) and unpickles them on load."""
    from safetensors.torch import load_file, save_file
    marker = tmp_path / "MARKER"
    src = runs["fp32"] / "checkpoints" / "step_0000002"

    def as_tensor(obj):
        return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)

    def scan(extra):
        ckpt = tmp_path / f"ckpt{len(list(tmp_path.iterdir()))}"
        shutil.copytree(src, ckpt)
        state = load_file(str(ckpt / "model.safetensors"))
        state["blocks.0.attn.qkv._extra_state"] = extra
        save_file(state, str(ckpt / "model.safetensors"))
        return unsafe_content(str(ckpt))

    good = {"recipe": fake_te_recipe.DelayedScaling(), "scale_fwd": torch.ones(3),
            "amax_history_fwd": torch.zeros(16, 3), "extra_fp8_variables": {"num_gemms": 1}}
    assert scan(as_tensor(good)) is None
    assert scan(torch.empty(0, dtype=torch.uint8)) is None
    evil = pickle.dumps({"recipe": RunsCommand(f"touch '{marker}'")})
    assert "posix.system" in scan(as_tensor({"recipe": RunsCommand(f"touch '{marker}'")}))
    padded = bytearray(evil + b"\0" * (-len(evil) % 4))   # TE unpickles any dtype's bytes
    assert "posix.system" in scan(torch.frombuffer(padded, dtype=torch.float32))

    class Storage:   # a storage whose torch.save blob carries the payload
        def __reduce__(self):
            blob = io.BytesIO()
            torch.save(RunsCommand(f"touch '{marker}'"), blob, _use_new_zipfile_serialization=False)
            return torch.storage._load_from_bytes, (blob.getvalue(),)
    why = scan(as_tensor({"scale_fwd": Storage()}))
    assert "_extra_state" in why and "posix.system" in why
    # _load_from_bytes is for TE's pickles only
    assert "_load_from_bytes" in _why(pickle.dumps(Storage()), DCP_METADATA_GLOBALS)
    assert "posix.system" in _why(pickle.dumps(Storage()), TE_EXTRA_STATE_GLOBALS)
    assert not marker.exists()
