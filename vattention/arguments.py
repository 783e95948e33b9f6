"""Checking and converting call arguments at the Python boundary.

Every public :class:`~vattention.KVCache` method passes its integer and stream arguments through
these functions before they reach the C++ core, so that

- floats and bools are refused, never truncated (``swap_in(1.5)`` is not ``swap_in(1)``), with an
  :class:`~vattention.ArgumentTypeError` naming the argument;
- ints, numpy integers and one-element integer tensors are accepted (``operator.index``);
- a value too large for the core (``2**70``) gets the library's typed error naming the value and
  the limit, not a pybind11 ``TypeError``/``OverflowError``.

Both ``cache.py`` and ``sharing.py`` import this module; it imports neither.

>>> from vattention.arguments import as_int, as_stream
>>> import numpy as np
>>> as_int(np.int64(7), "slot"), as_stream(None)
(7, 0)
>>> as_int(2.5, "num_tokens")
Traceback (most recent call last):
  ...
vattention.errors.ArgumentTypeError: num_tokens=2.5 must be an int, got float
"""

from __future__ import annotations

import operator

from .errors import ArgumentTypeError, ConfigError, InvalidSlotError, SequenceTooLongError

__all__ = ["INT64_MAX", "as_int", "as_slot", "as_tokens", "as_handle", "as_stream"]

INT64_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1
UINT64_MAX = 2**64 - 1


def as_int(value, name: str) -> int:
    """``value`` as a Python int: ints, numpy integers, one-element integer tensors.

    Raises :class:`ArgumentTypeError` (a ``TypeError``) naming ``name`` for bools, floats, float
    tensors and anything else without ``__index__``.
    """
    if type(value) is int:  # the common case first
        return value
    if isinstance(value, bool) or (hasattr(value, "dtype") and "bool" in str(value.dtype)):
        raise ArgumentTypeError(f"{name}={value!r} must be an int, got a bool")
    try:
        return operator.index(value)
    except TypeError:
        raise ArgumentTypeError(
            f"{name}={value!r} must be an int, got {type(value).__name__}"
        ) from None


def as_slot(value, max_batch_size: int, name: str = "slot") -> int:
    """A slot index as an int. Ints beyond the core's range raise :class:`InvalidSlotError` here;
    the core checks ``[0, max_batch_size)`` itself (after checking that the cache is open)."""
    slot = as_int(value, name)
    if not -INT32_MAX - 1 <= slot <= INT32_MAX:
        raise InvalidSlotError(
            f"{name}={slot} is out of range [0, {max_batch_size}) (max_batch_size={max_batch_size})"
        )
    return slot


def as_tokens(value, name: str, limit: int, *, none_as: int | None = None) -> int:
    """A token count or position as an int. Ints no int64 can hold raise
    :class:`SequenceTooLongError` naming ``limit`` (``max_seq_len``) here; the core checks the
    exact per-slot bound itself. With ``none_as`` set, ``None`` means that value (a default) and
    negative ints are refused here, as they would collide with it."""
    if value is None and none_as is not None:
        return none_as
    tokens = as_int(value, name)
    if not -INT64_MAX - 1 <= tokens <= INT64_MAX or (none_as is not None and tokens < 0):
        raise SequenceTooLongError(f"{name}={tokens} is outside [0, {limit}] (max_seq_len={limit})")
    return tokens


def as_handle(value, name: str = "handle") -> int:
    """A swap handle (an int from ``swap_out``); out-of-range ints are unknown handles."""
    handle = as_int(value, name)
    if not 0 <= handle <= INT64_MAX:
        raise InvalidSlotError(
            f"{name}={handle} is not a swap handle (handles are ints in "
            f"[1, {INT64_MAX}] returned by swap_out())"
        )
    return handle


def as_stream(stream, name: str = "stream") -> int:
    """A CUDA stream as an int handle: None (the legacy default stream, 0; a cache takes the
    caller's current stream instead: vattention.streams), an int handle, or an object with a
    ``cuda_stream`` attribute (``torch.cuda.Stream``)."""
    if stream is None:
        return 0
    if hasattr(stream, "cuda_stream") and not isinstance(stream, (int, bool)):
        stream = stream.cuda_stream
    try:
        handle = as_int(stream, name)
    except ArgumentTypeError:
        raise ArgumentTypeError(
            f"{name}={stream!r} must be None, an int stream handle or a torch.cuda.Stream, "
            f"got {type(stream).__name__}"
        ) from None
    if not 0 <= handle <= UINT64_MAX:
        raise ConfigError(
            f"{name}={handle} is not a stream handle: it must be in [0, {UINT64_MAX}]"
        )
    return handle
