"""Shared fixtures: every cache-level test runs over devices, layouts and page sizes.

`device` is parametrized over "cpu" (host backend) and "cuda" (the CUDA backend: on the real driver
where there is a GPU, else through the strict driver emulation, see tests/support/cuda_setup.py
and tests/cuda_emulator/). Data is read and written through `kv_views` (tests/support/helpers.py),
which gives CPU tensors over the cache memory wherever it is host memory.
"""

from __future__ import annotations

import gc

import pytest
import torch

import vattention

from support.cuda_setup import CUDA_MODE, CUDA_REASON, GPU_LIKE, cuda_emu, skip_below_gpu_pages
from support.one_device import OneDevice

try:
    from hypothesis import settings as _hypothesis_settings
except ImportError:  # only the property tests need it; they import it themselves
    _hypothesis_settings = None
if _hypothesis_settings is not None:
    # Hypothesis fails an example that runs over 200 ms by default: a timing assertion, which a
    # loaded 2-core machine breaks. Off for the whole suite; a hang is pytest's to report.
    _hypothesis_settings.register_profile("vattention", deadline=None)
    _hypothesis_settings.load_profile("vattention")

# The emulation-only tests' `emu` fixture (test_cuda_backend.py, test_cuda_faults.py,
# test_prefetch_races.py), and the CPU attention kernel's `isa` fixture with its session summary
# line, and its `threads` fixture: plugins, so that no test module imports a fixture by name.
pytest_plugins = ["support.cuda_testing", "support.kernel_variants"]

DEVICES = ["cpu", "cuda"]
LAYOUTS = ["layer", "mega"]
PAGE_SIZES = ["64KB", "2MB"]


def pytest_addoption(parser):
    parser.addoption(
        "--cuda-cases",
        action="store_true",
        help="run only the cases of the `device` fixture's cuda parameter that need no emulation "
        "hook: the CUDA-backend tests a real GPU runs (make gpu-check's first part)",
    )


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a real NVIDIA GPU and driver")
    config.addinivalue_line(
        "markers",
        "not_on_gpu(reason): the cuda case cannot run on a real GPU for a harness reason (pages "
        "below 2 MB, CPU reads of device memory); skipped where the cuda device "
        "is a GPU's or the emulation runs at a GPU's 2 MB granularity (docs/cuda.md lists them)",
    )


def _device_param(item):
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("device") if callspec else None


def _cuda_case(item) -> bool:
    """A case of the `device` fixture's cuda parameter that does not drive the emulation itself
    (the `emu` fixture: fault injection, counters), so it runs on a real driver as well."""
    return _device_param(item) == "cuda" and "emu" not in item.fixturenames


# Test modules whose slow subprocess work starts in the background when collection selects
# them (their start_in_background()), and whose tests run last, awaiting it: the vLLM
# workloads (~10 CPU-minutes in vLLM processes, niced: support/vllm_harness.py) overlap the rest
# of the suite on a 2-core box.
BACKGROUND_MODULES = ("test_integrations_vllm",)
# Test modules whose tests keep both cores busy (the CPU attention kernel's OpenMP teams): run
# after the rest, most of which use one core and leave the other to those workloads, and before
# the background modules' tests.
BOTH_CORES_MODULES = ("test_attention_kernel",)


def _module(item) -> str:
    return item.module.__name__.rsplit(".", 1)[-1]


def _background(item) -> bool:
    return _module(item) in BACKGROUND_MODULES


def _run_order(item) -> int:
    return 2 if _background(item) else 1 if _module(item) in BOTH_CORES_MODULES else 0


def pytest_collection_modifyitems(config, items):
    items.sort(key=_run_order)  # stable: each group keeps its order
    if config.getoption("cuda_cases"):
        config.hook.pytest_deselected(items=[i for i in items if not _cuda_case(i)])
        items[:] = [i for i in items if _cuda_case(i)]
    if GPU_LIKE:
        for item in items:
            mark = item.get_closest_marker("not_on_gpu")
            if mark is not None and _device_param(item) == "cuda":
                item.add_marker(pytest.mark.skip(reason=f"not on a GPU: {mark.args[0]}"))
    if _have_gpu():
        return
    skip = pytest.mark.skip(reason="needs a real NVIDIA GPU and driver (none on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    if session.config.option.collectonly:
        return
    for module in {item.module for item in session.items if _background(item)}:
        module.start_in_background()


def _have_gpu() -> bool:
    try:
        return torch.cuda.is_available()
    except Exception:
        return False


@pytest.fixture(autouse=True)
def one_device_on_the_emulation(request):
    """In the cuda cases a GPU runs, on the emulation: a cache tensor (kv_views) mixed with a CPU
    tensor in one torch call raises, as on a GPU (support/one_device.py)."""
    if (
        CUDA_MODE != "emulated"
        or _device_param(request.node) != "cuda"
        or request.node.get_closest_marker("not_on_gpu") is not None
    ):
        yield
        return
    with OneDevice():
        yield


@pytest.fixture(params=DEVICES)
def device(request):
    """ "cpu", or "cuda:0" on the real GPU or the emulation (then checked: no rule violation, and
    nothing left mapped, created, reserved or retained once the test's caches are gone)."""
    if request.param == "cpu":
        yield "cpu"
        return
    if not CUDA_MODE:
        pytest.skip(f"CUDA backend unavailable: {CUDA_REASON}")
    if CUDA_MODE == "gpu":
        yield "cuda:0"
        return
    emu = cuda_emu.Emulator.load()
    violations = emu.violations
    yield "cuda:0"

    def left():  # what close() must give back; reservations and the context go when the last
        # reference to the cache dies, which pytest may still hold here (session check below)
        return {
            k: v
            for k, v in emu.live().items()
            if v and k not in ("live_reservations", "context_refs")
        }

    if left():
        gc.collect()  # only when needed: a full collection costs ~0.3 s with torch loaded
    assert emu.violations == violations, f"CUDA rule violated: {emu.last_violation()}"
    assert not left(), f"driver objects left after the test's caches closed: {left()}"


@pytest.fixture(scope="session", autouse=True)
def cuda_emulation_session_check():
    """At the end of the session nothing may be left alive in the emulated driver."""
    yield
    if CUDA_MODE == "emulated":
        gc.collect()
        live = cuda_emu.Emulator.load().live()
        assert live == {k: 0 for k in live}, f"CUDA driver objects leaked by the suite: {live}"


@pytest.fixture(params=LAYOUTS)
def layout(request):
    return request.param


@pytest.fixture(params=PAGE_SIZES)
def page_size(request):
    return request.param


@pytest.fixture
def make_cache(device, layout, page_size):
    """Factory for small caches on the parametrized device/layout/page size; closes them after."""
    caches = []

    def make(
        *,
        num_layers=2,
        num_kv_heads=2,
        head_dim=64,
        max_batch_size=4,
        max_seq_len=4096,
        dtype=torch.float16,
        memory_budget=None,
        **kwargs,
    ):
        skip_below_gpu_pages(device, kwargs.get("page_size", page_size))
        cfg = vattention.KVCacheConfig(
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            max_batch_size=max_batch_size,
            max_seq_len=max_seq_len,
            dtype=dtype,
            device=kwargs.pop("device", device),
            page_size=kwargs.pop("page_size", page_size),
            layout=kwargs.pop("layout", layout),
            **kwargs,
        )
        cache = vattention.KVCache(cfg, memory_budget=memory_budget)
        caches.append(cache)
        return cache

    yield make
    for cache in caches:
        if not cache.closed:
            assert cache._core.check_invariants() == ""
            cache.close()
    caches.clear()  # drop them, so the device fixture can check that everything was given back
