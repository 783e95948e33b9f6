"""A worker's page budget that rises at once and falls only once it has stayed lower a while.

Each step the scheduler says how many bytes of pages the worker may hold (:mod:`.elastic`). When
a burst of requests ends it falls to the prefix-cache cap plus the headroom, and the next burst
raises it again: lowered at once, every page above the cap is destroyed at the end of one burst
and created again at the start of the next (on the host the kernel clears each new page: about
170 us per 256 KiB page on a 2-core Zen 4 VM, on the cores the model needs). Allocators settle
this the same way (jemalloc's ``dirty_decay_ms``): memory goes back once it has stayed unused
for a delay, so back-to-back bursts reuse it and an engine left idle still returns it.

The default, 10 s, is jemalloc's ``dirty_decay_ms`` default, and it outlasts the ramp of a burst:
chunked prefill admits a burst of long prompts over seconds, and with 2 s (the default until then)
the pages kept from the last burst were destroyed before the later prompts of the next one
needed them, and created again (``small``, 8 prompts of ~3k tokens, one engine, passes back to
back: 13,816 pages created over the run with 2 s, 4,464-4,688 with 10 s; ``KVCache.step``
363-371 -> 74-90 ms a pass).

:class:`DelayedBudget` applies ``max(budget set within the last delay_s)``; a thread applies the
lower figure when the delay runs out with no step to do it (an idle engine makes none). Only
engines outside a shared pool use a delay: in a pool, released pages are other engines' at once.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import threading
import time
from typing import Any, Callable, Deque, Mapping, Optional, Tuple

from ...errors import ConfigError
from .settings import ENV_POOL, ENV_RELEASE_DELAY

__all__ = ["DelayedBudget", "DEFAULT_RELEASE_DELAY_S", "MAX_RELEASE_DELAY_S", "release_delay"]

logger = logging.getLogger("vllm.vattention")

DEFAULT_RELEASE_DELAY_S = 10.0
MAX_RELEASE_DELAY_S = 3600.0


def release_delay(env: Mapping[str, str] = os.environ) -> float:
    """Seconds a worker keeps pages above a lowered budget: ``VATTENTION_VLLM_RELEASE_DELAY``,
    else 10 outside a pool and 0 in one (``VATTENTION_VLLM_POOL``).

    Raises :class:`~vattention.errors.ConfigError` for a value that is not a number of seconds in
    ``[0, 3600]``, and for a non-zero delay in a pool (its engines count released pages as
    theirs at once).

    >>> release_delay({}), release_delay({"VATTENTION_VLLM_POOL": "chat"})
    (10.0, 0.0)
    >>> release_delay({"VATTENTION_VLLM_RELEASE_DELAY": "0.5"})
    0.5
    """
    pool = env.get(ENV_POOL)
    raw = env.get(ENV_RELEASE_DELAY)
    if raw is None:
        return 0.0 if pool else DEFAULT_RELEASE_DELAY_S
    try:
        delay = float(raw)
    except ValueError:
        delay = math.nan
    if not 0 <= delay <= MAX_RELEASE_DELAY_S:
        raise ConfigError(
            f"{ENV_RELEASE_DELAY}={raw!r}: must be a number of seconds in [0, "
            f"{MAX_RELEASE_DELAY_S:g}]"
        )
    if delay and pool:
        raise ConfigError(
            f"{ENV_RELEASE_DELAY}={raw!r} with {ENV_POOL}={pool!r}: engines of a pool release "
            "pages at once (the others count them as theirs); leave it unset or 0"
        )
    return delay


class DelayedBudget:
    """``apply(budget)`` at once when ``set(budget)`` raises it, ``delay_s`` after it lowers it.

    What is applied is always the largest budget set within the last ``delay_s`` seconds (the
    latest, if none is more recent), so a lowering that a later step undoes within the delay never
    reaches ``apply``. ``delay_s == 0`` applies every budget at once, with no thread. ``apply``
    runs on the caller's thread when the budget rises, on this object's daemon thread when a
    delay runs out, never on both at once. Not for concurrent ``set`` callers (one per worker:
    its model thread).
    """

    def __init__(
        self,
        apply: Callable[[int], Any],
        delay_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not delay_s >= 0:
            raise ValueError(f"release delay {delay_s!r} s: must be >= 0")
        self._apply, self._delay, self._clock = apply, float(delay_s), clock
        # (time set, budget), budgets strictly decreasing front to back: the front is the
        # largest within the window, later entries the candidates once it expires
        self._recent: Deque[Tuple[float, int]] = collections.deque()
        self._applied: Optional[int] = None
        self._lock = threading.Condition()
        self._closed = False
        self._thread: Optional[threading.Thread] = None

    @property
    def delay_s(self) -> float:
        return self._delay

    @property
    def applied(self) -> Optional[int]:
        """The budget last given to ``apply`` (None before the first)."""
        return self._applied

    def set(self, budget: int) -> None:
        """This step's budget: applied now if it is the largest of the delay's window."""
        with self._lock:
            if self._closed:
                return
            now = self._clock()
            waiting = len(self._recent) > 1  # the thread has a deadline, which stays or passes
            while self._recent and self._recent[-1][1] <= budget:
                self._recent.pop()
            self._recent.append((now, budget))
            self._settle(now)
            if len(self._recent) > 1 and not waiting:  # a deadline where the thread had none
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._run, name="vattention-release-delay", daemon=True
                    )
                    self._thread.start()
                self._lock.notify()  # only then: most steps set the same budget, no wake-up

    def close(self) -> None:
        """Stop the thread; nothing is applied after this returns. Idempotent."""
        with self._lock:
            self._closed = True
            self._lock.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    # ---- inside (under the lock) -----------------------------------------------------------
    def _settle(self, now: float) -> None:
        """Drop what left the window (never the latest), then apply the largest left."""
        while len(self._recent) > 1 and self._recent[0][0] + self._delay <= now:
            self._recent.popleft()
        target = self._recent[0][1]
        if target != self._applied:
            self._apply(target)
            self._applied = target

    def _run(self) -> None:
        with self._lock:
            while not self._closed:
                if len(self._recent) > 1:
                    wait = self._recent[0][0] + self._delay - self._clock()
                    if wait <= 0:
                        try:
                            self._settle(self._clock())
                        except Exception:  # the cache closing under us: the next step retries
                            logger.debug("vattention: delayed budget not applied", exc_info=True)
                            if len(self._recent) > 1:  # not the latest: set() keeps one
                                self._recent.popleft()
                        continue
                    self._lock.wait(wait)
                else:
                    self._lock.wait()
