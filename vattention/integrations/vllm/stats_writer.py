"""``VATTENTION_VLLM_STATS``: each worker's cache statistics as JSON, while running and at exit."""

from __future__ import annotations

import json
import os
import threading
from typing import Callable, Dict

__all__ = ["StatsWriter", "stats_path"]

INTERVAL_S = 5.0


def stats_path(base: str, rank: int, world_size: int) -> str:
    """``base`` for a single worker, ``base.rank<N>`` when there are several.

    >>> stats_path("/tmp/kv.json", 0, 1), stats_path("/tmp/kv.json", 1, 2)
    ('/tmp/kv.json', '/tmp/kv.json.rank1')
    """
    return base if world_size <= 1 else f"{base}.rank{rank}"


class StatsWriter:
    """Writes ``snapshot()`` to ``path`` every ``interval_s`` seconds, and once more on
    :meth:`close`.

    Each write replaces the file atomically (write to a temporary name, then rename), so a reader
    never sees half a document. The thread is a daemon: it never keeps a process alive.
    """

    def __init__(self, path: str, snapshot: Callable[[], Dict], interval_s: float = INTERVAL_S):
        self._path, self._snapshot, self._interval = path, snapshot, interval_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="vattention-stats", daemon=True)
        self.write()
        self._thread.start()

    def write(self, snapshot: Dict | None = None) -> None:
        """Write one snapshot now (``snapshot()`` unless one is given)."""
        data = self._snapshot() if snapshot is None else snapshot
        with self._lock:
            tmp = f"{self._path}.tmp{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, self._path)

    def close(self, final: Dict) -> None:
        """Stop the thread and write ``final`` as the last snapshot. Idempotent."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        self.write(final)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.write()
            except Exception:  # the cache closed under us, or the disk is full: try next tick
                pass
