"""Request-length traces: (prefill tokens, decode tokens) per request, from real workloads.

The package ships a seeded 4,000-row sample of each trace in ``vattention/bench/data`` (see its README
for sources and licenses), so demos and benchmarks run from an installed package. Pass a CSV path
(``num_prefill_tokens,num_decode_tokens,...`` columns) for the full trace.

Example
-------
>>> from vattention.bench.traces import load_trace
>>> trace = load_trace("sharegpt")
>>> trace.shape[1], bool((trace > 0).all())
(2, True)
"""

from __future__ import annotations

import csv
import os
from importlib import resources

import numpy as np

__all__ = ["TRACE_NAMES", "load_trace"]

TRACE_NAMES = ("sharegpt", "arxiv_summarization", "arxiv_long")


def load_trace(name_or_path: str) -> np.ndarray:
    """Load a trace as an int64 array ``[N, 2]`` of (prefill tokens, decode tokens).

    Parameters
    ----------
    name_or_path : str
        One of ``TRACE_NAMES`` (packaged sample) or the path of a CSV with columns
        ``num_prefill_tokens`` and ``num_decode_tokens``.
    """
    if name_or_path in TRACE_NAMES:
        text = resources.files("vattention.bench.data").joinpath(f"{name_or_path}.csv").read_text()
        rows = list(csv.DictReader(text.splitlines()))
    elif os.path.exists(name_or_path):
        with open(name_or_path, newline="") as f:
            rows = list(csv.DictReader(f))
    else:
        raise FileNotFoundError(
            f"trace {name_or_path!r} is neither a packaged trace {TRACE_NAMES} nor an existing file")
    try:
        data = [(int(float(r["num_prefill_tokens"])), int(float(r["num_decode_tokens"]))) for r in rows]
    except KeyError as e:
        raise ValueError(f"trace {name_or_path!r} lacks column {e}; need num_prefill_tokens, "
                         "num_decode_tokens") from None
    return np.asarray(data, dtype=np.int64).reshape(-1, 2)
