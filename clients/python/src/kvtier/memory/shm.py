"""Memory the kvtier server can copy blocks into and out of (docs/LOCAL.md).

The same-host data plane never sends block bytes over the socket: the client
passes the server a file descriptor of the memory (``REGISTER``), and the
server copies between its tiers and that file. So a buffer must be backed by
a shared file:

- :class:`SharedBuffer` makes one: a memfd sealed against shrinking, which the
  server maps (access mode 1, ``memcpy``; the fastest).
- A file in memory (tmpfs such as ``/dev/shm``, an unsealed memfd) that the
  process ``mmap`` s with ``MAP_SHARED`` works too; the server maps it under
  a ``SIGBUS`` guard (access mode 3, ``memcpy``), so a file truncated under
  it costs that registration (``BUFFER_SHRUNK``), not the server; with its
  table of guarded regions full it copies with ``pread``/``pwrite`` (access
  mode 2). A hugetlbfs file must be a sealed memfd. The server refuses a
  file on a disk (its copies would stall).
- Anonymous shared memory (``mmap(MAP_SHARED | MAP_ANONYMOUS)``) is shmem
  with no descriptor: it can be registered only by a process allowed to
  open ``/proc/self/map_files`` (root, or ``CAP_CHECKPOINT_RESTORE``).
- Private anonymous memory (``malloc``, numpy/torch allocations, CUDA pinned
  host memory) has no file behind it and cannot be registered.

:func:`backing_fd` finds the file behind an address (``/proc/self/maps``);
:func:`buffer_address` the address of a Python buffer object, and
:func:`byte_view` a flat byte view of one (what the HTTP transport reads into).
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import operator
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Any


class UnshareableMemoryError(ValueError):
    """The memory at an address is not backed by a shared file the server can
    open (``reason`` says why and what to use instead)."""


class SharedBuffer(mmap.mmap):
    """Shared memory for blocks: a sealed memfd of ``nbytes``, mapped here.

    The file is created with ``MFD_CLOEXEC | MFD_ALLOW_SEALING`` and sealed
    with ``F_SEAL_SHRINK | F_SEAL_GROW``, so its size is fixed and the server
    may map it (access mode 1) without risk of a fault. Pages are allocated as
    they are first touched.

    A ``SharedBuffer`` *is* its mapping: it subclasses :class:`mmap.mmap`
    (``MAP_SHARED``, read-write), so it has the buffer protocol on every
    Python this package supports (3.10 on; no ``__buffer__``, PEP 688, is
    needed). ``memoryview(buf)`` is a writable, 1-D, format ``"B"`` view of
    all ``nbytes``: the very memory the server copies blocks into and out of
    once ``buf`` is registered; slice it to name one block's room
    (``memoryview(buf)[i * bb : (i + 1) * bb]``). ``buf.memoryview`` is the
    same view, ``np.frombuffer(buf)``/:meth:`numpy`, :meth:`torch`,
    ``buf[a:b] = data`` and the other :class:`mmap.mmap` methods work on it
    too. Only :meth:`resize` is refused (the size is sealed).

    Args:
        nbytes: size in bytes (> 0); a multiple of the huge page size with
            ``hugetlb``.
        name: the memfd's name (shows in ``/proc/PID/maps`` as
            ``/memfd:NAME (deleted)``).
        hugetlb: back it with huge pages (``MFD_HUGETLB``).

    Raises:
        TypeError: ``nbytes`` is not an integer.
        ValueError: ``nbytes`` is not positive.
        OSError: the memfd cannot be created, sized, sealed or mapped (no
            huge pages free with ``hugetlb``, ``nbytes`` not a multiple of
            their size, out of memory).

    Attributes:
        fd: the memfd (owned; closed by :meth:`close`).
        nbytes: size in bytes.
        ptr: the address of byte 0 in this process (an ``int``), for the
            pointer forms of :meth:`kvtier.Client.register_buffer` and the
            batch calls.

    Use as a context manager, or call :meth:`close`. Views made from it
    (``memoryview(buf)``, :meth:`numpy`, :meth:`torch`) keep the mapping
    alive after :meth:`close` until they are gone.
    """

    fd: int
    nbytes: int
    ptr: int
    _closed: bool

    def __new__(cls, nbytes: int, *, name: str = "kvtier", hugetlb: bool = False) -> SharedBuffer:
        try:
            nbytes = operator.index(nbytes)
        except TypeError:
            raise TypeError(f"nbytes must be an int, got {type(nbytes).__name__}") from None
        if nbytes <= 0:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | (os.MFD_HUGETLB if hugetlb else 0)
        fd = os.memfd_create(name, flags)
        try:
            os.ftruncate(fd, nbytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
            self = super().__new__(cls, fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.nbytes = nbytes
        self._closed = False
        anchor = ctypes.c_char.from_buffer(self)
        self.ptr = ctypes.addressof(anchor)
        del anchor  # an export would keep close() from unmapping
        with _live_lock:
            _live[self.ptr] = weakref.ref(self)
        return self

    def _map(self) -> SharedBuffer:
        if self._closed:
            raise ValueError("the SharedBuffer is closed")
        return self

    @property
    def memoryview(self) -> memoryview:
        """``memoryview(buf)``: a writable ``memoryview`` of all ``nbytes``
        (format ``"B"``); slice it to name one block's room.

        Raises:
            ValueError: the buffer is closed.
        """
        return memoryview(self._map())

    def numpy(self, dtype: Any = None) -> Any:
        """A numpy array over the whole buffer (``np.frombuffer``; 1-D,
        ``nbytes // itemsize`` items of ``dtype``, default ``uint8``). No copy.

        Raises:
            ValueError: the buffer is closed, or ``nbytes`` is not a multiple
                of ``dtype``'s size.
        """
        import numpy as np

        return np.frombuffer(self._map(), dtype=np.uint8 if dtype is None else dtype)

    def torch(self, dtype: Any = None) -> Any:
        """A CPU ``torch.Tensor`` over the whole buffer (``torch.frombuffer``;
        1-D, ``dtype`` default ``torch.uint8``). No copy; torch is imported here.

        Raises:
            ValueError: the buffer is closed, or ``nbytes`` is not a multiple
                of ``dtype``'s size.
        """
        import torch

        return torch.frombuffer(self._map(), dtype=torch.uint8 if dtype is None else dtype)

    def resize(self, newsize: int) -> None:
        """Refused: the memfd is sealed against growing and shrinking (the
        server relies on it), so a ``SharedBuffer``'s size is fixed.

        Raises:
            ValueError: always; make a new ``SharedBuffer`` of the size needed.
        """
        raise ValueError(
            f"a SharedBuffer cannot be resized (its memfd is sealed at {self.nbytes} bytes); "
            f"make a new SharedBuffer of {newsize} bytes instead"
        )

    def __len__(self) -> int:
        return self.nbytes

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (``mmap.mmap``'s own ``closed``
        would stay false while views keep the mapping)."""
        return self._closed

    def close(self) -> None:
        """Closes the memfd and unmaps the memory. While views made from it
        live (``memoryview(buf)``, :meth:`numpy`, ...), the mapping stays for
        them: it goes when this object is collected, or at a later
        ``close()`` made after the views are gone. A registration made from
        it keeps its own descriptor until unregistered. Closing twice is
        harmless."""
        if not self._closed:
            with _live_lock:
                _live.pop(self.ptr, None)
            self._closed = True
            os.close(self.fd)
            self.fd = -1
        if not super().closed:
            try:
                super().close()
            except BufferError:
                pass  # views still export it

    def __enter__(self) -> SharedBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"fd={self.fd}"
        return f"SharedBuffer(nbytes={self.nbytes}, ptr={self.ptr:#x}, {state})"


# SharedBuffers alive in this process, by address: registering one dups its fd
# instead of searching /proc/self/maps.
_live: dict[int, weakref.ref[SharedBuffer]] = {}
_live_lock = threading.RLock()  # re-entered by __del__ run by the GC under it


# ----------------------------------------------------------- addresses


class _PyBuffer(ctypes.Structure):
    """CPython's ``Py_buffer`` (the fields up to ``internal``)."""

    _fields_ = (
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.py_object),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    )


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = (ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int)
_get_buffer.restype = ctypes.c_int
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = (ctypes.POINTER(_PyBuffer),)
_release_buffer.restype = None


def _view_address(view: memoryview) -> int:
    """The address of a C-contiguous memoryview's first byte (read-only ones too)."""
    pybuf = _PyBuffer()
    if _get_buffer(view, ctypes.byref(pybuf), 0) != 0:  # PyBUF_SIMPLE; raises on failure
        raise ValueError("the buffer has no simple address")
    try:
        return int(pybuf.buf or 0)
    finally:
        _release_buffer(ctypes.byref(pybuf))


def is_buffer_object(obj: Any) -> bool:
    """Whether ``obj`` is a buffer object (anything but an ``int`` pointer)."""
    return not isinstance(obj, int)


def buffer_address(obj: Any, *, writable: bool) -> tuple[int, int]:
    """``(address, nbytes)`` of a buffer object's memory, without copying.

    Takes a :class:`SharedBuffer`, a CPU ``torch.Tensor`` (``data_ptr()``),
    and anything with the buffer protocol (``memoryview`` slices, numpy
    arrays, ``bytearray``, ``mmap``; ``bytes`` where ``writable`` is false).

    Raises:
        TypeError: no buffer, read-only where ``writable``, or a tensor not on the CPU.
        ValueError: not contiguous.
    """
    if isinstance(obj, SharedBuffer):
        obj._map()
        return obj.ptr, obj.nbytes
    if type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr"):
        if obj.device.type != "cpu":
            raise TypeError(f"a tensor on {obj.device} has no host memory; use a CPU tensor in a registered buffer")
        if not obj.is_contiguous():
            raise ValueError("the tensor is not contiguous")
        return int(obj.data_ptr()), int(obj.numel() * obj.element_size())
    try:
        view = memoryview(obj)
    except TypeError:
        raise TypeError(f"{type(obj).__name__} has no buffer; pass a pointer and a size, or a buffer object") from None
    with view:
        if writable and view.readonly:
            raise TypeError(f"{type(obj).__name__} is read-only; a get needs a writable target")
        if not view.c_contiguous:
            raise ValueError("the buffer is not contiguous")
        if view.nbytes == 0:
            return 0, 0
        return _view_address(view), view.nbytes


def byte_view(buf: Any, *, writable: bool) -> memoryview:
    """A flat byte ``memoryview`` over ``buf`` without copying it.

    Takes anything with the buffer protocol (``bytes``, ``bytearray``,
    ``memoryview``, numpy arrays, ``mmap``) and CPU ``torch.Tensor`` s (through
    their storage address: pinned host tensors included).

    Raises:
        TypeError: ``buf`` has no buffer, is read-only where ``writable`` is
            asked, or is a tensor not on the CPU.
        ValueError: ``buf`` is not contiguous.
    """
    if type(buf).__module__.startswith("torch") and hasattr(buf, "data_ptr"):
        if buf.device.type != "cpu":
            raise TypeError(f"a tensor on {buf.device} has no host memory to read into; use a CPU (pinned) tensor")
        if not buf.is_contiguous():
            raise ValueError("the tensor is not contiguous")
        nbytes = buf.numel() * buf.element_size()
        if nbytes == 0:
            return memoryview(bytearray())
        return memoryview((ctypes.c_ubyte * nbytes).from_address(buf.data_ptr())).cast("B")
    try:
        view = memoryview(buf)
    except TypeError:
        raise TypeError(f"{type(buf).__name__} has no buffer; pass bytes, bytearray, memoryview or an array") from None
    if writable and view.readonly:
        raise TypeError(f"{type(buf).__name__} is read-only; get_into needs a writable buffer")
    if not view.c_contiguous:
        raise ValueError("the buffer is not contiguous")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


# ------------------------------------------------------------ mappings


@dataclass(frozen=True)
class Mapping:
    """One line of ``/proc/self/maps``: ``[start, end)`` of ``path``'s bytes
    from ``offset``, device ``dev`` (``os.makedev``) and ``inode`` (0: anonymous)."""

    start: int
    end: int
    perms: str
    offset: int
    dev: int
    inode: int
    path: str


def mappings() -> list[Mapping]:
    """This process's mappings, in address order (``/proc/self/maps``)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            start, end = fields[0].split("-")
            major, minor = fields[3].split(":")
            path = fields[5].rstrip("\n") if len(fields) > 5 else ""
            out.append(
                Mapping(
                    int(start, 16),
                    int(end, 16),
                    fields[1],
                    int(fields[2], 16),
                    os.makedev(int(major, 16), int(minor, 16)),
                    int(fields[4]),
                    path,
                )
            )
    return out


def find_mapping(ptr: int, size: int) -> Mapping:
    """The file mapping holding ``[ptr, ptr + size)``; adjacent mappings of one
    file at consecutive offsets count as one.

    Raises:
        UnshareableMemoryError: not mapped, anonymous, private, or spanning
            mappings of different files.
    """
    maps = mappings()
    i = next((i for i, m in enumerate(maps) if m.start <= ptr < m.end), None)
    if i is None:
        raise UnshareableMemoryError(f"address {ptr:#x} is not mapped in this process")
    m = maps[i]
    end = m.end
    for nxt in maps[i + 1 :]:
        if end >= ptr + size:
            break
        if nxt.start != end or nxt.inode != m.inode or nxt.dev != m.dev or nxt.offset != m.offset + end - m.start:
            break
        end = nxt.end
    where = f"[{ptr:#x}, {ptr + size:#x})"
    if m.inode == 0:
        raise UnshareableMemoryError(
            f"{where} is anonymous memory ({m.path or 'malloc/numpy/torch/pinned'}), which no file backs; "
            "allocate it with kvtier.SharedBuffer, or mmap a /dev/shm file with MAP_SHARED"
        )
    if m.perms[3] != "s":
        raise UnshareableMemoryError(
            f"{where} is a private mapping (MAP_PRIVATE) of {m.path!r}: the server's writes would not be seen; "
            "map it with MAP_SHARED"
        )
    if ptr + size > end:
        raise UnshareableMemoryError(f"{where} runs past the end of its mapping of {m.path!r} at {end:#x}")
    return Mapping(m.start, end, m.perms, m.offset, m.dev, m.inode, m.path)


def _same_file(fd: int, m: Mapping) -> bool:
    st = os.fstat(fd)
    return st.st_ino == m.inode and st.st_dev == m.dev


def _open_mapping(m: Mapping) -> int:
    """A new read-write descriptor of the file behind ``m``: through
    ``/proc/self/map_files`` (needs CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE),
    else one of this process's open descriptors of the same inode, else its path."""
    flags = os.O_RDWR | os.O_CLOEXEC
    try:
        return os.open(f"/proc/self/map_files/{m.start:x}-{m.end:x}", flags)
    except OSError:
        pass
    for name in os.listdir("/proc/self/fd"):
        try:
            st = os.stat(f"/proc/self/fd/{name}")
            if st.st_ino == m.inode and st.st_dev == m.dev:
                return os.open(f"/proc/self/fd/{name}", flags)
        except OSError:
            continue
    if m.path.startswith("/") and not m.path.endswith(" (deleted)"):
        try:
            fd = os.open(m.path, flags)
        except OSError as e:
            raise UnshareableMemoryError(f"cannot open {m.path!r} read-write: {e}") from e
        if _same_file(fd, m):
            return fd
        os.close(fd)
    raise UnshareableMemoryError(
        f"cannot open the file behind the mapping of {m.path!r} read-write (no access to "
        "/proc/self/map_files and no open descriptor of it); keep its descriptor open, or use kvtier.SharedBuffer"
    )


def backing_fd(ptr: int, size: int) -> tuple[int, int]:
    """``(fd, offset)``: a new read-write descriptor of the shared file behind
    ``[ptr, ptr + size)`` and the region's offset in that file, for ``REGISTER``.
    The caller owns (and closes) ``fd``.

    Raises:
        UnshareableMemoryError: no shared file backs the region (see
            :func:`find_mapping`), or it cannot be opened, or it is shorter
            than the region.
    """
    if size <= 0:
        raise UnshareableMemoryError(f"size must be positive, got {size}")
    with _live_lock:
        owners = [ref() for ref in _live.values()]
    for sb in owners:
        if sb is not None and not sb.closed and sb.ptr <= ptr and ptr + size <= sb.ptr + sb.nbytes:
            return os.dup(sb.fd), ptr - sb.ptr
    m = find_mapping(ptr, size)
    fd = _open_mapping(m)
    offset = ptr - m.start + m.offset
    file_bytes = os.fstat(fd).st_size
    if offset + size > file_bytes:
        os.close(fd)
        raise UnshareableMemoryError(
            f"{m.path!r} is {file_bytes} bytes, shorter than the region's end at offset {offset + size}"
        )
    return fd, offset
