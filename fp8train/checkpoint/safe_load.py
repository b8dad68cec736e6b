"""Checkpoints are safe to load: nothing in one can run code when it is resumed, exported,
sampled or evaluated.

fp8train's own files load without running anything: model.safetensors with safetensors,
optimizer.bin and each rank's random_states_N.pkl with torch.load(weights_only=True) (the RNG
file with exactly the NumPy types of its generator state, RNG_GLOBALS), train_state.json with
json. Before a checkpoint is used, `unsafe_content` loads each torch.save file the same way and
refuses one that torch's restricted unpickler refuses (it names the global it would need).

Two kinds of pickle are still unpickled without restriction, by code fp8train does not control:
Transformer Engine's `_extra_state` tensors (TE's set_extra_state unpickles them: its recipe
object and FP8 scales) and an FSDP checkpoint's torch.distributed.checkpoint files (DCP's reader
unpickles `.metadata` with pickle.load and its non-tensor items with torch.load(weights_only=
False)). Those are read without being run (`_check_pickle`, a symbolic walk of the opcodes) and
may name only what they really hold: TE_EXTRA_STATE_GLOBALS and DCP_METADATA_GLOBALS, types and
tensor rebuilders, nothing that reaches files, processes or arbitrary attributes.
"""
from __future__ import annotations

import io
import os
import re

from ..errors import one_line

# Transformer Engine's `_extra_state`: a pickle of {"recipe": DelayedScaling, "scale_fwd": tensor,
# ..., "extra_fp8_variables": plain values}. The recipe is the one fp8train builds (the dataclass,
# its Format enum and the enum's NamedTuple value); each CPU tensor is pickled as
# _rebuild_tensor_v2(_load_from_bytes(a torch.save blob), ...), and the blob, which TE's unpickling
# loads with weights_only=False, must load with weights_only=True. Taken from TE 2.x's source.
TE_EXTRA_STATE_GLOBALS = frozenset({
    ("collections", "OrderedDict"),             # a tensor's (empty) backward hooks
    ("torch._utils", "_rebuild_tensor_v2"),     # a tensor ...
    ("torch.storage", "_load_from_bytes"),      # ... and its storage: checked as said above
    *(("transformer_engine.common.recipe", n) for n in ("DelayedScaling", "Format",
                                                         "_FormatHelper")),
})
# torch.distributed.checkpoint's .metadata: plain dataclasses and enums, shapes, dtypes, paths.
_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "int64", "int32",
           "uint8", "bool")
DCP_METADATA_GLOBALS = frozenset({
    *(("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    *(("torch", d) for d in _DTYPES),
    ("torch.serialization", "_get_layout"),      # torch.strided, by name
    ("pathlib", "PosixPath"),                    # StorageMeta.checkpoint_id
    ("pathlib._local", "PosixPath"),             # ... as Python 3.13 names it
})
TORCH_SUFFIXES = (".bin", ".pkl", ".pt", ".pth")   # torch.save files
RNG_PREFIX = "random_states_"                      # Accelerate's per-rank RNG states


def rng_globals() -> list:
    """What random_states_N.pkl needs beyond torch's weights_only defaults: NumPy's generator
    state, an array of uint32 (the types Accelerate's own loader allows)."""
    import numpy as np
    core = np._core if hasattr(np, "_core") else np.core   # NumPy 2 / NumPy 1
    extra = [core.multiarray._reconstruct, np.ndarray, np.dtype]
    return extra + ([np.dtypes.UInt32DType] if hasattr(np, "dtypes") else [])


def load_weights_only(source, rng: bool = False):
    """torch.load(weights_only=True) on CPU of a path (memory-mapped: the tensors' bytes are not
    read) or a stream; `rng` also allows RNG_GLOBALS. Raises what torch.load raises."""
    import torch
    with torch.serialization.safe_globals(rng_globals() if rng else []):
        return torch.load(source, map_location="cpu", weights_only=True,
                          mmap=isinstance(source, (str, os.PathLike)))


class _Unsafe(Exception):
    """Why a file may not be loaded."""


def unsafe_content(path: str) -> str | None:
    """None when everything under the checkpoint directory `path` loads without running code;
    else one line: the file and what it would import or call."""
    for root, dirs, names in os.walk(path):
        dirs.sort()
        for name in sorted(names):
            full = os.path.join(root, name)
            rel = os.path.relpath(full, path)
            try:
                if name.endswith(".metadata"):
                    _check_dcp(root, name)
                elif name.endswith(TORCH_SUFFIXES):
                    _check_torch_file(full, rng=name.startswith(RNG_PREFIX))
                elif name.endswith(".safetensors"):
                    _check_safetensors(full)
            except _Unsafe as e:
                return f"file '{rel}' {e}"
            except OSError as e:
                return f"file '{rel}' cannot be read ({one_line(e, with_type=True)})"
    return None


def _check_torch_file(path: str, rng: bool) -> None:
    """fp8train writes torch.save zip archives only: one must load with weights_only=True. A
    legacy pickle or tar file is refused before torch reads it; a file that is neither is not
    unsafe (loading fails at its first byte). An RNG file must load, whatever it holds:
    Accelerate would skip one that fails without a word, and the resume would not be exact."""
    import pickletools
    import tarfile
    with open(path, "rb") as fh:
        head = fh.read(512)
    if head.startswith(b"PK\x03\x04"):
        _load_checked(path, rng)
        return
    try:
        tarfile.open(fileobj=io.BytesIO(head), mode="r:").close()   # the header block suffices
        raise _Unsafe("is a tar archive, not a torch.save zip archive (fp8train never writes one)")
    except tarfile.TarError:
        pass
    if rng or (head and chr(head[0]) in {op.code for op in pickletools.opcodes}):
        raise _Unsafe("is not a torch.save zip archive (fp8train never writes another format)")


def _load_checked(source, rng: bool = False):
    """load_weights_only, with a refusal or failure as _Unsafe naming the global it needs."""
    try:
        return load_weights_only(source, rng)
    except Exception as e:   # pickle.UnpicklingError when refused; torch raises many kinds
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        if found:
            raise _Unsafe(f"needs global '{found.group(1)}', which torch.load(weights_only=True) "
                          f"refuses (unpickling it could run code)") from None
        raise _Unsafe(f"cannot be loaded with torch.load(weights_only=True) "
                      f"({one_line(e, with_type=True)})") from None


def _check_safetensors(path: str) -> None:
    """safetensors holds no code, but Transformer Engine unpickles its `*._extra_state` tensors
    (and the te backend lets it): check those pickles. A file safetensors cannot read is not
    unsafe (loading it fails before anything is unpickled); the manifest reports corruption."""
    from safetensors import safe_open
    try:
        with safe_open(path, framework="pt") as fh:
            extra = {key: fh.get_tensor(key) for key in fh.keys() if key.endswith("_extra_state")}
    except Exception:  # safetensors raises its own error types
        return
    for key, value in extra.items():
        _check_extra_state(value, f"(tensor '{key}')")


def _check_extra_state(value, label: str) -> None:
    """TE unpickles the raw bytes of an `_extra_state` tensor, whatever its dtype."""
    import torch
    if not isinstance(value, torch.Tensor):
        raise _Unsafe(f"{label} is not a tensor".lstrip())
    data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    if data:
        try:
            _check_pickle(data, TE_EXTRA_STATE_GLOBALS)
        except _Unsafe as e:
            raise _Unsafe(f"{label} {e}" if label else str(e)) from None


def _check_dcp(directory: str, name: str) -> None:
    """A torch.distributed.checkpoint directory: its metadata is a plain pickle; its non-tensor
    items are torch.save blobs inside the .distcp files, which DCP loads with
    weights_only=False; a TE `_extra_state` tensor among its items is a pickle too."""
    with open(os.path.join(directory, name), "rb") as fh:
        data = fh.read()
    _check_pickle(data, DCP_METADATA_GLOBALS)
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    try:
        metadata = safe_unpickle(data)
        kinds = metadata.state_dict_metadata
        items = [(str(index.fqn), isinstance(kinds.get(index.fqn), BytesStorageMetadata), info)
                 for index, info in metadata.storage_data.items()]
    except Exception as e:  # passed the scan, yet not DCP metadata
        raise _Unsafe(f"is not torch.distributed.checkpoint metadata ({one_line(e, with_type=True)})") from None
    root = os.path.realpath(directory)
    for fqn, is_bytes, info in items:
        if not (is_bytes or fqn.endswith("_extra_state")):
            continue   # a tensor: DCP reads it with torch.load(weights_only=True)
        where = f"(item '{fqn}' in '{getattr(info, 'relative_path', '?')}')"
        if getattr(info, "transform_descriptors", None):
            raise _Unsafe(f"{where} is stored transformed ({info.transform_descriptors}), "
                          f"which cannot be checked")
        try:
            full = os.path.realpath(os.path.join(directory, str(info.relative_path)))
            if not full.startswith(root + os.sep):
                raise _Unsafe(f"{where} points outside its directory")
            with open(full, "rb") as fh:
                fh.seek(int(info.offset))
                blob = fh.read(int(info.length))
        except (OSError, TypeError, ValueError, AttributeError) as e:
            raise _Unsafe(f"{where} cannot be read ({one_line(e, with_type=True)})") from None
        try:
            value = _load_checked(io.BytesIO(blob))
            if not is_bytes:   # the TE pickle is the tensor's content
                _check_extra_state(value, "")
        except _Unsafe as e:
            raise _Unsafe(f"{where} {e}") from None


def safe_unpickle(data: bytes):
    """pickle.loads limited to DCP_METADATA_GLOBALS (for DCP metadata, a plain pickle), after
    `_check_pickle` passed it."""
    import pickle

    class Limited(pickle.Unpickler):
        def find_class(self, module, name):
            if (module, name) not in DCP_METADATA_GLOBALS:
                raise pickle.UnpicklingError(f"global '{module}.{name}' is not allowed")
            return super().find_class(module, name)

        def persistent_load(self, pid):
            raise pickle.UnpicklingError("persistent ids are not allowed")

    return Limited(io.BytesIO(data)).load()


def _check_pickle(data: bytes, allowed: frozenset) -> None:
    """Run the pickle's opcodes on symbols, not objects: every global it names (GLOBAL, INST,
    STACK_GLOBAL of literal strings) must be in `allowed`, only such globals may be called, and
    the opcodes that reach beyond (extension registry, out-of-band buffers) are refused."""
    import pickletools
    machine = _Symbolic(allowed)
    try:
        for op, arg, _ in pickletools.genops(io.BytesIO(data)):
            if op.name == "STOP":
                return
            machine.run(op.name, arg)
    except ValueError as e:   # pickletools: truncated or not a pickle
        raise _Unsafe(f"is not a readable pickle ({one_line(e, with_type=True)})") from None
    raise _Unsafe("is not a readable pickle (no STOP)")


class _Symbolic:
    """The unpickler's stack and memo, holding symbols: literals as themselves, globals as
    _Global, what calling one (or building a list or dict) would make as _Object."""

    def __init__(self, allowed: frozenset):
        self.allowed, self.mark, self.stack, self.memo, self.proto = allowed, object(), [], {}, 0

    def pop(self, n: int = 1) -> list:
        stack = self.stack
        if len(stack) < n or any(v is self.mark for v in stack[len(stack) - n:]):
            raise _Unsafe("is not a well-formed pickle (stack underflow)")
        out = stack[len(stack) - n:]
        del stack[len(stack) - n:]
        return out

    def pop_mark(self) -> list:
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i] is self.mark:
                out = self.stack[i + 1:]
                del self.stack[i:]
                return out
        raise _Unsafe("is not a well-formed pickle (no MARK)")

    def name(self, module: str, qual: str) -> "_Global":
        from _compat_pickle import IMPORT_MAPPING, NAME_MAPPING
        if self.proto < 3 and (module, qual) in NAME_MAPPING:
            module, qual = NAME_MAPPING[(module, qual)]
        elif self.proto < 3 and module in IMPORT_MAPPING:
            module = IMPORT_MAPPING[module]
        if (module, qual) not in self.allowed:
            raise _Unsafe(f"needs global '{module}.{qual}', which no checkpoint needs (unpickling "
                          f"it could run code)")
        return _Global(module, qual)

    def call(self, func, args) -> "_Object":
        if not isinstance(func, _Global):
            raise _Unsafe("calls something other than an allowed global")
        if (func.module, func.name) == ("torch.storage", "_load_from_bytes"):
            if (not isinstance(args, tuple) or len(args) != 1
                    or not isinstance(args[0], (bytes, bytearray))):
                raise _Unsafe("calls '_load_from_bytes' on other than literal bytes")
            _load_checked(io.BytesIO(bytes(args[0])))
        return _Object(func)

    def run(self, code: str, arg) -> None:
        """One opcode: those that name, call or build objects here, the others in `_data`."""
        if code in ("GLOBAL", "INST"):
            module, _, qual = arg.partition(" ")
            g = self.name(module, qual)
            self.stack.append(self.call(g, tuple(self.pop_mark())) if code == "INST" else g)
        elif code == "STACK_GLOBAL":
            module, qual = self.pop(2)
            if not (isinstance(module, str) and isinstance(qual, str)):
                raise _Unsafe("names a global it computes (STACK_GLOBAL of non-literals)")
            self.stack.append(self.name(module, qual))
        elif code in ("REDUCE", "NEWOBJ"):
            func, args = self.pop(2)
            self.stack.append(self.call(func, args))
        elif code == "NEWOBJ_EX":
            cls, args, _kw = self.pop(3)
            self.stack.append(self.call(cls, args))
        elif code == "OBJ":
            items = self.pop_mark()
            if not items:
                raise _Unsafe("is not a well-formed pickle (OBJ without a class)")
            self.stack.append(self.call(items[0], tuple(items[1:])))
        elif code == "BUILD":
            self.pop()
            if not self.stack or not isinstance(self.stack[-1], _Object):
                raise _Unsafe("sets the state of something that is not an object it made")
        elif code in ("EXT1", "EXT2", "EXT4", "NEXT_BUFFER", "READONLY_BUFFER"):
            raise _Unsafe(f"uses pickle opcode {code}, which no checkpoint needs")
        else:
            self._data(code, arg)

    def _data(self, code: str, arg) -> None:
        """Opcodes that move literals, containers and memo entries."""
        stack = self.stack
        if code == "PROTO":
            self.proto = arg
        elif code == "FRAME":
            pass
        elif code == "MARK":
            stack.append(self.mark)
        elif code in ("TUPLE", "LIST", "DICT", "FROZENSET"):
            items = self.pop_mark()
            stack.append(tuple(items) if code == "TUPLE" else _Object(None))
        elif code in ("TUPLE1", "TUPLE2", "TUPLE3"):
            stack.append(tuple(self.pop(int(code[-1]))))
        elif code == "EMPTY_TUPLE":
            stack.append(())
        elif code in ("EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET", "BYTEARRAY8"):
            stack.append(_Object(None))
        elif code in ("APPEND", "SETITEM"):
            self.pop(1 if code == "APPEND" else 2)
        elif code in ("APPENDS", "SETITEMS", "ADDITEMS", "POP_MARK"):
            self.pop_mark()
        elif code == "POP":
            self.pop()
        elif code == "DUP":
            stack.append(self.pop()[0])
            stack.append(stack[-1])
        elif code in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"):
            top = self.pop()[0]
            stack.append(top)
            self.memo[len(self.memo) if code == "MEMOIZE" else arg] = top
        elif code in ("GET", "BINGET", "LONG_BINGET"):
            if arg not in self.memo:
                raise _Unsafe("is not a well-formed pickle (unknown memo entry)")
            stack.append(self.memo[arg])
        elif code == "PERSID":
            stack.append(_Object(None))
        elif code == "BINPERSID":
            self.pop()
            stack.append(_Object(None))
        elif code in _LITERALS:
            stack.append(arg)   # (True, False and None as None: only text and bytes matter)
        else:
            raise _Unsafe(f"uses pickle opcode {code}, which no checkpoint needs")


_LITERALS = frozenset({
    "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "FLOAT", "BINFLOAT", "NONE",
    "NEWTRUE", "NEWFALSE", "STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE",
    "SHORT_BINUNICODE", "BINUNICODE8", "BINBYTES", "SHORT_BINBYTES", "BINBYTES8"})


class _Global:
    def __init__(self, module: str, name: str):
        self.module, self.name = module, name


class _Object:
    """What calling an allowed global (or building a list or dict) would have made."""

    def __init__(self, made_by):
        self.made_by = made_by
