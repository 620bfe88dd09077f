"""Errors raised by the kvtier client.

Every error the server answers is JSON ``{"error":{"code":...,"message":...}}``
with one HTTP status (docs/API.md, "Errors"). The client turns each into a
:class:`KvtierError` subclass that carries the status, the server's ``code``
and its message. A miss (404 ``not_found`` or ``corrupt_block``) is never an
exception: ``get`` answers ``None``, ``get_into`` and ``exists`` ``False``.
"""

from __future__ import annotations

from . import codes


class KvtierError(Exception):
    """Base class of every error the client raises.

    Attributes:
        status: the HTTP status the server answered, or ``None`` when the
            error was found before or without an answer (a bad key checked
            locally, a connection that failed).
        code: the server's error code (``"invalid_key"``, ``"disk_full"``, …),
            or a client-side code (``"connection_failed"``, ``"buffer_too_small"``).
        message: what went wrong, in the server's words where it answered.
        local_code: over the same-host socket (docs/LOCAL.md), the negative
            code the error came with (:mod:`kvtier.codes`); else ``None``.
    """

    local_code: int | None = None

    def __init__(self, message: str, *, status: int | None = None, code: str = "error") -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message

    def __str__(self) -> str:
        where = f"HTTP {self.status} " if self.status is not None else ""
        return f"{where}{self.code}: {self.message}"


class InvalidKeyError(KvtierError, ValueError):
    """A key breaks the rules: 1 to 256 bytes of ``[A-Za-z0-9._~-]``, not
    ``.`` or ``..`` (docs/API.md, "Keys"). Checked before sending; the server's
    400 ``invalid_key`` maps here too."""


class BlockSizeError(KvtierError, ValueError):
    """A block is not ``block_bytes`` long: a PUT body of the wrong size
    (server: 411 ``length_required``, 413 ``body_too_large``, 422
    ``wrong_block_size``; also checked before sending), or a ``get_into``
    buffer smaller than the block (``buffer_too_small``)."""


class InvalidTagError(KvtierError, ValueError):
    """A block tag breaks the rules (:class:`kvtier.BlockTag`; docs/API.md,
    "Block tags"): checked before sending (the message names the field), and
    the server's 400 ``invalid_tag`` (the message names the header) and the
    socket's ``INVALID_TAG`` item code map here too. Nothing was stored."""


class UnauthorizedError(KvtierError):
    """401 ``unauthorized``: the server wants ``Authorization: Bearer <token>``
    and the client sent none or a wrong one (``Client(token=...)``)."""


class DiskFullError(KvtierError):
    """507 ``disk_full``: the server's filesystem has no room for a new
    segment. Nothing stored is lost; reads go on (docs/OPERATIONS.md)."""


class OverloadedError(KvtierError):
    """503 or 429: the server is shutting down or over an admission limit.

    Attributes:
        retry_after_s: seconds the server asked the client to wait
            (``Retry-After``), or ``None`` when it named none.
    """

    def __init__(
        self, message: str, *, status: int | None = None, code: str = "error", retry_after_s: float | None = None
    ) -> None:
        super().__init__(message, status=status, code=code)
        self.retry_after_s = retry_after_s


class BadRequestError(KvtierError):
    """Any other 4xx: a malformed request (``bad_json``, ``too_many_keys``, …)."""


class ServerError(KvtierError):
    """A 5xx other than 503/507, e.g. 500 ``internal`` after an I/O error."""


class KvtierConnectionError(KvtierError, ConnectionError):
    """The server could not be reached, or the connection broke mid-request,
    on every try (``Client(retries=...)``). ``code`` is ``connection_failed``."""


class ProtocolError(KvtierError):
    """The same-host socket (docs/LOCAL.md) answered something the client does
    not understand, or refused the connection for a protocol reason: a framing
    error (``BAD_FRAME``), no version in common (``UNSUPPORTED_VERSION``), an
    op or payload the server did not accept. ``code`` is the code's name in
    lower case (``"bad_frame"``) and ``local_code`` its number."""


class UnsupportedVersionError(ProtocolError):
    """``UNSUPPORTED_VERSION``: the client and the server's socket speak no
    protocol version in common, or the version they chose lacks what a call
    needs (block tags need version 2, :meth:`kvtier.Client.lease` version 3).
    The message names both sides' versions; upgrade kvtier (or the client).
    A :class:`ProtocolError`, as it was before it had a class of its own."""


class LeasesOffError(KvtierError):
    """``LEASES_OFF``: the server offers no leases (docs/LOCAL.md, "Leases"),
    and the message says why in the server's words: no RAM tier, a RAM tier
    that is not shared (``--ram-shared off``, or ``auto`` without huge pages),
    or ``--tenants``. Raised too (``code`` ``"leases_need_socket"``, no
    ``local_code``) by :meth:`kvtier.Client.lease` on a client that talks
    HTTP: leases exist only on the same-host socket. Read the blocks with
    ``get_into`` instead."""


class NotInRamError(KvtierError):
    """``NOT_IN_RAM``: a leased key's block is stored, but in a tier it is
    served from without landing in the RAM tier (a GPU-tier or S3 hit), so it
    has no slot to lease; read it with ``get_into``. A per-key result of
    ``LEASE``; raised only where one key's failure is an exception."""


class CudaError(KvtierError):
    """A CUDA driver call failed while page-locking kvtier's memory for the
    GPU (:meth:`kvtier.Client.pin_arenas`): no driver (``code``
    ``"no_cuda_driver"``), no device, or the driver refused the range (``code``
    the driver's error name, e.g. ``"CUDA_ERROR_INVALID_VALUE"``, which a
    driver without read-only registration answers). Nothing is pinned then;
    copies from leases still work, through the driver's pageable path."""


class GeometryMismatchError(KvtierError, ValueError):
    """The server's geometry is not the one the client expects: the hello's
    ``block_bytes`` or ``model`` (``Client(expect_block_bytes=..., expect_model=...)``)
    differ from the server's, or a restarted server came back with another
    ``block_bytes``. The message names both sides' values. A configuration
    error: no retry fixes it."""


#: Server error codes with a class of their own; other codes go by status.
_BY_CODE: dict[str, type[KvtierError]] = {
    "invalid_key": InvalidKeyError,
    "invalid_tag": InvalidTagError,
    "wrong_block_size": BlockSizeError,
    "length_required": BlockSizeError,
    "unauthorized": UnauthorizedError,
    "disk_full": DiskFullError,
    # A PUT body longer than block_bytes. (The lookup body limit answers the
    # same code, but the client splits lookups below it.)
    "body_too_large": BlockSizeError,
}


def error_from_response(status: int, code: str, message: str, retry_after_s: float | None = None) -> KvtierError:
    """The error for a non-success answer: by the server's code first, then by
    status (``retry_after_s`` from a ``Retry-After`` header, for 429/503)."""
    cls = _BY_CODE.get(code)
    if cls is not None:
        return cls(message, status=status, code=code)
    if status in (429, 503):
        return OverloadedError(message, status=status, code=code, retry_after_s=retry_after_s)
    if status == 401:
        return UnauthorizedError(message, status=status, code=code)
    if status == 507:
        return DiskFullError(message, status=status, code=code)
    if 400 <= status < 500:
        return BadRequestError(message, status=status, code=code)
    return ServerError(message, status=status, code=code)


#: Same-host codes (docs/LOCAL.md, "Codes") with a class of their own; other
#: negative codes raise :class:`ServerError` (-1) or :class:`ProtocolError`.
_BY_LOCAL_CODE: dict[int, type[KvtierError]] = {
    codes.INVALID_KEY: InvalidKeyError,
    codes.INVALID_TAG: InvalidTagError,
    codes.WRONG_SIZE: BlockSizeError,
    codes.UNAUTHORIZED: UnauthorizedError,
    codes.DISK_FULL: DiskFullError,
    codes.OVERLOADED: OverloadedError,
    codes.SHUTTING_DOWN: OverloadedError,
    codes.GEOMETRY_MISMATCH: GeometryMismatchError,
    codes.CONNECTION_LOST: KvtierConnectionError,
    codes.IO_ERROR: ServerError,
    codes.LIMIT: BadRequestError,
    codes.UNSUPPORTED_VERSION: UnsupportedVersionError,
    codes.NOT_IN_RAM: NotInRamError,
    codes.LEASES_OFF: LeasesOffError,
}


def error_from_code(code: int, message: str, retry_after_s: float | None = None) -> KvtierError:
    """The error for a negative same-host ``code`` (docs/LOCAL.md), with the
    server's (or the client's) ``message``. Its ``code`` attribute is the
    code's name in lower case (``"wrong_size"``), ``local_code`` the number,
    and ``status`` is ``None`` (no HTTP was spoken)."""
    name = codes.name_of(code).lower()
    cls = _BY_LOCAL_CODE.get(code, ProtocolError)
    err: KvtierError
    if cls is OverloadedError:
        err = OverloadedError(message, code=name, retry_after_s=retry_after_s)
    else:
        err = cls(message, code=name)
    err.local_code = code
    return err


class ConfigurationError(ValueError):
    """An engine was started with settings a connector cannot serve (vLLM's
    KV connector: a hash algorithm, a KV cache group, a cache in memory it
    cannot reach, a socket that refuses it): the message names the values
    and the flag that fixes it. Raised at start, so the engine exits with it
    (``vllm serve`` does)."""
