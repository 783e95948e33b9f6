"""A pytest plugin (``-p support.vllm_core_pool``) for vLLM's own KV-cache core tests, run in the
vLLM venv by tests/test_vllm_core_suite.py.

``VATTENTION_CORE_POOL=elastic`` turns every ``BlockPool`` vLLM's KV cache coordinator builds into
the plugin's :class:`~vattention.integrations.vllm.elastic.ElasticBlockPool`, as the plugin's
scheduler installs it on its own pool (vattention/integrations/vllm/scheduler.py): at
construction, before any block is handed out, over a ledger of the engine's own (a
``LocalLedger`` of every block) with the scheduler's default cap and headroom (``elastic_policy``,
one byte a block). ``stock`` leaves vLLM's pool alone. Pools the tests build themselves (not
through the coordinator) stay vLLM's either way.

Every test's outcome, and for a failure the end of its report, is written as JSON to
``VATTENTION_CORE_RESULTS``; with the elastic pool also what it did in the test
(``beyond_cap``: blocks ``get_new_blocks`` handed out from beyond the prefix-cache cap) and, for
a failure, the free blocks of the pool of the failing frame's ``manager``, as vLLM's scheduler
counts them (``get_num_free_blocks``) and as its free queue holds them. vLLM's root conftest
(models, servers, GPUs) is not vendored: its ``caplog_vllm`` fixture, which eight of these tests
use, is defined here as vLLM defines it.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Dict

import pytest

MODE = os.environ.get("VATTENTION_CORE_POOL", "elastic")
RESULTS = os.environ.get("VATTENTION_CORE_RESULTS")
if MODE not in ("elastic", "stock"):
    raise ValueError(f"VATTENTION_CORE_POOL={MODE!r}: use 'elastic' or 'stock'")

_outcomes: Dict[str, Dict[str, Any]] = {}
installed = 0  # elastic pools built in this session
_beyond_cap = 0  # blocks handed out from beyond the cap in the running test


def _elastic_block_pool(*args: Any, **kwargs: Any) -> Any:
    """vLLM's ``BlockPool(...)``, then the plugin's elastic pool installed on it."""
    from vllm.v1.core.block_pool import BlockPool

    from vattention.integrations.vllm.elastic import ElasticBlockPool
    from vattention.integrations.vllm.scheduler import elastic_policy
    from vattention.pool_ledger import LocalLedger

    global installed
    pool = BlockPool(*args, **kwargs)
    blocks = pool.num_gpu_blocks - 1  # the null block holds no pages
    policy = elastic_policy(
        block_bytes=1, num_blocks=blocks, block_size=pool.hash_block_size, step_blocks=blocks
    )
    installed += 1
    return ElasticBlockPool.install(pool, LocalLedger(max(blocks, 0)), policy)


def _counting_beyond_cap(get_new_blocks: Any) -> Any:
    """``ElasticBlockPool.get_new_blocks``, counting the blocks it takes from beyond the cap
    (the same count its own code takes first)."""

    def wrapper(self: Any, num_blocks: int) -> Any:
        global _beyond_cap
        over = self.free_block_queue.num_free_blocks - self._policy.cache_cap_blocks
        blocks = get_new_blocks(self, num_blocks)
        _beyond_cap += min(num_blocks, max(0, over))
        return blocks

    return wrapper


def _failing_pool(excinfo: Any) -> Dict[str, int]:
    """The free blocks of the elastic pool a failing test's ``manager`` holds (innermost first)."""
    from vattention.integrations.vllm.elastic import ElasticBlockPool

    for entry in reversed(excinfo.traceback):
        pool = getattr(entry.frame.f_locals.get("manager"), "block_pool", None)
        if isinstance(pool, ElasticBlockPool):
            return {
                "free_blocks": pool.get_num_free_blocks(),
                "queued": pool.free_block_queue.num_free_blocks,
                "cap": pool._policy.cache_cap_blocks,
            }
    return {}


def pytest_configure(config: pytest.Config) -> None:
    for mark in ("cpu_test", "skip_global_cleanup"):  # vLLM's, declared in its root conftest
        config.addinivalue_line("markers", f"{mark}: vLLM's own marker")
    if MODE == "elastic":
        from vllm.v1.core import kv_cache_coordinator

        # The coordinator names BlockPool in its own module: the one place vLLM builds the
        # scheduler's pool (KVCacheCoordinator.__init__).
        kv_cache_coordinator.BlockPool = _elastic_block_pool  # type: ignore[attr-defined]
        from vattention.integrations.vllm.elastic import ElasticBlockPool

        ElasticBlockPool.get_new_blocks = _counting_beyond_cap(  # type: ignore[method-assign]
            ElasticBlockPool.get_new_blocks
        )


@pytest.fixture()
def caplog_vllm(caplog: pytest.LogCaptureFixture):
    """vLLM's fixture: its logger propagates to the root logger, at INFO, while the test runs."""
    logger = logging.getLogger("vllm")
    previous = logger.propagate
    logger.propagate = True
    try:
        with caplog.at_level(logging.INFO):
            yield caplog
    finally:
        logger.propagate = previous


def pytest_runtest_setup(item: pytest.Item) -> None:
    global _beyond_cap
    _beyond_cap = 0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    entry = _outcomes.setdefault(report.nodeid, {"outcome": "passed", "report": ""})
    if report.failed:
        entry["outcome"] = "failed" if report.when == "call" else "error"
        entry["report"] = report.longreprtext[-3000:]
        if MODE == "elastic" and call.excinfo is not None:
            entry["pool"] = _failing_pool(call.excinfo)
    elif report.skipped and entry["outcome"] == "passed":
        entry["outcome"] = "skipped"
    if report.when == "call" and MODE == "elastic":
        entry["beyond_cap"] = _beyond_cap


def pytest_sessionfinish(session: pytest.Session) -> None:
    if RESULTS:
        with open(RESULTS, "w") as f:
            json.dump({"mode": MODE, "elastic_pools": installed, "tests": _outcomes}, f)
