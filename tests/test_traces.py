"""One trace reader (vattention.bench.traces), by column name, validated.

The demo, the memory benchmark's workload and benchmarks/ all read traces through
``load_trace``; a bad file is reported with the file, the row, its line and the column.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from vattention.bench import traces, workload
from vattention.bench.traces import TRACE_NAMES, load_trace

HEADER = "num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n"


def write(tmp_path, text, name="t.csv"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("name", TRACE_NAMES)
def test_packaged_traces_load_as_4000_positive_rows(name):
    trace = load_trace(name)
    assert trace.dtype == np.int64 and trace.shape == (4000, 2)
    assert (trace > 0).all()


def test_columns_are_found_by_name_in_any_order_others_ignored(tmp_path):
    path = write(
        tmp_path, "pd_ratio,num_decode_tokens,id,num_prefill_tokens\n2.5,5,a,10\r\n1,7,b,20\r\n"
    )
    assert load_trace(path).tolist() == [[10, 5], [20, 7]]


def test_whole_numbers_written_as_floats_are_read(tmp_path):
    path = write(tmp_path, HEADER + "10.0,5,15,2\n2e3,0,2000,0\n")
    assert load_trace(path).tolist() == [[10, 5], [2000, 0]]


def test_workload_reads_through_the_same_reader(tmp_path):
    # Columns swapped: a positional reader would take decode tokens for prefill tokens.
    path = write(tmp_path, "num_decode_tokens,num_prefill_tokens\n5,10\n1,20\n3,30\n")
    w = workload.load_workload(path, 3, seed=0)
    assert sorted(w.prefill_tokens.tolist()) == [10, 20, 30]
    assert sorted(w.total_tokens.tolist()) == [15, 21, 33]
    with pytest.raises(ValueError, match=r"row 1 \(line 2\), column 'num_decode_tokens'"):
        workload.load_workload(write(tmp_path, HEADER + "10,-1,9,0\n", "bad.csv"), 1)


@pytest.mark.parametrize(
    "body,row,line,column,what",
    [
        ("10,5,15,2\n20,x,21,20\n", 2, 3, "num_decode_tokens", "'x' is not a whole number"),
        ("10,5,15,2\n12.5,1,13.5,12\n", 2, 3, "num_prefill_tokens", "'12.5' is not a whole number"),
        ("0,5,5,0\n", 1, 2, "num_prefill_tokens", "0 is below 1"),
        ("10,-3,7,0\n", 1, 2, "num_decode_tokens", "-3 is below 0"),
        ("10,5,15,2\n\n10,,10,0\n", 2, 4, "num_decode_tokens", "empty value"),
        ("10\n", 1, 2, "num_decode_tokens", "no value"),
        ("inf,1,1,1\n", 1, 2, "num_prefill_tokens", "'inf' is not a whole number"),
    ],
    ids=["not-a-number", "fraction", "no-prompt", "negative", "empty-cell", "short-row", "inf"],
)
def test_bad_value_names_file_row_line_and_column(tmp_path, body, row, line, column, what):
    path = write(tmp_path, HEADER + body)
    with pytest.raises(ValueError) as info:
        load_trace(path)
    message = str(info.value)
    assert message.startswith(f"trace {path}, row {row} (line {line}), column {column!r}: ")
    assert what in message


def test_missing_column_is_named_with_the_header(tmp_path):
    path = write(tmp_path, "num_prefill_tokens,tokens\n10,5\n")
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"trace {path} lacks column(s) num_decode_tokens: its header is "
            "num_prefill_tokens,tokens"
        ),
    ):
        load_trace(path)


@pytest.mark.parametrize("text,what", [("", "lacks column(s)"), (HEADER, "has no rows")])
def test_empty_file_and_header_only_are_errors(tmp_path, text, what):
    path = write(tmp_path, text)
    with pytest.raises(ValueError, match=re.escape(what)):
        load_trace(path)


def test_unknown_name_is_file_not_found():
    with pytest.raises(FileNotFoundError, match="neither a packaged trace"):
        load_trace("no-such-trace")


def test_only_one_module_parses_trace_csvs():
    # workload.py once parsed traces by position (numpy.loadtxt) beside traces.py's by-name reader.
    source = workload.__file__
    with open(source) as f:
        text = f.read()
    assert "loadtxt" not in text and "import csv" not in text
    assert workload.load_trace is traces.load_trace
