"""Continuous-batching simulation that drives one allocator over a request sequence.

Scheduling model (the same for every allocator):

* Iteration = one model step. First every running request decodes one token (its KV length
  grows by 1); then waiting requests are admitted first-come-first-served while the one at the
  head of the queue fits and fewer than ``max_batch_size`` run. An admitted request prefills its
  whole prompt in that iteration.
* A request finishes at the end of the iteration in which its KV length reaches
  ``prefill + decode`` tokens; its memory is released then.
* If the running requests cannot all grow, the **youngest** (most recently admitted) is
  preempted by recompute: its memory is released and it goes back to the *front* of the queue,
  keeping the tokens it already generated; on re-admission it prefills ``prompt + generated``
  tokens (counted as ``recomputed_tokens``). Then growth is retried. Same policy as vLLM.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import time
from typing import Any, Callable, Dict, List, Optional

import numpy as np

from vattention.errors import ConfigError, DriverError

from .allocators import ALL_ALLOCATORS, Allocator, make_allocator, real_cache_factory
from .progress import Progress
from .sizing import host_mapping_problem, min_bytes_for_request
from .workload import ModelShape, Workload

__all__ = ["SimResult", "simulate", "summarize", "BenchReport", "run_memory_benchmark"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class SimResult:
    """Per-step series and totals of one allocator's run.

    Attributes
    ----------
    concurrency, live_tokens, held_bytes, mapped_bytes : numpy.ndarray
        Per step: running requests, tokens in their KV, physical bytes held for them, and all
        physical bytes committed (vattention: including pages freed slots keep for reuse).
    prefill_tokens, decode_tokens, recomputed_tokens : int
        Tokens prefilled at first admission, decoded, and prefilled again after preemption.
    counters_start, counters_end : dict
        Allocator counters (e.g. vattention map/unmap calls) before and after the run.
    """

    allocator: str
    note: str
    bytes_per_token: int
    budget_bytes: int
    max_batch_size: int
    concurrency: np.ndarray
    live_tokens: np.ndarray
    held_bytes: np.ndarray
    mapped_bytes: np.ndarray
    finished: int
    preemptions: int
    prefill_tokens: int
    decode_tokens: int
    recomputed_tokens: int
    counters_start: Dict[str, int]
    counters_end: Dict[str, int]
    wall_seconds: float
    live_bytes: Optional[np.ndarray] = None  # per step; None: live_tokens * bytes_per_token

    @property
    def steps(self) -> int:
        """Iterations until the last request finished."""
        return int(len(self.concurrency))


def simulate(
    allocator: Allocator,
    workload: Workload,
    *,
    max_batch_size: int,
    on_finish: Optional[Callable[[int], None]] = None,
    check: bool = False,
    max_steps: Optional[int] = None,
) -> SimResult:
    """Run the workload through ``allocator`` (see the module docstring for the policy).

    Parameters
    ----------
    allocator : Allocator
        Fresh allocator; it is not closed here.
    workload : Workload
        Requests in arrival order.
    max_batch_size : int
        Most requests running at once (the same for every allocator).
    on_finish : callable, optional
        Called with the number of requests that finished in each iteration (progress).
    check : bool
        Call ``allocator.check()`` and assert ``live <= held <= budget`` every iteration.
    max_steps : int, optional
        Safety stop; default ``10 * (total tokens) + 1000``.

    Raises
    ------
    RuntimeError
        A request cannot run even alone (budget or ``max_seq_len`` too small).
    """
    prompt = workload.prefill_tokens.astype(np.int64)
    total = workload.total_tokens.astype(np.int64)
    n = workload.num_requests
    bpt = allocator.bytes_per_token
    limit = max_steps or int(10 * total.sum()) + 1000
    generated = np.zeros(n, dtype=np.int64)
    admitted_before = np.zeros(n, dtype=bool)
    queue = collections.deque(range(n))
    running: List[int] = []  # admission order: youngest last
    length: Dict[int, int] = {}  # rid -> KV tokens
    conc: List[int] = []
    live, held, mapped, need = [], [], [], []
    finished = preemptions = prefilled = decoded = recomputed = 0
    counters_start = allocator.counters()
    started = time.perf_counter()
    while queue or running:
        if len(conc) >= limit:
            raise RuntimeError(f"{allocator.name}: no end after {limit} steps")
        if running:  # 1. every running request decodes one token
            new = {rid: length[rid] + 1 for rid in running}
            while not allocator.grow(new):
                victim = running.pop()
                del new[victim], length[victim]
                allocator.release(victim)
                queue.appendleft(victim)
                preemptions += 1
                if not running:
                    raise RuntimeError(
                        f"{allocator.name}: request {victim} cannot grow even "
                        "alone; raise the budget"
                    )
            generated[running] += 1
            decoded += len(running)
            length.update(new)
        while queue and len(running) < max_batch_size:  # 2. FCFS admission
            rid = queue[0]
            tokens = int(prompt[rid] + generated[rid])
            if not allocator.admit(rid, tokens, int(total[rid])):
                break
            queue.popleft()
            running.append(rid)
            length[rid] = tokens
            if admitted_before[rid]:
                recomputed += tokens
            else:
                prefilled += tokens
                admitted_before[rid] = True
        if not running:
            raise RuntimeError(
                f"{allocator.name}: request {queue[0]} ({int(total[queue[0]])} "
                "tokens) does not fit even alone; raise the budget"
            )
        conc.append(len(running))  # 3. record this iteration
        live.append(sum(length.values()))
        need.append(sum(allocator.kv_bytes(n) for n in length.values()))
        held.append(allocator.held_bytes())
        mapped.append(allocator.mapped_bytes())
        if check:
            allocator.check()
            if not need[-1] <= held[-1] <= mapped[-1] <= allocator.budget_bytes:
                raise AssertionError(
                    f"{allocator.name} step {len(conc)}: live "
                    f"{need[-1]} held {held[-1]} mapped {mapped[-1]} "
                    f"budget {allocator.budget_bytes}"
                )
        done = [rid for rid in running if length[rid] >= total[rid]]  # 4. finish
        for rid in done:
            running.remove(rid)
            del length[rid]
            allocator.release(rid)
        finished += len(done)
        if on_finish and done:
            on_finish(len(done))
    return SimResult(
        allocator=allocator.name,
        note=allocator.note,
        bytes_per_token=bpt,
        budget_bytes=allocator.budget_bytes,
        max_batch_size=max_batch_size,
        concurrency=np.asarray(conc, dtype=np.int64),
        live_tokens=np.asarray(live, np.int64),
        held_bytes=np.asarray(held, dtype=np.int64),
        mapped_bytes=np.asarray(mapped, dtype=np.int64),
        finished=finished,
        preemptions=preemptions,
        prefill_tokens=prefilled,
        decode_tokens=decoded,
        recomputed_tokens=recomputed,
        counters_start=counters_start,
        counters_end=allocator.counters(),
        wall_seconds=time.perf_counter() - started,
        live_bytes=np.asarray(need, dtype=np.int64),
    )


def summarize(result: SimResult) -> Dict[str, Any]:
    """Metrics of one run, as written to JSON.

    ``efficiency_*`` = bytes of live tokens / physical bytes held for the running requests;
    ``efficiency_mean`` averages over iterations, ``efficiency_peak`` is taken at the iteration
    with the most live tokens (peak load). Where the allocator commits more than it holds for
    requests (vattention's deferred reclamation), ``efficiency_mapped_mean`` and
    ``efficiency_mapped_peak`` divide by all mapped bytes instead. vattention rows add
    ``map_calls_per_step`` and ``unmap_calls_per_step``.
    """
    live_bytes = (
        result.live_tokens * result.bytes_per_token
        if result.live_bytes is None
        else result.live_bytes
    )
    efficiency = live_bytes / np.maximum(result.held_bytes, 1)
    peak = int(np.argmax(result.live_tokens))
    metrics: Dict[str, Any] = {
        "efficiency_mean": float(efficiency.mean()),
        "efficiency_peak": float(efficiency[peak]),
        "concurrency_mean": float(result.concurrency.mean()),
        "concurrency_max": int(result.concurrency.max()),
        "preemptions": result.preemptions,
        "steps": result.steps,
        "finished": result.finished,
        "recomputed_tokens": result.recomputed_tokens,
        "held_bytes_max": int(result.held_bytes.max()),
        "live_bytes_max": int(live_bytes.max()),
        "wall_seconds": round(result.wall_seconds, 3),
        "note": result.note,
    }
    if "map_calls" in result.counters_end:
        mapped = live_bytes / np.maximum(result.mapped_bytes, 1)
        metrics["efficiency_mapped_mean"] = float(mapped.mean())
        metrics["efficiency_mapped_peak"] = float(mapped[peak])
        metrics["mapped_bytes_max"] = int(result.mapped_bytes.max())
    start, end = result.counters_start, result.counters_end
    for key in ("map_calls", "unmap_calls"):
        if key in end:
            calls = end[key] - start.get(key, 0)
            metrics[key] = int(calls)
            metrics[f"{key}_per_step"] = calls / max(result.steps, 1)
    for key in ("failed_steps",):
        if key in end:
            metrics[key] = int(end[key] - start.get(key, 0))
    return metrics


@dataclasses.dataclass
class BenchReport:
    """Everything one benchmark run produced.

    Attributes
    ----------
    meta : dict
        Workload, model, budget and limits of the run.
    results : dict
        Allocator name -> :class:`SimResult` (per-step series, for plots).
    metrics : dict
        Allocator name -> :func:`summarize` dict (the JSON object).
    """

    meta: Dict[str, Any]
    results: Dict[str, SimResult]
    metrics: Dict[str, Dict[str, Any]]


def run_memory_benchmark(
    workload: Workload,
    model: ModelShape,
    *,
    budget_bytes: int,
    max_seq_len: int,
    max_batch_size: int,
    allocators=ALL_ALLOCATORS,
    cache_factory: Optional[Callable] = None,
    check: bool = False,
    progress: bool = True,
    reclaim: str = "deferred",
) -> BenchReport:
    """Simulate ``workload`` once per allocator, one allocator alive at a time.

    Parameters
    ----------
    workload : Workload
        The same request sequence for every allocator.
    model : ModelShape
        KV shape (bytes per token).
    budget_bytes : int
        KV memory budget; also the ``memory_budget`` of the real vattention caches, which
        commit host memory for the pages they map.
    max_seq_len, max_batch_size : int
        Longest request and most concurrent requests (cache slots).
    allocators : sequence of str
        Names from :data:`vattention.bench.allocators.ALL_ALLOCATORS`.
    cache_factory : callable, optional
        Test double for the vattention cache (see ``VAttentionAllocator``).
    check : bool
        Check invariants every step (slower; tests).
    progress : bool
        Show a progress bar per allocator.
    reclaim : str
        Reclamation policy of the real vattention caches: ``"deferred"`` (default) or
        ``"eager"``.

    Examples
    --------
    >>> import numpy as np
    >>> from vattention.bench.workload import MODELS
    >>> w = Workload("toy", np.array([10, 20]), np.array([5, 5]), False, 2)
    >>> r = run_memory_benchmark(w, MODELS["llama3-8b"], budget_bytes=64 << 20,
    ...                          max_seq_len=32, max_batch_size=4, allocators=["ideal"],
    ...                          progress=False)
    >>> r.metrics["ideal"]["efficiency_mean"], r.metrics["ideal"]["steps"]
    (1.0, 6)
    """
    total = workload.total_tokens
    if int(total.max()) > max_seq_len:
        raise ValueError(
            f"max_seq_len={max_seq_len} is below the longest request ({int(total.max())} tokens)"
        )
    meta: Dict[str, Any] = {
        "trace": workload.name,
        "num_requests": workload.num_requests,
        "sampled_with_replacement": workload.sampled_with_replacement,
        "trace_rows": workload.trace_rows,
        "prefill_tokens": int(workload.prefill_tokens.sum()),
        "decode_tokens": int(workload.decode_tokens.sum()),
        "model": model.name,
        "num_layers": model.num_layers,
        "window": model.window,
        "window_layers": model.window_layers,
        "num_kv_heads": model.num_kv_heads,
        "head_dim": model.head_dim,
        "dtype": model.dtype,
        "full_kv_heads": model.full_kv_heads,
        "full_head_dim": model.full_head_dim,
        "bytes_per_token": model.bytes_per_token,
        "budget_bytes": int(budget_bytes),
        "max_seq_len": int(max_seq_len),
        "max_batch_size": int(max_batch_size),
        "reclaim": reclaim,
    }
    factory = cache_factory
    if factory is None and reclaim != "deferred":
        factory = functools.partial(real_cache_factory, reclaim=reclaim)
    results: Dict[str, SimResult] = {}
    metrics: Dict[str, Dict[str, Any]] = {}
    for name in allocators:
        try:
            need = min_bytes_for_request(name, model, int(total.max()), max_seq_len)
        except ConfigError as exc:  # e.g. per-layer shapes in the mega layout
            metrics[name] = {"error": str(exc)}
            logger.warning("%s skipped: %s", name, exc)
            continue
        if need > budget_bytes:
            metrics[name] = {
                "error": f"the longest request ({int(total.max())} tokens) needs "
                f"{need} bytes alone, over the budget of {budget_bytes} "
                "bytes"
            }
            logger.warning("%s skipped: %s", name, metrics[name]["error"])
            continue
        problem = None if cache_factory else host_mapping_problem(name, model, budget_bytes)
        if problem:
            metrics[name] = {"error": problem}
            logger.warning("%s %s", name, problem)
            continue
        try:
            allocator = make_allocator(
                name,
                model,
                budget_bytes=budget_bytes,
                max_seq_len=max_seq_len,
                max_batch_size=max_batch_size,
                cache_factory=factory,
                verify=check,
            )
        except ConfigError as exc:  # e.g. per-layer windows in the mega layout
            metrics[name] = {"error": str(exc)}
            logger.warning("%s skipped: %s", name, exc)
            continue
        except DriverError as exc:
            metrics[name] = {"error": _explain_driver_error(exc)}
            logger.warning("%s failed: %s", name, metrics[name]["error"])
            continue
        try:
            with Progress(workload.num_requests, name, enabled=progress) as bar:
                result = simulate(
                    allocator,
                    workload,
                    max_batch_size=max_batch_size,
                    on_finish=bar.update,
                    check=check,
                )
        except DriverError as exc:  # an OS/driver limit, reported as this row's result
            metrics[name] = {"error": _explain_driver_error(exc)}
            logger.warning("%s failed: %s", name, metrics[name]["error"])
            continue
        finally:
            _close_quietly(allocator)
        results[name] = result
        metrics[name] = summarize(result)
        logger.info("%s: %s", name, metrics[name])
    return BenchReport(meta=meta, results=results, metrics=metrics)


def _explain_driver_error(exc: Exception) -> str:
    """The error text, plus the likely cause when the host backend ran out of mappings."""
    text = str(exc)
    if "Cannot allocate memory" in text or "errno 12" in text:
        try:
            with open("/proc/sys/vm/max_map_count") as f:
                limit = f.read().strip()
        except OSError:
            limit = "?"
        text += (
            f" -- the host backend maps every page separately and Linux allows "
            f"vm.max_map_count={limit} mappings per process; use a larger page, a smaller "
            "--budget, or raise vm.max_map_count"
        )
    return text


def _close_quietly(allocator: Allocator) -> None:
    try:
        allocator.close()
    except Exception as exc:  # closing after a failed OS call must not hide that failure
        logger.warning("%s: close failed: %s", allocator.name, exc)
