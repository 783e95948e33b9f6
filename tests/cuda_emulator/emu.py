"""ctypes wrapper of the strict CUDA driver EMULATION (tests only; README.md here).

The emulation is a shared library exporting the CUDA driver's VMM entry points, backed by host
memory, that enforces the driver's documented rules and counts every violation. Passing it is
evidence, not proof, that code works on a GPU.

The library is loaded once per process; vattention's CUDA backend dlopen()s the same file (through
``VATTENTION_LIBCUDA``), so both share one emulated driver and tests can read its counters.

Example
-------
>>> from tests.cuda_emulator.emu import Emulator  # doctest: +SKIP
>>> emu = Emulator.load(); emu.reset(); emu.counter("violations")  # doctest: +SKIP
0
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
LIB_PATH = HERE / "build" / "libcuda_emu.so"

# CUresult values used by tests (cuda.h).
CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_NO_DEVICE = 100
CUDA_ERROR_INVALID_DEVICE = 101
CUDA_ERROR_INVALID_CONTEXT = 201
CUDA_ERROR_INVALID_HANDLE = 400
CUDA_ERROR_ILLEGAL_STATE = 401
CUDA_ERROR_NOT_FOUND = 500
CUDA_ERROR_NOT_READY = 600
CUDA_ERROR_ILLEGAL_ADDRESS = 700
CUDA_ERROR_LAUNCH_TIMEOUT = 702
CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900
CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901
CUDA_ERROR_STREAM_CAPTURE_IMPLICIT = 906
CUDA_ERROR_CAPTURED_EVENT = 907
CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD = 908
CUDA_ERROR_UNKNOWN = 999

# Streams (cuda.h): creation flags and the special handles.
CU_STREAM_DEFAULT = 0  # blocking: synchronizes with the legacy stream
CU_STREAM_NON_BLOCKING = 1
CU_STREAM_LEGACY = 1  # handle of the legacy default stream (0 names it too)
CU_STREAM_PER_THREAD = 2  # handle of the calling thread's per-thread default stream
# Stream capture.
CU_STREAM_CAPTURE_MODE_GLOBAL = 0
CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1
CU_STREAM_CAPTURE_MODE_RELAXED = 2
CU_STREAM_CAPTURE_STATUS_NONE = 0
CU_STREAM_CAPTURE_STATUS_ACTIVE = 1
CU_STREAM_CAPTURE_STATUS_INVALIDATED = 2

CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READ = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_GET_PROC_ADDRESS_SUCCESS = 0
CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND = 1
CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT = 2
MB = 1 << 20
# Granularity the cache-level suite runs the emulation at, so its 64 KB page case runs on the
# emulated CUDA backend too (real GPUs: 2 MB; the emulation's own default stays 2 MB).
# VAEMU_SUITE_GRANULARITY (bytes) changes it: the GPU check's emulated run sets a GPU's 2 MB, so
# that the emulation runs the cases a GPU runs and skips those a GPU skips.
SUITE_GRANULARITY = int(os.environ.get("VAEMU_SUITE_GRANULARITY", 64 * 1024))


def release_library_contexts() -> None:
    """vattention holds each primary context it used for the process's life (one retain per
    device, not one per cache); before the emulation is reset or checked for leaks, it gives back
    those no cache uses. A no-op where vattention's extension is not built."""
    try:
        from vattention import _C
    except ImportError:
        return
    _C.release_unused_contexts()


class CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class CUmemAllocationProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", CUmemLocation),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class CUmemAccessDesc(ctypes.Structure):
    _fields_ = [("location", CUmemLocation), ("flags", ctypes.c_int)]


def unavailable_reason() -> str:
    """ "" when the emulation library is built (or can be built now), else why not."""
    if LIB_PATH.exists():
        return ""
    if shutil.which("make") is None:
        return "cuda emulator not built and `make` is missing"
    proc = subprocess.run(["make", "-s", "-C", str(HERE)], capture_output=True, text=True)
    if proc.returncode != 0 or not LIB_PATH.exists():
        return "cuda emulator did not build: " + (proc.stderr.strip() or proc.stdout.strip())
    return ""


def device_prop(ordinal: int = 0) -> CUmemAllocationProp:
    prop = CUmemAllocationProp()
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = ordinal
    return prop


def rw_access(ordinal: int = 0, flags: int = CU_MEM_ACCESS_FLAGS_PROT_READWRITE) -> CUmemAccessDesc:
    desc = CUmemAccessDesc()
    desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = ordinal
    desc.flags = flags
    return desc


class Emulator:
    """The loaded emulation: control API (vaemu_*) plus typed access to its driver entry points."""

    _instance: Emulator | None = None

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        u64, sz, i64 = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int64
        vp, ci, cu = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint
        sigs = {
            "vaemu_reset": ([], None),
            "vaemu_set_granularity": ([sz], None),
            "vaemu_set_device_memory_bytes": ([sz], None),
            "vaemu_set_device_count": ([ctypes.c_int], None),
            "vaemu_set_vmm_supported": ([ctypes.c_int], None),
            "vaemu_set_strict_context": ([ctypes.c_int], None),
            "vaemu_inject_fault": ([ctypes.c_char_p, i64, ctypes.c_int], None),
            "vaemu_set_latency_us": ([ctypes.c_char_p, i64], None),
            "vaemu_set_latency_ns": ([ctypes.c_char_p, i64], None),
            "vaemu_gate": ([ctypes.c_char_p, i64], None),
            "vaemu_gate_open": ([], None),
            "vaemu_gate_held": ([], ctypes.c_int),
            "vaemu_set_gpu_busy": ([ctypes.c_int], None),
            "vaemu_counter": ([ctypes.c_char_p], i64),
            "vaemu_last_violation": ([], ctypes.c_char_p),
            "vaemu_thread_has_context": ([], ctypes.c_int),
            "vaemu_hide_symbol": ([ctypes.c_char_p], None),
            "vaemu_set_strict_streams": ([ci], None),
            "vaemu_set_sync_timeout_ms": ([i64], None),
            "vaemu_primary_retains": ([ci], ci),
            "vaemu_launch": ([vp, u64, sz, ci], u64),
            "vaemu_complete": ([u64], None),
            "vaemu_inflight": ([], i64),
            "vaemu_last_memset_stream": ([], ctypes.c_size_t),
            "vaemu_last_copy_stream": ([], ctypes.c_size_t),
            "cuStreamCreate": ([ctypes.POINTER(vp), cu], ci),
            "cuStreamDestroy_v2": ([vp], ci),
            "cuStreamSynchronize": ([vp], ci),
            "cuCtxSynchronize": ([], ci),
            "cuCtxSynchronize_v2": ([vp], ci),
            "cuStreamBeginCapture_v2": ([vp, ci], ci),
            "cuStreamEndCapture": ([vp, ctypes.POINTER(vp)], ci),
            "cuStreamIsCapturing": ([vp, ctypes.POINTER(ci)], ci),
            "cuThreadExchangeStreamCaptureMode": ([ctypes.POINTER(ci)], ci),
            "cuGraphDestroy": ([vp], ci),
            "cuMemsetD8Async": ([u64, ctypes.c_ubyte, sz, vp], ci),
            "cuMemcpyAsync": ([u64, u64, sz, vp], ci),
            "cuMemcpyDtoHAsync_v2": ([vp, u64, sz, vp], ci),
            "cuMemcpyHtoDAsync_v2": ([u64, vp, sz, vp], ci),
            "cuMemHostAlloc": ([ctypes.POINTER(vp), sz, cu], ci),
            "cuMemFreeHost": ([vp], ci),
            "cuInit": ([ctypes.c_uint], ctypes.c_int),
            "cuDeviceGet": ([ctypes.POINTER(ctypes.c_int), ctypes.c_int], ctypes.c_int),
            "cuDeviceGetCount": ([ctypes.POINTER(ctypes.c_int)], ctypes.c_int),
            "cuDeviceGetAttribute": (
                [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int],
                ctypes.c_int,
            ),
            "cuDevicePrimaryCtxRetain": (
                [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int],
                ctypes.c_int,
            ),
            "cuDevicePrimaryCtxRelease_v2": ([ctypes.c_int], ctypes.c_int),
            "cuCtxSetCurrent": ([ctypes.c_void_p], ctypes.c_int),
            "cuCtxGetCurrent": ([ctypes.POINTER(ctypes.c_void_p)], ctypes.c_int),
            "cuMemGetAllocationGranularity": (
                [ctypes.POINTER(sz), ctypes.POINTER(CUmemAllocationProp), ctypes.c_int],
                ctypes.c_int,
            ),
            "cuMemAddressReserve": (
                [ctypes.POINTER(u64), sz, sz, u64, ctypes.c_ulonglong],
                ctypes.c_int,
            ),
            "cuMemAddressFree": ([u64, sz], ctypes.c_int),
            "cuMemCreate": (
                [ctypes.POINTER(u64), sz, ctypes.POINTER(CUmemAllocationProp), ctypes.c_ulonglong],
                ctypes.c_int,
            ),
            "cuMemRelease": ([u64], ctypes.c_int),
            "cuMemMap": ([u64, sz, sz, u64, ctypes.c_ulonglong], ctypes.c_int),
            "cuMemUnmap": ([u64, sz], ctypes.c_int),
            "cuMemSetAccess": ([u64, sz, ctypes.POINTER(CUmemAccessDesc), sz], ctypes.c_int),
            "cuEventCreate": ([ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint], ctypes.c_int),
            "cuEventRecord": ([ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int),
            "cuEventQuery": ([ctypes.c_void_p], ctypes.c_int),
            "cuEventSynchronize": ([ctypes.c_void_p], ctypes.c_int),
            "cuEventDestroy_v2": ([ctypes.c_void_p], ctypes.c_int),
            "cuGetErrorString": ([ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)], ctypes.c_int),
            "cuGetProcAddress_v2": (
                [
                    ctypes.c_char_p,
                    ctypes.POINTER(ctypes.c_void_p),
                    ctypes.c_int,
                    ctypes.c_uint64,
                    ctypes.POINTER(ctypes.c_int),
                ],
                ctypes.c_int,
            ),
            "cuGetProcAddress": (
                [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64],
                ctypes.c_int,
            ),
        }
        for name, (args, res) in sigs.items():
            fn = getattr(lib, name)
            fn.argtypes = args
            fn.restype = res

    @classmethod
    def load(cls) -> Emulator:
        """The process-wide emulation (builds it with make if needed)."""
        if cls._instance is None:
            reason = unavailable_reason()
            if reason:
                raise RuntimeError(reason)
            # RTLD_GLOBAL is not needed: the backend dlopen()s the same path and gets this handle.
            cls._instance = cls(ctypes.CDLL(str(LIB_PATH)))
        return cls._instance

    # ---- control API ----
    def reset(self) -> None:
        release_library_contexts()  # a retain kept across the reset would point at nothing
        self.lib.vaemu_reset()

    def reset_for_suite(self) -> None:
        """reset(), then the settings the cache-level suite expects (see SUITE_GRANULARITY)."""
        self.reset()
        self.set_granularity(SUITE_GRANULARITY)

    def set_granularity(self, nbytes: int) -> None:
        self.lib.vaemu_set_granularity(nbytes)

    def set_device_memory_bytes(self, nbytes: int) -> None:
        self.lib.vaemu_set_device_memory_bytes(nbytes)

    def set_device_count(self, n: int) -> None:
        self.lib.vaemu_set_device_count(n)

    def set_vmm_supported(self, yes: bool) -> None:
        self.lib.vaemu_set_vmm_supported(int(yes))

    def set_strict_context(self, on: bool) -> None:
        self.lib.vaemu_set_strict_context(int(on))

    def inject_fault(self, entry: str, nth: int, result: int) -> None:
        """The nth call (1 = next) of ``entry`` returns ``result`` without effect; nth=0 disarms."""
        self.lib.vaemu_inject_fault(entry.encode(), nth, result)

    def set_latency_us(self, entry: str, us: int) -> None:
        self.lib.vaemu_set_latency_us(entry.encode(), us)

    def set_latency_ns(self, entry: str, ns: int) -> None:
        """Every call of ``entry`` is held ``ns`` nanoseconds before it acts (short holds spin)."""
        self.lib.vaemu_set_latency_ns(entry.encode(), int(ns))

    def gate(self, entry: str, nth: int = 1) -> None:
        """The nth call (1 = next) of ``entry`` stops before it acts until gate_open() (race
        tests)."""
        self.lib.vaemu_gate(entry.encode(), nth)

    def gate_open(self) -> None:
        self.lib.vaemu_gate_open()

    def gate_held(self) -> bool:
        """True while a call is stopped at the gate."""
        return bool(self.lib.vaemu_gate_held())

    def wait_gate_held(self, timeout_s: float = 10.0) -> None:
        """Blocks until a call is stopped at the gate; AssertionError after timeout_s."""
        import time

        deadline = time.monotonic() + timeout_s
        while not self.gate_held():
            assert time.monotonic() < deadline, "no driver call reached the gate"
            time.sleep(0.001)

    def set_gpu_busy(self, busy: bool) -> None:
        self.lib.vaemu_set_gpu_busy(int(busy))

    def counter(self, name: str) -> int:
        return int(self.lib.vaemu_counter(name.encode()))

    @property
    def violations(self) -> int:
        return self.counter("violations")

    def last_violation(self) -> str:
        return self.lib.vaemu_last_violation().decode()

    def hide_symbol(self, symbol: str) -> None:
        """cuGetProcAddress reports ``symbol`` as not found (a driver lacking that entry point)."""
        self.lib.vaemu_hide_symbol(symbol.encode())

    def thread_has_context(self) -> bool:
        return bool(self.lib.vaemu_thread_has_context())

    def set_strict_streams(self, on: bool) -> None:
        """On: a stream handle the emulation never created is a violation (default: adopted as a
        foreign non-blocking stream)."""
        self.lib.vaemu_set_strict_streams(int(on))

    def set_sync_timeout_ms(self, ms: int) -> None:
        """How long the synchronize calls wait before failing as a violation (default 5000)."""
        self.lib.vaemu_set_sync_timeout_ms(int(ms))

    # ---- in-flight work (calls run on the calling Python thread) ----
    def launch(self, stream: int, va: int, nbytes: int, held: bool = True) -> int:
        """Enqueues a "kernel" on ``stream`` reading [va, va + nbytes); held: it executes until
        complete(id). Returns the unit's id."""
        return int(self.lib.vaemu_launch(stream, va, nbytes, int(held)))

    def complete(self, unit: int) -> None:
        """The unit finishes executing (complete once what it depends on is)."""
        self.lib.vaemu_complete(unit)

    def inflight(self) -> int:
        """Launched units not yet complete."""
        return int(self.lib.vaemu_inflight())

    def last_memset_stream(self) -> int:
        return int(self.lib.vaemu_last_memset_stream())

    def last_copy_stream(self) -> int:
        return int(self.lib.vaemu_last_copy_stream())

    # ---- streams and capture ----
    def stream_create(self, nonblocking: bool = True) -> int:
        """A new stream's handle (CU_STREAM_NON_BLOCKING, or CU_STREAM_DEFAULT: blocking)."""
        s = ctypes.c_void_p()
        flags = CU_STREAM_NON_BLOCKING if nonblocking else CU_STREAM_DEFAULT
        rc = self.lib.cuStreamCreate(ctypes.byref(s), flags)
        if rc != CUDA_SUCCESS:
            raise RuntimeError(f"cuStreamCreate failed: {rc} ({self.last_violation()})")
        return s.value

    def stream_destroy(self, stream: int) -> int:
        return self.lib.cuStreamDestroy_v2(stream)

    def stream_synchronize(self, stream: int) -> int:
        return self.lib.cuStreamSynchronize(stream)

    def ctx_synchronize(self) -> int:
        return self.lib.cuCtxSynchronize()

    def memset_async(self, dst: int, value: int, nbytes: int, stream: int) -> int:
        """cuMemsetD8Async."""
        return self.lib.cuMemsetD8Async(dst, value, nbytes, stream)

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> int:
        """cuMemcpyAsync (device to device)."""
        return self.lib.cuMemcpyAsync(dst, src, nbytes, stream)

    def begin_capture(self, stream: int, mode: int = CU_STREAM_CAPTURE_MODE_GLOBAL) -> int:
        return self.lib.cuStreamBeginCapture_v2(stream, mode)

    def end_capture_graph(self, stream: int) -> tuple[int, int]:
        """(CUresult, CUgraph or 0); destroy the graph with graph_destroy."""
        g = ctypes.c_void_p()
        rc = self.lib.cuStreamEndCapture(stream, ctypes.byref(g))
        return rc, g.value or 0

    def end_capture(self, stream: int) -> int:
        """cuStreamEndCapture's CUresult; the graph it returns (if any) is destroyed."""
        rc, g = self.end_capture_graph(stream)
        if g:
            assert self.graph_destroy(g) == CUDA_SUCCESS
        return rc

    def graph_destroy(self, graph: int) -> int:
        return self.lib.cuGraphDestroy(graph)

    def is_capturing(self, stream: int) -> tuple[int, int]:
        """(CUresult, CU_STREAM_CAPTURE_STATUS_*)."""
        status = ctypes.c_int(-1)
        return self.lib.cuStreamIsCapturing(stream, ctypes.byref(status)), status.value

    def exchange_capture_mode(self, mode: int) -> int:
        """Sets this thread's capture interaction mode; returns the previous one."""
        m = ctypes.c_int(mode)
        rc = self.lib.cuThreadExchangeStreamCaptureMode(ctypes.byref(m))
        if rc != CUDA_SUCCESS:
            raise RuntimeError(f"cuThreadExchangeStreamCaptureMode failed: {rc}")
        return m.value

    # ---- contexts (per thread: these act on the calling Python thread) ----
    def primary_retains(self, device: int = 0) -> int:
        """Live reference count of the device's primary context."""
        return int(self.lib.vaemu_primary_retains(device))

    def retain_primary(self, device: int = 0) -> int:
        ctx = ctypes.c_void_p()
        rc = self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device)
        if rc != CUDA_SUCCESS:
            raise RuntimeError(f"cuDevicePrimaryCtxRetain failed: {rc}")
        return ctx.value

    def release_primary(self, device: int = 0) -> int:
        return self.lib.cuDevicePrimaryCtxRelease_v2(device)

    def current_context(self) -> int:
        """This thread's current context (0: none)."""
        ctx = ctypes.c_void_p()
        rc = self.lib.cuCtxGetCurrent(ctypes.byref(ctx))
        if rc != CUDA_SUCCESS:
            raise RuntimeError(f"cuCtxGetCurrent failed: {rc}")
        return ctx.value or 0

    def set_current_context(self, ctx: int) -> int:
        return self.lib.cuCtxSetCurrent(ctx or None)

    def live(self) -> dict[str, int]:
        """Everything that must be back to zero when no cache/backend is alive (vattention's
        process-wide retain of a primary context no cache uses is given back first)."""
        release_library_contexts()
        names = (
            "live_handles",
            "live_mappings",
            "live_reservations",
            "live_events",
            "context_refs",
            "bytes_in_use",
            "live_host_allocs",
            "live_streams",
            "live_graphs",
        )
        return {n: self.counter(n) for n in names}

    # ---- driver calls returning (CUresult, value) where useful ----
    def init_and_bind(self, ordinal: int = 0) -> int:
        """cuInit + retain the primary context + make it current on this thread; returns ctx."""
        assert self.lib.cuInit(0) == CUDA_SUCCESS
        ctx = ctypes.c_void_p()
        assert self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), ordinal) == CUDA_SUCCESS
        assert self.lib.cuCtxSetCurrent(ctx) == CUDA_SUCCESS
        return ctx.value

    def granularity(self, ordinal: int = 0) -> tuple[int, int]:
        g = ctypes.c_size_t()
        prop = device_prop(ordinal)
        rc = self.lib.cuMemGetAllocationGranularity(ctypes.byref(g), ctypes.byref(prop), 0)
        return rc, g.value

    def reserve(self, size: int, alignment: int = 0) -> tuple[int, int]:
        va = ctypes.c_uint64()
        return self.lib.cuMemAddressReserve(ctypes.byref(va), size, alignment, 0, 0), va.value

    def address_free(self, va: int, size: int) -> int:
        return self.lib.cuMemAddressFree(va, size)

    def create(
        self, size: int, ordinal: int = 0, prop: CUmemAllocationProp | None = None
    ) -> tuple[int, int]:
        h = ctypes.c_uint64()
        prop = prop if prop is not None else device_prop(ordinal)
        return self.lib.cuMemCreate(ctypes.byref(h), size, ctypes.byref(prop), 0), h.value

    def release(self, handle: int) -> int:
        return self.lib.cuMemRelease(handle)

    def map(self, va: int, size: int, handle: int, offset: int = 0) -> int:
        return self.lib.cuMemMap(va, size, offset, handle, 0)

    def unmap(self, va: int, size: int) -> int:
        return self.lib.cuMemUnmap(va, size)

    def set_access(
        self, va: int, size: int, ordinal: int = 0, flags: int = CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    ) -> int:
        desc = rw_access(ordinal, flags)
        return self.lib.cuMemSetAccess(va, size, ctypes.byref(desc), 1)

    def event_create(self) -> tuple[int, int]:
        ev = ctypes.c_void_p()
        return self.lib.cuEventCreate(ctypes.byref(ev), 2), ev.value

    def event_record(self, ev: int, stream: int = 0) -> int:
        return self.lib.cuEventRecord(ev, stream)

    def event_query(self, ev: int) -> int:
        return self.lib.cuEventQuery(ev)

    def event_synchronize(self, ev: int) -> int:
        return self.lib.cuEventSynchronize(ev)

    def event_destroy(self, ev: int) -> int:
        return self.lib.cuEventDestroy_v2(ev)

    def get_proc(self, symbol: str, version: int, v2: bool = True) -> tuple[int, int, int]:
        """(CUresult, function address or 0, symbolStatus or -1)."""
        fn = ctypes.c_void_p()
        if not v2:
            return (
                self.lib.cuGetProcAddress(symbol.encode(), ctypes.byref(fn), version, 0),
                fn.value or 0,
                -1,
            )
        status = ctypes.c_int(-1)
        res = self.lib.cuGetProcAddress_v2(
            symbol.encode(), ctypes.byref(fn), version, 0, ctypes.byref(status)
        )
        return res, fn.value or 0, status.value


def env_for_backend() -> dict[str, str]:
    """Environment that points vattention's CUDA backend at the emulation."""
    return {"VATTENTION_LIBCUDA": str(LIB_PATH)}


def touch_faults(address: int, write: bool = False) -> bool:
    """True if reading (or writing) one byte at ``address`` kills a forked child (SIGSEGV/SIGBUS).

    Forks so the test process survives the fault; the child sees the same address space.
    """
    import signal

    pid = os.fork()
    if pid == 0:  # child: touch, then exit 0 if it did not fault
        import faulthandler

        faulthandler.disable()  # the expected SIGSEGV is not a crash worth a traceback
        try:
            if write:
                ctypes.memset(address, 0x5A, 1)
            else:
                _ = ctypes.c_char.from_address(address).value  # the read that must fault
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.WIFSIGNALED(status) and os.WTERMSIG(status) in (signal.SIGSEGV, signal.SIGBUS)
