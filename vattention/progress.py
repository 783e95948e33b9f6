"""A dependency-free progress bar for the CLI (tqdm is used instead when installed)."""

from __future__ import annotations

import sys
import time


class Progress:
    """``with Progress(total, "requests") as bar: bar.update(n)``; draws on stderr."""

    def __init__(self, total: int, unit: str, *, stream=None, width: int = 30) -> None:
        self.total, self.unit, self.width = max(total, 1), unit, width
        self.stream = stream or sys.stderr
        self.done = 0
        self.start = time.perf_counter()
        self._last = 0.0

    def update(self, n: int = 1, *, note: str = "") -> None:
        self.done = min(self.total, self.done + n)
        now = time.perf_counter()
        if now - self._last < 0.1 and self.done < self.total:
            return
        self._last = now
        filled = int(self.width * self.done / self.total)
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\r[{bar}] {self.done}/{self.total} {self.unit} "
                          f"{now - self.start:5.1f}s {note}".ljust(79))
        self.stream.flush()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.update(0)
        self.stream.write("\n")
        self.stream.flush()
