"""vLLM's CPU KV cache in shared memory, so kvtier can map it: the
connector's ``get_mem_pool_context`` runs vLLM's allocation of the cache
inside :class:`SharedAllocation`, which puts it in a memfd the worker
registers over the same-host socket (:mod:`kvtier.connectors.vllm.blocks`:
kvtier then copies blocks straight into and out of its pages)."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ...memory.shm import SharedBuffer

#: The KV cache allocations ``get_mem_pool_context`` moves into shared memory
#: are those of at least this many bytes (vLLM allocates the whole cache as
#: one ``torch.zeros`` of int8; smaller tensors made meanwhile stay where
#: torch puts them).
SHARED_ALLOCATION_BYTES_MIN = 1 << 20


class SharedAllocation(TorchDispatchMode):
    """Puts the large CPU ``zeros``/``empty`` allocations made inside it in
    :class:`~kvtier.SharedBuffer` memfds (vLLM allocates its KV cache as one
    ``torch.zeros`` of int8 inside the connector's ``get_mem_pool_context``)."""

    def __init__(self, buffers: list[SharedBuffer]) -> None:
        super().__init__()
        self.buffers = buffers

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in (torch.ops.aten.zeros.default, torch.ops.aten.empty.memory_format) and args:
            dtype = kwargs.get("dtype") or torch.get_default_dtype()
            device = kwargs.get("device")
            shape = list(args[0])
            count = 1
            for dim in shape:
                count *= int(dim)
            nbytes = count * torch.empty((), dtype=dtype).element_size()
            if (device is None or torch.device(device).type == "cpu") and nbytes >= SHARED_ALLOCATION_BYTES_MIN:
                buffer = SharedBuffer(nbytes, name="kvtier-vllm-kv-cache")
                tensor = buffer.torch().view(dtype).view(shape)  # a fresh memfd reads as zeros
                # torch.zeros writes every page now. A memfd's pages would come on
                # first touch instead: the kernel zeroing each inside a load, on
                # kvtier's CPU (0.5 CPU-seconds a GiB here, docs/BENCHMARKS.md,
                # issue 54). Reserve them (a clean error, not a SIGBUS, when memory
                # is short), then write them as torch.zeros would.
                try:
                    os.posix_fallocate(buffer.fd, 0, nbytes)
                except OSError:
                    pass  # no room reserved: pages come on first touch, as before
                else:
                    tensor.zero_()
                self.buffers.append(buffer)
                return tensor
        return func(*args, **kwargs)
