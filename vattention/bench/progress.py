"""Progress display for the CLI on stderr: a tqdm bar on a terminal when tqdm is installed (extra
``bench``), else plain lines, one every 25% where stderr is not a terminal (a log file gets a few
lines, not one redraw per update)."""

from __future__ import annotations

import sys
from typing import Any, Optional

__all__ = ["Progress"]


class Progress:
    """Count finished work of a run: requests (the demo, one allocator of a benchmark) or passes
    (one engine's passes over a workload of ``bench vllm``).

    Parameters
    ----------
    total : int
        Units of work in the run.
    label : str
        Shown before the count.
    enabled : bool
        False shows nothing (``--quiet``).
    unit : str
        What is counted (tqdm's unit; default ``"req"``).

    Examples
    --------
    >>> with Progress(2, "ideal", enabled=False) as bar:
    ...     bar.update(2)
    """

    def __init__(self, total: int, label: str, *, enabled: bool = True, unit: str = "req") -> None:
        self.total, self.label, self.enabled = total, label, enabled
        self.done = 0
        self._next_percent = 10
        self._bar: Optional[Any] = None  # a tqdm bar (tqdm ships no type information)
        if enabled and sys.stderr.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=total, desc=f"{label:<24}", unit=unit, leave=True)

    def update(self, count: int) -> None:
        """``count`` more requests finished."""
        self.done += count
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(count)
            return
        percent = 100 * self.done // max(self.total, 1)
        if percent >= self._next_percent:
            tty = sys.stderr.isatty()
            start, end = ("\r", "") if tty else ("", "\n")
            sys.stderr.write(
                f"{start}{self.label:<24} {percent:3d}% ({self.done}/{self.total}){end}"
            )
            sys.stderr.flush()
            step = 10 if tty else 25
            self._next_percent = percent - percent % step + step

    def close(self) -> None:
        """Finish the line."""
        if self._bar is not None:
            self._bar.close()
        elif self.enabled and sys.stderr.isatty():
            sys.stderr.write("\n")

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
