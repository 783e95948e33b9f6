"""Minimal ctypes access to the CUDA driver's VMM calls, for the per-call latency benchmark, and
its free memory (the GPU check's memory part).

Loads ``$VATTENTION_LIBCUDA`` or ``libcuda.so.1`` (so the script can be smoke-run against the test
emulation; its numbers then mean nothing about a GPU).
"""

from __future__ import annotations

import ctypes
import os

_u64, _sz, _int = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int


class _Loc(ctypes.Structure):
    _fields_ = [("type", _int), ("id", _int)]


class _Prop(ctypes.Structure):
    _fields_ = [
        ("type", _int),
        ("requestedHandleTypes", _int),
        ("location", _Loc),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", ctypes.c_ubyte * 8),
    ]


class _Access(ctypes.Structure):
    _fields_ = [("location", _Loc), ("flags", _int)]


class Driver:
    """The primary context of device ``ordinal`` made current on this thread; raw VMM calls."""

    def __init__(self, ordinal: int = 0):
        self.path = os.environ.get("VATTENTION_LIBCUDA") or "libcuda.so.1"
        self.lib = ctypes.CDLL(self.path)
        self.ordinal = ordinal
        self._check(self.lib.cuInit(0), "cuInit")
        ctx = ctypes.c_void_p()
        self._check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), ordinal), "retain")
        self._check(self.lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        self.prop = _Prop(type=1, location=_Loc(1, ordinal))  # PINNED, DEVICE
        self.access = _Access(location=_Loc(1, ordinal), flags=3)  # READWRITE
        self.lib.cuMemAddressReserve.argtypes = [ctypes.POINTER(_u64), _sz, _sz, _u64, _u64]
        self.lib.cuMemAddressFree.argtypes = [_u64, _sz]
        self.lib.cuMemCreate.argtypes = [ctypes.POINTER(_u64), _sz, ctypes.POINTER(_Prop), _u64]
        self.lib.cuMemRelease.argtypes = [_u64]
        self.lib.cuMemMap.argtypes = [_u64, _sz, _sz, _u64, _u64]
        self.lib.cuMemUnmap.argtypes = [_u64, _sz]
        self.lib.cuMemSetAccess.argtypes = [_u64, _sz, ctypes.POINTER(_Access), _sz]
        self.lib.cuMemGetAllocationGranularity.argtypes = [
            ctypes.POINTER(_sz),
            ctypes.POINTER(_Prop),
            _int,
        ]

    @staticmethod
    def _check(res: int, what: str) -> None:
        if res != 0:
            raise RuntimeError(f"{what} failed with CUresult {res}")

    def granularity(self) -> int:
        g = _sz()
        self._check(
            self.lib.cuMemGetAllocationGranularity(ctypes.byref(g), ctypes.byref(self.prop), 0),
            "granularity",
        )
        return g.value

    def reserve(self, nbytes: int) -> int:
        va = _u64()
        self._check(self.lib.cuMemAddressReserve(ctypes.byref(va), nbytes, 0, 0, 0), "reserve")
        return va.value

    def free(self, va: int, nbytes: int) -> None:
        self._check(self.lib.cuMemAddressFree(va, nbytes), "cuMemAddressFree")

    def create(self, nbytes: int) -> int:
        h = _u64()
        self._check(
            self.lib.cuMemCreate(ctypes.byref(h), nbytes, ctypes.byref(self.prop), 0), "cuMemCreate"
        )
        return h.value

    def release(self, h: int) -> None:
        self._check(self.lib.cuMemRelease(h), "cuMemRelease")

    def map(self, va: int, nbytes: int, h: int) -> None:
        self._check(self.lib.cuMemMap(va, nbytes, 0, h, 0), "cuMemMap")

    def set_access(self, va: int, nbytes: int) -> None:
        self._check(
            self.lib.cuMemSetAccess(va, nbytes, ctypes.byref(self.access), 1), "cuMemSetAccess"
        )

    def unmap(self, va: int, nbytes: int) -> None:
        self._check(self.lib.cuMemUnmap(va, nbytes), "cuMemUnmap")

    def mem_info(self) -> tuple[int, int]:
        """cuMemGetInfo: (free, total) bytes of the device, as torch.cuda.mem_get_info says."""
        free, total = _sz(), _sz()
        self._check(
            self.lib.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "cuMemGetInfo"
        )
        return free.value, total.value

    def current_context(self) -> int:
        """cuCtxGetCurrent: a call that does nothing, to time what ctypes adds to each call."""
        ctx = ctypes.c_void_p()
        self._check(self.lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        return ctx.value or 0
