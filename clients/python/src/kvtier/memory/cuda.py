"""Page-locking host memory for the GPU through the CUDA driver API.

A host-to-device copy from pageable memory goes through the driver's own
pinned bounce buffer, one chunk at a time; from page-locked memory the GPU's
DMA engine reads the pages themselves (on an H200, 55 GB/s against 10–17
GB/s pageable: DeepSpeed#8283). :meth:`kvtier.Client.pin_arenas` page-locks
kvtier's RAM-tier arenas, mapped read-only in this process for leases, with
``cuMemHostRegister``, so a ``gpu_tensor.copy_(leases.torch(i))`` reads
kvtier's memory directly: no copy on the host at all.

This module calls the driver (``libcuda.so.1``) with ctypes rather than
through torch, for two reasons: the arena is mapped read-only, which needs
the driver's ``CU_MEMHOSTREGISTER_READ_ONLY`` flag (the runtime's
``cudaHostRegisterReadOnly``, which torch's ``cudart()`` binding does not
name), and the same code then runs against the fake driver of
server/tests/fake-cuda in CI. Registration is per process and, with
``CU_MEMHOSTREGISTER_PORTABLE``, seen by every context in it: torch's and
vLLM's copies use the device's primary context, which is the one retained
here when the calling thread has none current.
"""

from __future__ import annotations

import ctypes
import threading

from ..errors import CudaError

CU_MEMHOSTREGISTER_PORTABLE = 0x01
"""The range is page-locked for every CUDA context of the process."""
CU_MEMHOSTREGISTER_READ_ONLY = 0x08
"""The range is mapped without write permission; the device only reads it
(CUDA 11.1+; a driver or device without it answers
``CUDA_ERROR_NOT_SUPPORTED`` or ``CUDA_ERROR_INVALID_VALUE``)."""

LIBRARY = "libcuda.so.1"

_SIGNATURES: dict[str, list[type]] = {
    "cuInit": [ctypes.c_uint],
    "cuGetErrorName": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
    "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
    "cuDevicePrimaryCtxRetain": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int],
    "cuCtxGetCurrent": [ctypes.POINTER(ctypes.c_void_p)],
    "cuCtxSetCurrent": [ctypes.c_void_p],
    "cuMemHostRegister_v2": [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint],
    "cuMemHostUnregister": [ctypes.c_void_p],
}


class Driver:
    """The CUDA driver library, loaded and initialised (``cuInit``).

    Args:
        library: the library to load, found as the dynamic loader finds it
            (``LD_LIBRARY_PATH``, then its cache).

    Raises:
        CudaError: no such library (``code`` ``"no_cuda_driver"``), one that
            lacks an entry point used here, or ``cuInit`` failing (``code``
            the driver's error name, e.g. ``CUDA_ERROR_NO_DEVICE``).
    """

    def __init__(self, library: str = LIBRARY) -> None:
        try:
            self._lib = ctypes.CDLL(library)
        except OSError as e:
            raise CudaError(f"no CUDA driver: cannot load {library}: {e}", code="no_cuda_driver") from e
        for name, args in _SIGNATURES.items():
            try:
                fn = getattr(self._lib, name)
            except AttributeError as e:
                raise CudaError(
                    f"{library} has no {name}: not a CUDA driver kvtier can use", code="no_cuda_driver"
                ) from e
            fn.argtypes = args
            fn.restype = ctypes.c_int
        self._check(self._lib.cuInit(0), "cuInit")

    def _check(self, result: int, call: str) -> None:
        if result == 0:
            return
        name = ctypes.c_char_p()
        self._lib.cuGetErrorName(result, ctypes.byref(name))
        text = name.value.decode() if name.value else f"CUresult {result}"
        raise CudaError(f"{call} failed: {text} ({result})", code=text)

    def use_device(self, device: int) -> None:
        """Makes a context current on the calling thread if none is: device
        ``device``'s primary context (retained for the process's life), the
        one torch uses. A thread that has one current (torch's, after it
        touched the GPU) keeps it.

        Raises:
            CudaError: no such device, or the context cannot be made.
        """
        ctx = ctypes.c_void_p()
        self._check(self._lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if ctx.value:
            return
        dev = ctypes.c_int()
        self._check(self._lib.cuDeviceGet(ctypes.byref(dev), device), f"cuDeviceGet({device})")
        self._check(self._lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        self._check(self._lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def register(self, ptr: int, nbytes: int, *, read_only: bool) -> None:
        """Page-locks ``nbytes`` at address ``ptr`` for every context of the
        process (``PORTABLE``; ``READ_ONLY`` for memory mapped without write
        permission). Call :meth:`use_device` on this thread first.

        Raises:
            CudaError: the driver refused (``CUDA_ERROR_INVALID_VALUE``: a
                range not wholly mapped, or read-only memory the driver cannot
                register; ``CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED``).
        """
        flags = CU_MEMHOSTREGISTER_PORTABLE | (CU_MEMHOSTREGISTER_READ_ONLY if read_only else 0)
        self._check(
            self._lib.cuMemHostRegister_v2(ctypes.c_void_p(ptr), nbytes, flags),
            f"cuMemHostRegister({nbytes} bytes, flags {flags:#x})",
        )

    def unregister(self, ptr: int) -> None:
        """Ends the page lock of the range registered at ``ptr``.

        Raises:
            CudaError: no range is registered there
                (``CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED``).
        """
        self._check(self._lib.cuMemHostUnregister(ctypes.c_void_p(ptr)), "cuMemHostUnregister")


_lock = threading.Lock()
_driver: Driver | None = None


def driver() -> Driver:
    """The process's :class:`Driver`, loaded on first use.

    Raises:
        CudaError: as :class:`Driver` (and again on every call while it fails).
    """
    global _driver
    with _lock:
        if _driver is None:
            _driver = Driver()
        return _driver
