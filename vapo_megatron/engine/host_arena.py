"""Host memory of exactly the size asked for, page-locked on a GPU machine: the buffer the
training state goes to while vLLM is awake (``offload.TrainingOffload``).

Why not ``torch.empty(n, pin_memory=True)``: that goes through torch's caching host allocator
(torch 2.13, ``ATen/core/CachingHostAllocator.h``), which rounds every request up to the next
power of two (``pinned_max_round_threshold`` is unlimited by default) and keeps a freed block
cached for the next request of its size until ``torch._C._host_emptyCache()``: 20.7 GiB asked
pins 32 GiB, and freeing it gives nothing back to the system. Here the bytes are an ordinary
host tensor of exactly ``nbytes`` (torch's CPU allocator), page-locked in place with
``cudaHostRegister`` through ``torch.cuda.cudart()`` (as torch's own
``torch/cuda/_pin_memory_utils.py`` does; those bindings have no ``cudaHostAlloc``) and
unregistered before it is freed: pinned bytes equal requested bytes, and a release gives them
back at once. The driver reads registered memory as pinned, so copies to and from the device
run at DMA speed as from ``cudaHostAlloc`` memory.

Pinning is slow (the kernel locks every page: seconds for tens of GiB), so an arena is
allocated once and reused; it grows (one new allocation of the new exact size, the old one
released first) only when more is asked for than it holds.
"""

from __future__ import annotations

import logging
import weakref

import torch

from vapo_megatron.parallel.devices import HOST

logger = logging.getLogger(__name__)

HOST_REGISTER_PORTABLE = 1
"""cudaHostRegisterPortable: pinned for every CUDA context of the process."""


def allocate_host(nbytes: int, *, pin: bool) -> torch.Tensor:
    """``nbytes`` of host memory as a flat uint8 tensor, page-locked when ``pin``."""
    buffer = torch.empty(nbytes, dtype=torch.uint8, device=HOST)
    if pin and nbytes:
        error = int(
            torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, HOST_REGISTER_PORTABLE)
        )
        if error:
            raise RuntimeError(
                f"cudaHostRegister of {nbytes} bytes failed with cudaError {error}: the node may "
                "be out of host memory to lock (what the other ranks pinned, a container's "
                "memory limit); compare tools/plan.py's pinned host memory per node with it"
            )
    return buffer


def free_host(buffer: torch.Tensor, *, pin: bool) -> None:
    """Unpin a buffer from :func:`allocate_host` (the caller drops the tensor after)."""
    if pin and buffer.numel():
        error = int(torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr()))
        if error:
            raise RuntimeError(f"cudaHostUnregister failed with cudaError {error}")


class HostArena:
    """One host buffer, reused across steps; views of it are carved by the caller."""

    def __init__(self, *, pin: bool) -> None:
        self.pin = pin
        self.buffer: torch.Tensor | None = None
        self._unpin: weakref.finalize | None = None

    @property
    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()

    def reserve(self, nbytes: int) -> torch.Tensor:
        """The buffer, at least ``nbytes`` long: the current one when it holds that many, else a
        new one of exactly ``nbytes`` (the old one released first: nothing may view it then)."""
        if self.buffer is not None and self.nbytes >= nbytes:
            return self.buffer
        if self.buffer is not None:
            logger.info(
                "host arena grows from %.3f to %.3f GiB", self.nbytes / 2**30, nbytes / 2**30
            )
        self.release()
        self.buffer = allocate_host(nbytes, pin=self.pin)
        # Unpinned before the tensor is freed even if the owner forgets release(); not at
        # interpreter exit, where the process gives every page back anyway.
        self._unpin = weakref.finalize(self, free_host, self.buffer, pin=self.pin)
        self._unpin.atexit = False
        return self.buffer

    def release(self) -> None:
        """Give the memory back (unpinned first). The next :meth:`reserve` allocates again."""
        if self._unpin is not None:
            self._unpin()
        self._unpin = None
        self.buffer = None
