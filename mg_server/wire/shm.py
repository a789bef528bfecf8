"""A preallocated buffer of K/V-column slots shared between processes.

Layout: data [n_slots, layers, 2, kv_heads, head_dim] in the model dtype (index 2: 0 = K after
RoPE, 1 = V), plus a generation header gens [n_slots] int64 in CPU shared memory.
  - kind "cpu": data lives in POSIX shared memory (multiprocessing.shared_memory), opened by name.
  - kind "cuda": data is one CUDA allocation shared through CUDA IPC (the storage's IPC handle
    travels once, in the hello reply); readers copy device-to-device.
Writer protocol (seqlock): gens[s] = -1, write data, synchronise, gens[s] = gen. A reader copies
the slot and then checks gens[s] == gen: a slot reused while it was read is detected, never
silently returned. Messages carry (slot, gen) only.
A CUDA buffer is registered in its owner's process: CUDA cannot open an IPC handle in the process
that made it, so a reader in that process (tests) gets the owner's tensor itself.
"""

from __future__ import annotations

import mmap
import os
from multiprocessing import shared_memory

import torch
from torch import Tensor

from mg_server.wire.protocol import ShmSpec


# CUDA slot buffers created in this process, by shm name (see module doc).
_LOCAL_CUDA: dict[str, Tensor] = {}


class StaleSlot(RuntimeError):
    """The slot was overwritten (or not yet written) for the generation asked for."""


class _Attached:
    """A reader's mapping of an existing segment, outside multiprocessing's resource tracker
    (which would otherwise unlink or double-account the owner's segment)."""

    def __init__(self, name: str):
        fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
        try:
            self._mmap = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        self.buf = memoryview(self._mmap)

    def close(self) -> None:
        self.buf.release()
        self._mmap.close()

    def unlink(self) -> None:
        pass


def _open_shm(name: str, create: bool, size: int = 0):
    if create:  # the owner's segment is tracked: unlinked if the owner dies without closing
        try:
            return shared_memory.SharedMemory(name=name, create=True, size=size)
        except FileExistsError:  # left by a crashed worker of the same (per-instance) name
            os.unlink(f"/dev/shm/{name}")
            return shared_memory.SharedMemory(name=name, create=True, size=size)
    return _Attached(name)


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


class SlotBuffer:
    def __init__(self, spec: ShmSpec, data: Tensor, gens: Tensor, shms: list, owner: bool):
        self.spec = spec
        self.data = data  # [n_slots, L, 2, Hkv, D] model dtype, cpu shared memory or cuda
        self.gens = gens  # [n_slots] int64, cpu shared memory
        self._shms = shms
        self._owner = owner

    @classmethod
    def create(cls, name: str, n_slots: int, layers: int, kv_heads: int, head_dim: int,
               dtype: torch.dtype, device: torch.device | str) -> "SlotBuffer":
        device = torch.device(device)
        shape = [n_slots, layers, 2, kv_heads, head_dim]
        dname = str(dtype).removeprefix("torch.")
        gshm = _open_shm(name + "_g", True, 8 * n_slots)
        gens = torch.frombuffer(gshm.buf, dtype=torch.int64, count=n_slots)
        gens.fill_(-1)
        shms = [gshm]
        if device.type == "cuda":
            data = torch.zeros(shape, dtype=dtype, device=device)
            _LOCAL_CUDA[name] = data
            fields = data.untyped_storage()._share_cuda_()
            spec = ShmSpec(kind="cuda", name=name, n_slots=n_slots, shape=shape, dtype=dname,
                           cuda_device=device.index if device.index is not None else 0,
                           cuda_ipc=list(fields))
        else:
            numel = 1
            for s in shape:
                numel *= s
            dshm = _open_shm(name, True, numel * torch.empty((), dtype=dtype).element_size())
            data = torch.frombuffer(dshm.buf, dtype=dtype, count=numel).view(shape)
            data.zero_()
            shms.append(dshm)
            spec = ShmSpec(kind="cpu", name=name, n_slots=n_slots, shape=shape, dtype=dname)
        return cls(spec, data, gens, shms, owner=True)

    @classmethod
    def attach(cls, spec: ShmSpec) -> "SlotBuffer":
        dtype = _dtype(spec.dtype)
        gshm = _open_shm(spec.name + "_g", False)
        gens = torch.frombuffer(gshm.buf, dtype=torch.int64, count=spec.n_slots)
        shms = [gshm]
        if spec.kind == "cuda" and spec.name in _LOCAL_CUDA:  # the owner is in this process
            data = _LOCAL_CUDA[spec.name]
        elif spec.kind == "cuda":
            f = list(spec.cuda_ipc)
            storage = torch.UntypedStorage._new_shared_cuda(*f)
            data = torch.empty(0, dtype=dtype, device=f"cuda:{spec.cuda_device}")
            data.set_(storage, 0, spec.shape)
        else:
            dshm = _open_shm(spec.name, False)
            numel = 1
            for s in spec.shape:
                numel *= s
            data = torch.frombuffer(dshm.buf, dtype=dtype, count=numel).view(spec.shape)
            shms.append(dshm)
        return cls(spec, data, gens, shms, owner=False)

    def write(self, slot: int, column: Tensor, gen: int) -> None:
        """Producer: column [L, 2, Hkv, D] on the buffer's device, stamped with `gen` (>= 0)."""
        self.write_many([(slot, column, gen)])

    def write_many(self, entries: list[tuple[int, Tensor, int]]) -> None:
        """Producer: (slot, column, gen) for each entry, with one stream sync for all of them
        (a verify call's results; a sync per column cost ~0.1 ms each on the H100)."""
        if not entries:
            return
        for slot, _, _ in entries:
            self.gens[slot] = -1
        if self.data.is_cuda:  # a kernel's copy, not a copy engine's (wire.zerocopy)
            from mg_server.wire.zerocopy import copy_
        for slot, column, _ in entries:
            if self.data.is_cuda:
                copy_(column.contiguous(), self.data[slot])
            else:
                self.data[slot].copy_(column)
        if self.data.is_cuda:
            torch.cuda.current_stream(self.data.device).synchronize()  # data visible before gen
        for slot, _, gen in entries:
            self.gens[slot] = gen

    def read(self, slot: int, gen: int, out: Tensor | None = None) -> Tensor:
        """Reader: a copy of slot's column [L, 2, Hkv, D]; raises StaleSlot if gen does not match."""
        if int(self.gens[slot]) != gen:
            raise StaleSlot(f"slot {slot} holds generation {int(self.gens[slot])}, not {gen}")
        out = self.data[slot].clone() if out is None else out.copy_(self.data[slot])
        if self.data.is_cuda:
            torch.cuda.current_stream(self.data.device).synchronize()
        if int(self.gens[slot]) != gen:
            raise StaleSlot(f"slot {slot} was overwritten while being read (generation {gen})")
        return out

    def unlink(self) -> None:
        """Owner: remove the segments' names now (mappings stay valid until closed or exit)."""
        for shm in self._shms if self._owner else ():
            try:
                shm.unlink()
            except FileNotFoundError:
                pass

    def close(self) -> None:
        if self._owner:
            _LOCAL_CUDA.pop(self.spec.name, None)
        self.data = self.gens = None  # type: ignore[assignment]  # drop views before closing
        for shm in self._shms:
            try:
                shm.close()
                if self._owner:
                    shm.unlink()
            except (BufferError, FileNotFoundError):
                pass
        self._shms = []
