"""pytest plugin of the GPU check: one JSON line per test started and finished, written at once.

Loaded with ``-p pytest_log`` (benchmarks/gpu on sys.path) and ``GPU_CHECK_LOG=<file>``. Written
as the run goes, so a run the check stops at its time limit still says what it ran. A line:
``{"kind": "test", "test": node id, "outcome": passed | failed | error | skipped | xfailed |
xpassed, "why": the exception or skip reason, "xfail_reason": the xfail mark's reason,
"seconds": call time, "figures": record_property's pairs}``; ``{"kind": "start", "test": ...}``
as a test starts.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest


def _line(report: pytest.TestReport, outcome: str) -> dict[str, Any]:
    why = ""
    if report.longrepr is not None:
        if isinstance(report.longrepr, tuple):  # a skip: (file, line, "Skipped: reason")
            why = str(report.longrepr[2]).removeprefix("Skipped: ")
        else:
            # The last line of a failure's report names the exception ("E   AssertionError: ...").
            lines = [x for x in str(report.longrepr).splitlines() if x.strip()]
            errors = [x for x in lines if x.startswith("E ")]
            why = (errors[0] if errors else lines[-1] if lines else "").strip()
    return {
        "test": report.nodeid,
        "outcome": outcome,
        "why": why.removeprefix("E").strip()[:300],
        "xfail_reason": str(getattr(report, "wasxfail", ""))[:300],
        "seconds": round(report.duration, 3),
        "figures": {k: v for k, v in report.user_properties},
    }


def _write(line: dict[str, Any]) -> None:
    path = os.environ.get("GPU_CHECK_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")


@pytest.hookimpl
def pytest_runtest_logstart(nodeid: str, location: tuple) -> None:
    # A process that dies inside a test (a crash) leaves this line without a result after it.
    _write({"kind": "start", "test": nodeid})


@pytest.hookimpl
def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    outcome = None
    if report.when == "call":
        if hasattr(report, "wasxfail"):
            outcome = "xpassed" if report.passed else "xfailed"
        else:
            outcome = report.outcome
    elif report.outcome == "skipped" and report.when == "setup":
        outcome = "xfailed" if hasattr(report, "wasxfail") else "skipped"
    elif report.failed:  # setup or teardown failed: an error of the harness or the test
        outcome = "error"
    if outcome is not None:
        _write({"kind": "test", **_line(report, outcome)})
