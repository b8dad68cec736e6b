"""Copies of state dicts in host memory, for a checkpoint written in the background
(`checkpoint_async`): training goes on and updates the parameters and the optimizer's moments in
place, so the writer must get copies taken at the step, not the live tensors.

Each tensor's whole storage is copied once, and the copies are views of it with the tensor's own
offset, size and strides: tensors that share a storage (tied embeddings, views) share their copy,
as the originals do. That keeps what the savers do with aliases unchanged (Accelerate drops the
second name of a shared tensor before safetensors writes the model; torch.save writes a storage
once), so the files are the ones a synchronous save writes. The buffers are kept from one save to
the next (pinned memory on CUDA, so that the device-to-host copies run at full speed, once for the
run): the caller must not copy again while a writer still reads the previous copy. torch's host
allocator rounds each pinned buffer up to a power of two, so on CUDA the page-locked memory held
can reach twice the state's size (`nbytes` counts the bytes asked for).
"""
from __future__ import annotations

import copy
from collections import OrderedDict

import torch


class HostCopy:
    def __init__(self):
        self._buffers: list = []   # (uint8 tensor, pinned), one per storage, reused by position
        self._used = 0
        self._memo: dict = {}
        self._device_copies: set = set()

    @property
    def nbytes(self) -> int:
        """Host memory held by the copies."""
        return sum(b.numel() for b, _ in self._buffers)

    def copy(self, obj):
        """`obj` (state dicts: nested dicts, lists and tuples of tensors and plain values) with
        every tensor copied into host memory; plain values are deep-copied."""
        self._used, self._memo, self._device_copies = 0, {}, set()
        try:
            out = self._walk(obj)
            for device in self._device_copies:
                torch.cuda.synchronize(device)   # the non-blocking copies have landed
        finally:
            self._memo = {}
        del self._buffers[self._used:]   # what a smaller state no longer needs
        return out

    def _walk(self, obj):
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj)
        if isinstance(obj, dict):
            out = OrderedDict() if isinstance(obj, OrderedDict) else {}
            for key, value in obj.items():
                out[key] = self._walk(value)
            meta = getattr(obj, "_metadata", None)   # what nn.Module.state_dict attaches
            if meta is not None:
                out._metadata = copy.deepcopy(meta)
            return out
        if isinstance(obj, list):
            return [self._walk(v) for v in obj]
        if type(obj) is tuple:
            return tuple(self._walk(v) for v in obj)
        return copy.deepcopy(obj)

    def _tensor(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if type(t) is not torch.Tensor or t.layout != torch.strided or t.is_quantized:
            return t.to("cpu", copy=True)   # a tensor subclass or a sparse one: a plain copy
        storage = t.untyped_storage()
        key = (t.device, storage.data_ptr(), storage.nbytes())
        host = self._memo.get(key)
        if host is None:
            cuda = t.device.type == "cuda"
            buf = self._buffer(storage.nbytes(), pin=cuda)
            if storage.nbytes():
                whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
                buf.copy_(whole, non_blocking=cuda)
                if cuda:
                    self._device_copies.add(t.device)
            host = self._memo[key] = buf.untyped_storage()
        return torch.empty(0, dtype=t.dtype).set_(host, t.storage_offset(), t.size(), t.stride())

    def _buffer(self, nbytes: int, pin: bool) -> torch.Tensor:
        i = self._used
        self._used += 1
        if i < len(self._buffers):
            old, pinned = self._buffers[i]
            if old.numel() == nbytes and pinned == pin:
                return old
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        if i < len(self._buffers):
            self._buffers[i] = (buf, pin)
        else:
            self._buffers.append((buf, pin))
        return buf
