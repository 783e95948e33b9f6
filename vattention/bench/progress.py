"""Progress display for the CLI: tqdm when installed (extra ``bench``), else a plain line on
stderr."""

from __future__ import annotations

import sys
from typing import Any, Optional

__all__ = ["Progress"]


class Progress:
    """Count finished requests of a run (the demo, or one allocator of a benchmark).

    Parameters
    ----------
    total : int
        Requests in the run.
    label : str
        Shown before the count.
    enabled : bool
        False shows nothing (``--quiet``).

    Examples
    --------
    >>> with Progress(2, "ideal", enabled=False) as bar:
    ...     bar.update(2)
    """

    def __init__(self, total: int, label: str, *, enabled: bool = True) -> None:
        self.total, self.label, self.enabled = total, label, enabled
        self.done = 0
        self._next_percent = 10
        self._bar: Optional[Any] = None  # a tqdm bar (tqdm ships no type information)
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=total, desc=f"{label:<24}", unit="req", leave=True)

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
