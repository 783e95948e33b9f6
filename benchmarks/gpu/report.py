"""Markdown tables and the PNG plot of the GPU benchmarks (matplotlib if installed, else a plain
bar chart written with zlib so the PNG always exists)."""

from __future__ import annotations

import struct
import zlib


def markdown_table(rows: list[dict]) -> str:
    if not rows:
        return "_no rows_\n"
    cols = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def write_png(path: str, series: dict[str, list[tuple[str, float]]]) -> str:
    """One panel per series of (label, value) bars. Returns what drew it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _bars_png(path, [v for s in series.values() for _, v in s])
        return "plain bars (install matplotlib for labelled plots)"
    fig, axes = plt.subplots(len(series), 1, figsize=(12, 3.2 * max(1, len(series))), squeeze=False)
    for ax, (title, bars) in zip(axes[:, 0], series.items()):
        ax.bar(range(len(bars)), [v for _, v in bars])
        ax.set_xticks(range(len(bars)), [lbl for lbl, _ in bars], rotation=60, fontsize=6)
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return "matplotlib"


def _bars_png(path: str, values: list[float], width: int = 800, height: int = 300) -> None:
    top = max(values, default=1.0) or 1.0
    n = max(1, len(values))
    rows = []
    for y in range(height):
        row = bytearray([0])  # filter type 0
        level = (height - y) / height * top
        for x in range(width):
            i = x * n // width
            row.append(40 if i < len(values) and values[i] >= level else 255)
        rows.append(bytes(row))
    raw = zlib.compress(b"".join(rows))

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    with open(path, "wb") as f:
        header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
        f.write(
            b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", header)
            + chunk(b"IDAT", raw)
            + chunk(b"IEND", b"")
        )
