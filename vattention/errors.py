"""The cache's exception hierarchy, all subclasses of :class:`VAttentionError`.

Every message names the bad value and the limit; a failed call leaves the cache as it was (a
failed :meth:`~vattention.KVCache.step` may still have given back pages no query can read any
more: its docstring says which). Exceptions raised by the C++ core carry their numbers as
attributes too (for example ``OutOfPagesError.pages_needed`` and ``.pages_available``), so callers
never parse messages.

Example
-------
>>> import vattention
>>> issubclass(vattention.OutOfPagesError, MemoryError)
True
"""

from __future__ import annotations

__all__ = [
    "VAttentionError",
    "ConfigError",
    "InvalidSlotError",
    "SequenceTooLongError",
    "OutOfPagesError",
    "DriverError",
    "BackendUnavailableError",
    "CacheClosedError",
    "SwapSpaceError",
    "ArgumentTypeError",
    "UnmappedReadError",
]


class VAttentionError(Exception):
    """Base class of every error this library raises on purpose."""


class ConfigError(VAttentionError, ValueError):
    """A configuration value is out of range (dimension, page size, dtype, layout, device)."""


class InvalidSlotError(VAttentionError, ValueError):
    """A slot index is out of range, not allocated, freed twice, or no slot is free."""


class SequenceTooLongError(VAttentionError, ValueError):
    """A sequence length is negative or beyond ``max_seq_len``."""


class OutOfPagesError(VAttentionError, MemoryError):
    """Physical pages ran out. Recoverable: nothing was mapped; preempt a request and retry.

    Attributes ``pages_needed`` and ``pages_available`` (pages of ``page_bytes``) say by how much.
    """


class DriverError(VAttentionError, RuntimeError):
    """A CUDA driver or OS call failed. Attributes: ``call``, ``code``, ``error_string``."""


class BackendUnavailableError(VAttentionError, RuntimeError):
    """The requested backend cannot run on this machine; the message says why."""


class CacheClosedError(VAttentionError, RuntimeError):
    """The cache was used after ``close()``."""


class SwapSpaceError(VAttentionError, MemoryError):
    """The host memory budget for swapped-out slots would be exceeded. Nothing was swapped.

    Attributes ``bytes_needed`` and ``bytes_available`` (host bytes) say by how much; raise the
    budget with ``KVCache.set_swap_budget`` or drop handles with ``KVCache.swap_drop``.
    """


class ArgumentTypeError(VAttentionError, TypeError):
    """An argument has the wrong type: a float or bool where an int is needed (never truncated),
    a float tensor of lengths, a stream that is neither None, an int handle nor a stream object.
    The message names the argument."""


class UnmappedReadError(VAttentionError, ValueError):
    """A kernel was asked to read cache tokens no page backs: a length past a row's
    ``mapped_tokens`` (``step()`` was given less), or below a sliding window's released start.

    Raised before the kernel runs, which would otherwise fault (SIGSEGV on the host backend, an
    illegal address that poisons the CUDA context on a GPU). Attributes ``request`` (index in the
    batch), ``slot`` (the cache row), ``length`` (tokens the request reads) and ``mapped_tokens``;
    ``window_start`` for a read below a window. A ValueError like :class:`SequenceTooLongError`:
    the length is an argument beyond a limit, but that limit is what ``step()`` mapped, not
    ``max_seq_len``, and no preemption helps (nothing ran out, unlike :class:`OutOfPagesError`).
    """
