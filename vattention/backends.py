"""What the memory backends can do here: availability, page granularity, host limits.

A cache maps its pages through a backend: ``host`` (``device="cpu"``: shared-memory pages mapped
with ``mmap``) or ``cuda`` (``device="cuda:N"``: the CUDA driver's virtual memory API). Tooling and
integrations that size caches before building one (the command line's ``info``, the benchmarks,
the vLLM plugin choosing its block size) ask these questions; a :class:`vattention.KVCache`
answers the rest through its config and :meth:`~vattention.KVCache.stats`.

Examples
--------
>>> from vattention import backends
>>> backends.unavailable_reason("host") is None
True
>>> backends.granularity("cpu") % 4096
0
"""

from __future__ import annotations

from typing import Optional

from . import _C

__all__ = ["KINDS", "unavailable_reason", "granularity", "host_mapping_limit", "host_huge_unit"]

# The backends, by the kind ``unavailable_reason`` takes (devices "cpu" and "cuda[:N]").
KINDS = ("host", "cuda")


def unavailable_reason(kind: str) -> Optional[str]:
    """Why the ``kind`` backend cannot run here, or ``None`` when it can.

    Parameters
    ----------
    kind : str
        ``"host"`` or ``"cuda"``.

    Returns
    -------
    str or None
        ``None`` when a cache of that kind can be built here; else the reason (no CUDA driver, a
        driver without virtual memory management, ...).

    Raises
    ------
    ValueError
        ``kind`` is not one of :data:`KINDS`.

    Examples
    --------
    >>> unavailable_reason("host") is None
    True
    >>> reason = unavailable_reason("cuda")       # a string naming what is missing, or None
    >>> reason is None or isinstance(reason, str)
    True
    """
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} must be one of {KINDS}")
    return _C.backend_unavailable_reason(kind) or None


def granularity(device: str) -> int:
    """The smallest page the backend of ``device`` maps, in bytes; a page size is a multiple.

    Parameters
    ----------
    device : str
        ``"cpu"``, ``"cuda"`` or ``"cuda:N"``, as :class:`vattention.KVCacheConfig` takes it.

    Returns
    -------
    int
        Bytes: the OS page size on the host (4096 on x86-64 Linux), the driver's allocation
        granularity on CUDA (typically 2 MB).

    Raises
    ------
    vattention.BackendUnavailableError
        The backend cannot run here (see :func:`unavailable_reason`).
    vattention.ConfigError
        ``device`` is not a device vattention knows.

    Examples
    --------
    >>> granularity("cpu") >= 4096
    True
    """
    return _C.backend_granularity(device)


def host_mapping_limit() -> int:
    """Page mappings the host backend lets this process hold, across all its caches (a count).

    Linux caps a process's memory mappings at ``vm.max_map_count`` and each mapped page can cost
    two, so the host backend refuses a mapping beyond about half of that cap with
    :class:`vattention.OutOfPagesError` (recoverable, nothing changed) rather than letting the OS
    fail later. ``VATTENTION_HOST_MAX_MAPPINGS`` overrides it. A host cache with pages of
    ``page_bytes`` can therefore hold at most ``host_mapping_limit() * page_bytes`` bytes mapped.

    Examples
    --------
    >>> host_mapping_limit() > 0
    True
    """
    return _C.host_mapping_limit()


def host_huge_unit() -> int:
    """Host pages whose size is a multiple of this many bytes are made of 2 MB OS huge pages.

    Returns
    -------
    int
        Bytes (2 MB where huge pages work), or 0 where none can be used (base pages other than
        4 KB, a kernel that refuses to collapse shared memory, or ``VATTENTION_HOST_HUGE_PAGES=0``).
        Engines that choose their page size (the vLLM plugin's block size) round up to it when
        that costs little.

    Examples
    --------
    >>> host_huge_unit() in (0, 2 << 20)
    True
    """
    return _C.host_huge_unit()
