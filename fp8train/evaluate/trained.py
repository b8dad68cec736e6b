"""A trained model, read back from a checkpoint: what export, sampling and evaluation start from.

A checkpoint holds the run's resolved config (config.yaml, with the derived vocabulary size) and
the model's state as Accelerate saved it: model.safetensors (one process, DDP),
pytorch_model_fsdp_0/ (FSDP's sharded torch.distributed.checkpoint) or a .bin. FP8 training
leaves extra entries there: the native backend's `fp8_state.*` scales, Transformer Engine's
`*._extra_state`. The weights themselves keep the names of the plain model (every backend wraps
nn.Linear without renaming it), so dropping those entries gives the plain model's state.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from ..checkpoint.files import CONFIG_NAME, read_manifest
from ..checkpoint.locate import find_checkpoint
from ..checkpoint.safe_load import safe_unpickle
from ..config import load as config_mod
from ..config.load import Config
from ..errors import BadInput, one_line
from .. import hf_model
from ..model import GPT, ModelConfig, RotaryEmbedding

FP8_EXTRAS = ("fp8_state.", "_extra_state")    # prefixes / suffixes of FP8 backend state
WRAPPER_PREFIXES = ("_orig_mod.", "module.")    # torch.compile, DDP


@dataclass
class Trained:
    path: str              # the checkpoint directory
    cfg: Config            # the run's config, as the checkpoint recorded it
    derived: dict          # what the trainer derived (vocab size, batch plan, precision, ...)
    mcfg: "ModelConfig | hf_model.HFModelConfig"
    model: torch.nn.Module  # GPT or hf_model.HFCausalLM; plain nn.Linear everywhere, eval mode
    step: int
    tokens: int

    def describe(self) -> str:
        fp8 = str(self.derived.get("fp8", "off"))
        return (f"{self.path}: step {self.step:,} ({self.tokens:,} tokens), {self.cfg.model} "
                f"({self.mcfg.arch}, {self.mcfg.n_layer} layers, d={self.mcfg.n_embd}), trained "
                f"in {self.derived.get('precision', '?')}"
                + ("" if fp8.startswith("off") else f" with FP8 ({fp8})"))


def run_config(checkpoint: str) -> tuple[Config, dict]:
    """The Config a checkpoint was trained with and its `derived` section."""
    path = os.path.join(checkpoint, CONFIG_NAME)
    data = config_mod.read_yaml(path, what="checkpoint config")
    derived = data.get(config_mod.DERIVED_SECTION) or {}
    values: dict = {}
    config_mod.apply_mapping(values, data, path)
    cfg = Config(**values, source=path)
    if not isinstance(derived.get("vocab_size"), int):
        raise BadInput(f"{path}: no derived vocab_size (the checkpoint was not written by "
                          f"train_fp8.py)")
    return cfg, derived


def model_config(cfg: Config, derived: dict):
    """The checkpoint's model: a preset's ModelConfig or an hf: model's HFModelConfig."""
    return hf_model.model_config(dataclasses.replace(cfg, dropout=0.0), derived["vocab_size"],
                                 what=cfg.source, saved=derived)


def read_state(checkpoint: str) -> dict:
    """The model's saved tensors by name (on CPU, as saved), wrapper prefixes removed. Nothing
    here runs a pickle's code: safetensors, torch.load(weights_only=True), DCP read as
    `_read_dcp` says; TE's pickled `_extra_state` entries are read as bytes, never unpickled."""
    files = os.listdir(checkpoint)
    if "pytorch_model_fsdp_0" in files and "model.safetensors" not in files:
        state = _read_dcp(os.path.join(checkpoint, "pytorch_model_fsdp_0"))
    else:
        name = next((f for f in ("model.safetensors", "pytorch_model.bin",
                                 "pytorch_model_fsdp.bin") if f in files), None)
        if name is None:
            raise BadInput(f"checkpoint '{checkpoint}' holds no model state (model.safetensors, "
                              f"pytorch_model_fsdp_0/ or pytorch_model.bin)")
        path = os.path.join(checkpoint, name)
        try:
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file
                state = load_file(path)
            else:
                state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:   # safetensors and torch raise their own kinds; nothing ran
            raise BadInput(f"checkpoint '{checkpoint}': {name} cannot be read "
                              f"({one_line(e, with_type=True)})") from None
    out = {}
    for key, value in state.items():
        for prefix in WRAPPER_PREFIXES:
            key = key.replace(prefix, "")
        out[key] = value
    return out


def _read_dcp(directory: str) -> dict:
    """FSDP's sharded checkpoint gathered into one state dict by this process alone (no process
    group): Accelerate saves it as {"model": state_dict}. DCP itself unpickles its metadata with
    pickle.load and non-tensor items with torch.load(weights_only=False); here the metadata
    goes through an unpickler limited to the checkpoint allowlist and such items through
    torch.load(weights_only=True). Tensors are read with weights_only=True by DCP."""
    import io

    from torch.distributed.checkpoint import CheckpointException, FileSystemReader
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.metadata import StorageMeta
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    try:
        with open(os.path.join(directory, ".metadata"), "rb") as fh:
            metadata = safe_unpickle(fh.read())
    except Exception as e:   # OSError, and pickle and the metadata's classes raise any kind
        raise BadInput(f"'{directory}/.metadata' cannot be read safely ({type(e).__name__}: "
                          f"{' '.join(str(e).split())[:300]})") from None

    class Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):   # upstream: pickle.load of the same file
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class Planner(_EmptyStateDictLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            obj = torch.load(value, map_location="cpu", weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn],
                            obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    # A run with torchao's FP8 weight all-gather saved its converted weights' shards as
    # torchao's weight wrapper, whose classes torch's weights_only loading allows only once
    # torchao.float8 is imported (it registers them as safe globals).
    torchao = _import_torchao_float8()
    state: dict = {}
    try:
        _load_state_dict(state, storage_reader=Reader(directory), planner=Planner(),
                         no_dist=True)
    except BadInput:
        raise
    except (Exception, CheckpointException) as e:   # the latter wraps each rank's failure
        for exc, _ in getattr(e, "failures", {}).values():
            e = exc
            break
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        why = next((line for line in lines if "GLOBAL" in line), lines[0] if lines else "")
        hint = "; its FP8 weights were saved by torchao (fp8_fsdp_all_gather): pip install " \
            "torchao to read them" if "GLOBAL torchao." in why and not torchao else ""
        raise BadInput(f"cannot read the sharded checkpoint '{directory}' "
                          f"({type(e).__name__}: {why[:300]}){hint}") from None
    model = state.get("model", state)
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.items()}


def _import_torchao_float8() -> bool:
    """Import torchao.float8 when it is installed; False when it cannot be."""
    try:
        from ..precision import backend_version
        backend_version("torchao")   # imports torchao.float8, quietly
        return True
    except Exception:   # not installed, or built for another torch: the read says what failed
        return False


def plain_state(state: dict) -> dict:
    """`state` without FP8 backend entries: what a plain GPT loads."""
    return {k: v for k, v in state.items()
            if not (k.startswith(FP8_EXTRAS[0]) or k.endswith(FP8_EXTRAS[1]))}


def load(path: str, device: str | torch.device = "cpu", warn=None, info=None) -> Trained:
    """The model of `path` (a checkpoint, or a run directory: its newest good checkpoint) as a
    plain GPT in fp32 on `device`, in eval mode. BadInput for anything unusable."""
    checkpoint = find_checkpoint(path, "", warn, info)
    cfg, derived = run_config(checkpoint)
    mcfg = model_config(cfg, derived)
    if isinstance(mcfg, ModelConfig):
        with torch.device("meta"):   # nothing allocated: the checkpoint's tensors are assigned
            model = GPT(mcfg)
    else:   # transformers' models compute buffers at init that the state does not hold
        model = hf_model.fresh_weights(mcfg).build()
    load_weights(model, plain_state(read_state(checkpoint)), checkpoint)
    model.to(device).eval()
    manifest = read_manifest(checkpoint)
    return Trained(checkpoint, cfg, derived, mcfg, model, int(manifest.get("step", 0)),
                   int(manifest.get("tokens", 0)))


def load_weights(model: torch.nn.Module, state: dict, checkpoint: str) -> None:
    """Load `state` into `model` exactly: every tensor present, of the right shape, and nothing
    left over; else one BadInput saying what differs."""
    expected = model.state_dict()
    state = dict(state)
    for names in _tied(expected):   # a tied weight is saved under one of its names
        saved = next((n for n in names if n in state), None)
        for n in names if saved else ():
            state.setdefault(n, state[saved])
    missing = [k for k in expected if k not in state]
    extra = [k for k in state if k not in expected]
    shapes = [f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}" for k, v in expected.items()
              if k in state and tuple(state[k].shape) != tuple(v.shape)]
    if missing or extra or shapes:
        parts = [f"{what}: {', '.join(keys[:4])}{' ...' if len(keys) > 4 else ''}"
                 for what, keys in (("missing", missing), ("unexpected", extra),
                                    ("shape (saved vs model)", shapes)) if keys]
        raise BadInput(f"checkpoint '{checkpoint}' does not match its config.yaml's model "
                          f"({'; '.join(parts)})")
    # A model built on the meta device takes the loaded tensors instead of copying them; a
    # real one copies them in (its tied weights stay one tensor).
    meta = any(p.is_meta for p in model.parameters())
    model.load_state_dict({k: v.float() if v.is_floating_point() else v
                           for k, v in state.items()}, strict=True, assign=meta)
    # Non-persistent buffers (the RoPE tables) are not in the state: compute them for real.
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.rebuild(device="cpu")


def _tied(expected: dict) -> list:
    """The groups of names that are one tensor in the model (transformers ties the output
    layer to the embedding by sharing the Parameter)."""
    groups: dict = {}
    for k, v in expected.items():
        if not v.is_meta:
            groups.setdefault((v.data_ptr(), tuple(v.shape)), []).append(k)
    return [names for names in groups.values() if len(names) > 1]


def pick_device(name: str = "auto") -> torch.device:
    """auto: the GPU when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise BadInput(f"--device: unknown device '{name}' (auto, cpu, cuda, cuda:N)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BadInput(f"--device {name}: no CUDA GPU here")
    return device


def autocast(cfg: Config, device: torch.device, warn=None):
    """The autocast the run's base precision trains and evaluates in on `device` (bf16 on a GPU
    for precision auto), as Accelerate enters it in training; fp32 where it cannot run."""
    from ..precision import base_precision
    try:
        mixed = base_precision(config_mod.section(cfg, "precision"), device).mixed_precision
    except BadInput as e:   # fp16 on a CPU
        if warn:
            warn(f"{e}: computing in fp32")
        mixed = "no"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed)
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)
