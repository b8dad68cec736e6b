"""Checkpoints are safe to load: every pickle in a checkpoint is read without running it, and
one that names anything beyond what real checkpoints contain is refused.

Accelerate reads model.safetensors with safetensors (no code), but optimizer.bin,
random_states_N.pkl, scaler.pt, ... with torch.load, custom_checkpoint_N.pkl (our TrainState)
with torch.load(weights_only=False), an FSDP checkpoint's .metadata with pickle.load and its
non-tensor items with torch.load(weights_only=False); Transformer Engine unpickles its
`_extra_state` tensors. Unpickling runs whatever a pickle names, so a checkpoint from someone
else could run code. `unsafe_content` reads every such pickle without running it and refuses
one that names anything beyond what real checkpoints contain: a pickle can only import and
call what it names. The allowlist is (module, name) pairs seen in checkpoints of fp32,
native-FP8 and torchao runs and in DCP directories, plus the same kinds for the other dtypes
a run keeps: types, dtypes and tensor rebuilders; nothing that reaches files, processes or
arbitrary attributes (never builtins such as getattr, eval or exec).
"""
from __future__ import annotations

import os


def describe_error(e: BaseException) -> str:
    """An exception in one line: an OSError's reason and file, else type and message."""
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}" + (f": '{e.filename}'" if e.filename else "")
    text = " ".join(str(e).split())[:300]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


_STORAGE_TYPES = ("Float", "BFloat16", "Half", "Long", "Int", "Byte", "Bool")
_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "int64", "int32",
           "uint8", "bool")
SAFE_GLOBALS = frozenset({
    # tensors as torch.save writes them (state dicts, Adam's moments and step, RNG states)
    ("collections", "OrderedDict"),             # state dicts; each tensor's (empty) hooks
    ("torch._utils", "_rebuild_tensor_v2"),     # a tensor
    *(("torch", f"{t}Storage") for t in _STORAGE_TYPES),   # ... and its storage's type
    ("torch._utils", "_rebuild_tensor_v3"),     # a float8 tensor (no legacy storage type)
    ("torch.storage", "UntypedStorage"),        # ... and its storage
    *(("torch", d) for d in _DTYPES),           # dtypes as values (v3 tensors, DCP metadata)
    ("torch", "Size"),                          # shapes in DCP metadata
    # the NumPy generator state in random_states_N.pkl (an array of uint32); bytes objects
    # under pickle protocol 2 (torch.save's) are written as _codecs.encode(str, "latin1")
    ("numpy._core.multiarray", "_reconstruct"),  # NumPy 2
    ("numpy.core.multiarray", "_reconstruct"),   # NumPy 1 (pyproject allows >= 1.24)
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("_codecs", "encode"),                       # only ever called as (str, "latin1"): checked
    # an FSDP checkpoint's torch.distributed.checkpoint .metadata: plain dataclasses and enums
    *(("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),      # torch.strided, by name
    ("pathlib", "PosixPath"),                    # StorageMeta.checkpoint_id
    ("pathlib._local", "PosixPath"),             # ... as Python 3.13 names it
})
# Transformer Engine's `_extra_state` (a pickle in a uint8 tensor, which TE unpickles on load
# and the te backend lets it): the recipe fp8train builds (DelayedScaling, its Format enum and
# the enum's value type) and the FP8 scales, CPU tensors that plain pickle writes as
# _load_from_bytes(a torch.save blob), which is checked like a file. Taken from TE's source: no
# real TE checkpoint was scanned (TE needs a GPU); anything else there is refused.
TE_EXTRA_STATE_GLOBALS = SAFE_GLOBALS | frozenset({
    *(("transformer_engine.common.recipe", n) for n in ("DelayedScaling", "Format",
                                                         "_FormatHelper")),
    ("torch.storage", "_load_from_bytes"),
})
PICKLE_SUFFIXES = (".bin", ".pkl", ".pt", ".pth")   # torch.save files Accelerate may torch.load
_NESTING = 4                                        # torch.save blobs inside pickles, at most


class _Unsafe(Exception):
    """Why a pickle may not be loaded."""


def unsafe_content(path: str) -> str | None:
    """None when every pickle-based file under the checkpoint directory `path` names only
    allowlisted globals; else one line: the file and what it would import or call. Nothing is
    unpickled or imported from the files (DCP metadata that passed is read with an unpickler
    limited to the allowlist, to find the items it describes)."""
    for root, dirs, names in os.walk(path):
        dirs.sort()
        for name in sorted(names):
            full = os.path.join(root, name)
            rel = os.path.relpath(full, path)
            try:
                if name.endswith(".metadata"):
                    _check_dcp(root, name)
                elif name.endswith(PICKLE_SUFFIXES):
                    with open(full, "rb") as fh:   # only the zip directory and data.pkl are read
                        _check_torch_file(fh, SAFE_GLOBALS, top=True)
                elif name.endswith(".safetensors"):
                    _check_safetensors(full)
            except _Unsafe as e:
                return f"file '{rel}' {e}"
            except OSError as e:
                return f"file '{rel}' cannot be read ({describe_error(e)})"
    return None


def _check_torch_file(source, allowed: frozenset, top: bool = False, depth: int = 0) -> None:
    """What torch.load would unpickle from `source` (bytes, or a file open for reading): a zip
    archive's data.pkl, read with torch's own zip reader so that both see the same archive; in
    a blob nested in a pickle, also the legacy format."""
    import io
    stream = io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source
    magic = stream.read(4)
    stream.seek(0)
    if magic == b"PK\x03\x04":
        import torch
        try:
            with torch.serialization._open_zipfile_reader(stream) as zf:
                records = zf.get_all_records()
                if any(r == "constants.pkl" or r.endswith("/constants.pkl") for r in records):
                    raise _Unsafe("is a TorchScript archive (torch.load would run its code)")
                pickled = zf.get_record("data.pkl")
        except _Unsafe:
            raise
        except Exception as e:   # torch's zip reader raises RuntimeError, or worse
            raise _Unsafe(f"is not a readable torch.save archive ({describe_error(e)})") from None
        _check_pickle(pickled, allowed, depth)
    elif top:   # on disk torch.load also reads tar archives and pickles: ours never are
        import pickletools
        import tarfile
        try:
            tarfile.open(fileobj=stream, mode="r:").close()
            is_tar = True
        except Exception:   # tarfile.ReadError, mostly
            is_tar = False
        if is_tar:
            raise _Unsafe("is a tar archive (torch.load would unpickle its members)")
        stream.seek(0)
        first = stream.read(1).decode("latin-1")
        if first and first in {op.code for op in pickletools.opcodes}:
            raise _Unsafe("is not a torch.save zip archive (torch.load would unpickle it)")
        # else not a pickle at all: torch.load fails at the first byte, before anything runs
    else:       # torch.load of a BytesIO: the legacy format, five pickles, then raw storages
        for _ in range(5):
            _check_pickle(stream, allowed, depth)


def _check_pickle(data, allowed: frozenset, depth: int = 0) -> None:
    """Run the pickle's opcodes on symbols, not objects: every global it names (GLOBAL, INST,
    STACK_GLOBAL of literal strings) must be in `allowed`, only such globals may be called, and
    the opcodes that reach beyond (extension registry, out-of-band buffers) are refused.
    `data` is bytes or a stream (left after the pickle's STOP)."""
    import io
    import pickletools
    from _compat_pickle import IMPORT_MAPPING, NAME_MAPPING
    stream = io.BytesIO(data) if isinstance(data, (bytes, bytearray)) else data
    mark, stack, memo, proto = object(), [], {}, 0

    def pop(n=1):
        if len(stack) < n or any(v is mark for v in stack[len(stack) - n:]):
            raise _Unsafe("is not a well-formed pickle (stack underflow)")
        out = stack[len(stack) - n:]
        del stack[len(stack) - n:]
        return out

    def pop_mark():
        for i in range(len(stack) - 1, -1, -1):
            if stack[i] is mark:
                out = stack[i + 1:]
                del stack[i:]
                return out
        raise _Unsafe("is not a well-formed pickle (no MARK)")

    def name(module, qual, mapped):
        if mapped and (module, qual) in NAME_MAPPING:
            module, qual = NAME_MAPPING[(module, qual)]
        elif mapped and module in IMPORT_MAPPING:
            module = IMPORT_MAPPING[module]
        if (module, qual) not in allowed:
            raise _Unsafe(f"needs global '{module}.{qual}', which no checkpoint needs (unpickling "
                          f"it could run code)")
        return _Global(module, qual)

    def call(func, args):
        if not isinstance(func, _Global):
            raise _Unsafe("calls something other than an allowed global")
        if (func.module, func.name) == ("_codecs", "encode"):
            if (not isinstance(args, tuple) or len(args) != 2 or not isinstance(args[0], str)
                    or args[1] not in ("latin1", "latin-1")):
                raise _Unsafe("calls '_codecs.encode' with other than (text, 'latin1')")
            return args[0].encode("latin1")
        if (func.module, func.name) == ("torch.storage", "_load_from_bytes"):
            if (not isinstance(args, tuple) or len(args) != 1
                    or not isinstance(args[0], (bytes, bytearray))):
                raise _Unsafe("calls '_load_from_bytes' on other than literal bytes")
            if depth >= _NESTING:
                raise _Unsafe("nests torch.save blobs too deeply")
            _check_torch_file(bytes(args[0]), allowed, depth=depth + 1)
        return _Object(func)

    try:
        for op, arg, _ in pickletools.genops(stream):
            code = op.name
            if code == "PROTO":
                proto = arg
            elif code in ("FRAME", "STOP"):
                pass
            elif code in ("GLOBAL", "INST"):
                module, _, qual = arg.partition(" ")
                g = name(module, qual, mapped=proto < 3)
                stack.append(call(g, tuple(pop_mark())) if code == "INST" else g)
            elif code == "STACK_GLOBAL":
                module, qual = pop(2)
                if not (isinstance(module, str) and isinstance(qual, str)):
                    raise _Unsafe("names a global it computes (STACK_GLOBAL of non-literals)")
                stack.append(name(module, qual, mapped=proto < 3))
            elif code == "REDUCE":
                func, args = pop(2)
                stack.append(call(func, args))
            elif code == "NEWOBJ":
                cls, args = pop(2)
                stack.append(call(cls, args))
            elif code == "NEWOBJ_EX":
                cls, args, _kw = pop(3)
                stack.append(call(cls, args))
            elif code == "OBJ":
                items = pop_mark()
                if not items:
                    raise _Unsafe("is not a well-formed pickle (OBJ without a class)")
                stack.append(call(items[0], tuple(items[1:])))
            elif code == "BUILD":
                pop()
                if not stack or not isinstance(stack[-1], _Object):
                    raise _Unsafe("sets the state of something that is not an object it made")
            elif code in ("EXT1", "EXT2", "EXT4", "NEXT_BUFFER", "READONLY_BUFFER"):
                raise _Unsafe(f"uses pickle opcode {code}, which no checkpoint needs")
            elif code == "MARK":
                stack.append(mark)
            elif code in ("TUPLE", "LIST", "DICT", "FROZENSET"):
                items = pop_mark()
                stack.append(tuple(items) if code == "TUPLE" else _Object(None))
            elif code in ("TUPLE1", "TUPLE2", "TUPLE3"):
                stack.append(tuple(pop(int(code[-1]))))
            elif code == "EMPTY_TUPLE":
                stack.append(())
            elif code in ("EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET", "BYTEARRAY8"):
                stack.append(_Object(None))
            elif code in ("APPEND", "SETITEM"):
                pop(1 if code == "APPEND" else 2)
            elif code in ("APPENDS", "SETITEMS", "ADDITEMS", "POP_MARK"):
                pop_mark()
            elif code == "POP":
                pop()
            elif code == "DUP":
                stack.append(pop()[0])
                stack.append(stack[-1])
            elif code in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"):
                top = pop()[0]
                stack.append(top)
                memo[len(memo) if code == "MEMOIZE" else arg] = top
            elif code in ("GET", "BINGET", "LONG_BINGET"):
                if arg not in memo:
                    raise _Unsafe("is not a well-formed pickle (unknown memo entry)")
                stack.append(memo[arg])
            elif code == "PERSID":
                stack.append(_Object(None))
            elif code == "BINPERSID":
                pop()
                stack.append(_Object(None))
            elif code in _LITERALS:
                stack.append(arg)   # (True, False and None as None: only text and bytes matter)
            else:
                raise _Unsafe(f"uses pickle opcode {code}, which no checkpoint needs")
            if code == "STOP":
                return
    except ValueError as e:   # pickletools: truncated or not a pickle
        raise _Unsafe(f"is not a readable pickle ({describe_error(e)})") from None
    raise _Unsafe("is not a readable pickle (no STOP)")


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


def _check_safetensors(path: str) -> None:
    """safetensors holds no code, but Transformer Engine unpickles its `*._extra_state` tensors
    (and the TE backend lets it): check those pickles. A file safetensors cannot read is not
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
    _check_pickle(data, SAFE_GLOBALS)
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    try:
        metadata = safe_unpickle(data)
        kinds = metadata.state_dict_metadata
        items = [(str(index.fqn), isinstance(kinds.get(index.fqn), BytesStorageMetadata), info)
                 for index, info in metadata.storage_data.items()]
    except Exception as e:  # passed the scan, yet not DCP metadata
        raise _Unsafe(f"is not torch.distributed.checkpoint metadata ({describe_error(e)})") from None
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
            raise _Unsafe(f"{where} cannot be read ({describe_error(e)})") from None
        try:
            _check_torch_file(blob, SAFE_GLOBALS, top=True)
            if not is_bytes:   # the TE pickle is the tensor's content
                import io
                import torch
                try:
                    tensor = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
                except Exception as e:   # torch raises many kinds
                    raise _Unsafe(f"cannot be read ({describe_error(e)})") from None
                _check_extra_state(tensor, "")
        except _Unsafe as e:
            raise _Unsafe(f"{where} {e}") from None


def safe_unpickle(data: bytes):
    """pickle.loads limited to SAFE_GLOBALS (for DCP metadata, which is a plain pickle)."""
    import io
    import pickle

    class Limited(pickle.Unpickler):
        def find_class(self, module, name):
            if (module, name) not in SAFE_GLOBALS:
                raise pickle.UnpicklingError(f"global '{module}.{name}' is not allowed")
            return super().find_class(module, name)

        def persistent_load(self, pid):
            raise pickle.UnpicklingError("persistent ids are not allowed")

    return Limited(io.BytesIO(data)).load()


