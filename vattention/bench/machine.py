"""What a benchmark says of the machine it ran on: the CPU's model name and feature flags, as
Linux reports them (/proc/cpuinfo), read in the process that measured."""

from __future__ import annotations

import platform
import re


def _cpuinfo_field(name: str) -> str | None:
    """The first value of ``name`` in /proc/cpuinfo (None where there is none, or no file)."""
    try:
        with open("/proc/cpuinfo") as f:
            found = re.search(rf"^{name}\s*:\s*(.+)$", f.read(), re.M)
    except OSError:
        return None
    return found.group(1).strip() if found else None


def cpu_name() -> str:
    """The CPU's model name (Linux), else the platform's processor or machine type."""
    return _cpuinfo_field("model name") or platform.processor() or platform.machine()


def cpu_vendor() -> str:
    """The CPU's vendor as /proc/cpuinfo names it (``GenuineIntel``, ``AuthenticAMD``; ``""`` where
    it names none)."""
    return _cpuinfo_field("vendor_id") or ""


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where it cannot be read)."""
    return set((_cpuinfo_field("flags") or "").split())
