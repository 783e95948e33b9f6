"""Request-length traces: (prefill tokens, decode tokens) per request, from real workloads.

The one reader of trace CSVs: the demo, the memory benchmark (:mod:`.workload`) and the
benchmarks in ``benchmarks/`` all load traces here. Columns are found by name in the header
(``num_prefill_tokens`` and ``num_decode_tokens``; any others, in any order, are ignored), and
every value is checked: a bad one is reported with the file, row, line and column.

The package ships a seeded 4,000-row sample of each trace in ``vattention/bench/data`` (see its
README for sources and licenses), so demos and benchmarks run from an installed package. Pass a
CSV path for the full trace.

Example
-------
>>> from vattention.bench.traces import load_trace
>>> trace = load_trace("sharegpt")
>>> trace.shape, bool((trace > 0).all())
((4000, 2), True)
"""

from __future__ import annotations

import csv
import io
import math
import os
from importlib import resources
from typing import Iterable

import numpy as np

__all__ = ["TRACE_NAMES", "TRACE_COLUMNS", "load_trace"]

TRACE_NAMES = ("sharegpt", "arxiv_summarization", "arxiv_long")
# (column, least value): a request has a prompt of at least one token; it may decode none.
TRACE_COLUMNS = (("num_prefill_tokens", 1), ("num_decode_tokens", 0))


def load_trace(name_or_path: str) -> np.ndarray:
    """Load a trace as an int64 array ``[N, 2]`` of (prefill tokens, decode tokens).

    Parameters
    ----------
    name_or_path : str
        One of ``TRACE_NAMES`` (packaged sample) or the path of a CSV whose header names the
        columns ``num_prefill_tokens`` and ``num_decode_tokens`` (other columns are ignored).

    Returns
    -------
    numpy.ndarray
        int64, shape ``[N, 2]``, N >= 1, rows in file order. Values are whole numbers of tokens
        (``12`` or ``12.0``): prefill >= 1, decode >= 0.

    Raises
    ------
    FileNotFoundError
        ``name_or_path`` is neither a packaged trace nor an existing file.
    ValueError
        A column is missing, a value is not a whole number in range (the message names the
        file, the row, its line in the file and the column), or the trace has no rows.

    Examples
    --------
    >>> import pathlib, tempfile
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "t.csv"
    >>> _ = path.write_text("num_decode_tokens,num_prefill_tokens\\n5,100\\n7,x\\n")
    >>> load_trace(str(path))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: trace .../t.csv, row 2 (line 3), column 'num_prefill_tokens': 'x' is not ...
    """
    if name_or_path in TRACE_NAMES:
        text = resources.files(f"{__package__}.data").joinpath(f"{name_or_path}.csv").read_text()
        return _parse(io.StringIO(text), f"packaged trace {name_or_path!r}")
    if os.path.exists(name_or_path):
        with open(name_or_path, newline="") as f:
            return _parse(f, f"trace {name_or_path}")
    raise FileNotFoundError(
        f"trace {name_or_path!r} is neither a packaged trace {TRACE_NAMES} nor an existing file"
    )


def _parse(lines: Iterable[str], source: str) -> np.ndarray:
    """Rows of a trace CSV read by column name; ``source`` names the file in errors."""
    reader = csv.DictReader(lines)
    header = reader.fieldnames or []
    missing = [name for name, _ in TRACE_COLUMNS if name not in header]
    if missing:
        raise ValueError(
            f"{source} lacks column(s) {', '.join(missing)}: its header is "
            f"{','.join(header) or '(empty file)'}; need "
            f"{', '.join(name for name, _ in TRACE_COLUMNS)}"
        )
    data = []
    for row_number, row in enumerate(reader, start=1):
        data.append(
            tuple(
                _value(row.get(name), least, source, row_number, reader.line_num, name)
                for name, least in TRACE_COLUMNS
            )
        )
    if not data:
        raise ValueError(f"{source} has no rows")
    return np.asarray(data, dtype=np.int64).reshape(-1, 2)


def _value(text, least: int, source: str, row: int, line: int, column: str) -> int:
    """The whole number ``text`` of one cell, >= ``least``; else a ValueError naming the cell."""
    where = f"{source}, row {row} (line {line}), column {column!r}"
    if text is None or not text.strip():
        raise ValueError(
            f"{where}: no value (the row has fewer fields than the header)"
            if text is None
            else f"{where}: empty value"
        )
    try:
        value = int(text)
    except ValueError:
        try:
            number = float(text)
        except ValueError:
            number = math.nan
        if not (math.isfinite(number) and number.is_integer()):
            raise ValueError(f"{where}: {text!r} is not a whole number of tokens") from None
        value = int(number)
    if value < least:
        raise ValueError(f"{where}: {value} is below {least}")
    return value
