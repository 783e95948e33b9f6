"""Render a :class:`~vattention.bench.memory.BenchReport`: markdown table, JSON, PNG plots.

Plots need matplotlib (extra ``bench``); without it :func:`write_plots` returns no files and
says why.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Dict, List, Tuple

import numpy as np

from .memory import BenchReport

__all__ = [
    "markdown_table",
    "metrics_json",
    "write_json",
    "write_plots",
    "write_report",
    "format_bytes",
]

logger = logging.getLogger(__name__)


def format_bytes(num_bytes: int) -> str:
    """Binary-unit size string.

    >>> format_bytes(8 << 30), format_bytes(65536), format_bytes(1536)
    ('8GB', '64KB', '1.5KB')
    """
    for unit, shift in (("GB", 30), ("MB", 20), ("KB", 10)):
        if num_bytes >= 1 << shift:
            return f"{num_bytes / (1 << shift):.4g}{unit}"
    return f"{num_bytes}B"


def _full_shape(meta: Dict[str, Any]) -> str:
    """The full-attention layers' shape when it differs (per-layer shapes), else ''."""
    h, d = meta.get("full_kv_heads") or 0, meta.get("full_head_dim") or 0
    if not (h or d):
        return ""
    return (
        f"; the {int(meta['num_layers']) - int(meta['window_layers'])} full-attention layers "
        f"H={h or meta['num_kv_heads']}, D={d or meta['head_dim']}"
    )


def _header(meta: Dict[str, Any]) -> List[str]:
    sampled = " (sampled with replacement)" if meta["sampled_with_replacement"] else ""
    return [
        f"Trace `{meta['trace']}`: {meta['num_requests']} requests{sampled} "
        f"({meta['prefill_tokens']} prefill + {meta['decode_tokens']} decode tokens); "
        f"model {meta['model']} (L={meta['num_layers']}, H={meta['num_kv_heads']}, "
        f"D={meta['head_dim']}{_full_shape(meta)}, {meta['dtype']}: "
        f"{format_bytes(meta['bytes_per_token'])}/token);",
        f"KV budget {format_bytes(meta['budget_bytes'])}, max_seq_len {meta['max_seq_len']}, "
        f"max_batch_size {meta['max_batch_size']}, vattention reclaim "
        f"{meta.get('reclaim', 'deferred')}. paged-16 and the static rows are block "
        "arithmetic; vattention rows are the real allocator (host backend), measured from "
        "`stats()`.",
        "Efficiency = live-token bytes / bytes held for running requests (mean over steps; "
        "peak = at the step with the most live tokens). 'incl. cached pages' divides by all "
        "mapped bytes, counting pages that freed slots keep for reuse (deferred reclamation).",
    ]


def markdown_table(report: BenchReport) -> str:
    """The results as a markdown table, with one header paragraph describing the run."""
    rows = report.metrics
    base = rows.get("static-max", {}).get("concurrency_mean")
    lines = _header(report.meta) + [""]
    lines.append(
        "| allocator | efficiency mean | efficiency peak | incl. cached pages | "
        "concurrency mean | concurrency max | x static-max | preemptions | steps | "
        "maps/step | unmaps/step |"
    )
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, m in rows.items():
        if "error" in m:
            error = m["error"] if m["error"].startswith("skipped") else f"failed: {m['error']}"
            lines.append(f"| {name} | {error} |" + " |" * 9)
            continue
        ratio = f"{m['concurrency_mean'] / base:.2f}x" if base else "-"
        maps = f"{m['map_calls_per_step']:.2f}" if "map_calls_per_step" in m else "-"
        unmaps = f"{m['unmap_calls_per_step']:.2f}" if "unmap_calls_per_step" in m else "-"
        cached = (
            f"{100 * m['efficiency_mapped_mean']:.1f}%" if "efficiency_mapped_mean" in m else "-"
        )
        label = f"{name} ({m['note']})" if m.get("note") else name
        lines.append(
            f"| {label} | {100 * m['efficiency_mean']:.1f}% | "
            f"{100 * m['efficiency_peak']:.1f}% | {cached} | "
            f"{m['concurrency_mean']:.1f} | "
            f"{m['concurrency_max']} | {ratio} | {m['preemptions']} | {m['steps']} | "
            f"{maps} | {unmaps} |"
        )
    return "\n".join(lines) + "\n"


def metrics_json(report: BenchReport) -> Dict[str, Dict[str, Any]]:
    """JSON object keyed by allocator name (the ``--json`` file)."""
    return {name: dict(m) for name, m in report.metrics.items()}


def write_json(report: BenchReport, path: str, *, with_meta: bool = False) -> None:
    """Write the metrics (and, with ``with_meta``, the run description under ``meta``)."""
    data: Dict[str, Any] = metrics_json(report)
    if with_meta:
        data = {"meta": report.meta, "allocators": data}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=False)
        f.write("\n")


def _smoothed(series: np.ndarray, points: int = 1000) -> Tuple[np.ndarray, np.ndarray, int]:
    """Moving average over ``window`` steps, sampled at about ``points`` steps."""
    window = max(1, len(series) // 100)
    kernel = np.ones(window) / window
    smooth = np.convolve(series.astype(float), kernel, mode="valid")
    steps = np.arange(window, len(series) + 1)
    idx = np.unique(np.linspace(0, len(smooth) - 1, min(points, len(smooth))).astype(int))
    return steps[idx], smooth[idx], window


def write_plots(report: BenchReport, prefix: str) -> List[str]:
    """Write ``<prefix>_efficiency.png`` and ``<prefix>_concurrency.png``.

    Returns the paths written; empty (with a logged warning) when matplotlib is missing.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no plots (pip install 'vattention[bench]')")
        return []
    names = [n for n in report.metrics if n in report.results]
    title = (
        f"{report.meta['trace']}, {report.meta['model']}, "
        f"{format_bytes(report.meta['budget_bytes'])} KV budget"
    )
    fig, ax = plt.subplots(figsize=(7.5, 3.8), dpi=100)
    x = np.arange(len(names))
    mean = [100 * report.metrics[n]["efficiency_mean"] for n in names]
    peak = [100 * report.metrics[n]["efficiency_peak"] for n in names]
    cached = [100 * report.metrics[n].get("efficiency_mapped_mean", np.nan) for n in names]
    ax.bar(x - 0.27, mean, width=0.27, label="mean over steps")
    ax.bar(x, peak, width=0.27, label="at peak load")
    ax.bar(x + 0.27, cached, width=0.27, label="mean, incl. pages cached by freed slots")
    ax.set_xticks(
        x, [n.replace("vattention-", "vA-") for n in names], rotation=30, ha="right", fontsize=8
    )
    ax.set_ylabel("KV memory efficiency (%)")
    ax.set_ylim(0, 105)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3)
    fig.tight_layout()
    paths = [f"{prefix}_efficiency.png"]
    fig.savefig(paths[0], bbox_inches="tight")
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7.5, 3.8), dpi=100)
    window = 1
    for name in names:
        steps, conc, window = _smoothed(report.results[name].concurrency)
        ax.plot(steps, conc, label=name, linewidth=1.0)
    ax.set_xlabel("step")
    ax.set_ylabel(
        f"concurrent requests ({window}-step mean)" if window > 1 else "concurrent requests"
    )
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    paths.append(f"{prefix}_concurrency.png")
    fig.savefig(paths[1])
    plt.close(fig)
    return paths


def write_report(report: BenchReport, out_dir: str, *, plots: bool = True) -> List[str]:
    """Write ``memory_<trace>_<model>.{md,json}`` (and PNGs) under ``out_dir``; return paths."""
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.splitext(str(report.meta["trace"]))[0]
    prefix = os.path.join(out_dir, f"memory_{stem}_{report.meta['model']}")
    with open(prefix + ".md", "w") as f:
        f.write(markdown_table(report))
    write_json(report, prefix + ".json", with_meta=True)
    paths = [prefix + ".md", prefix + ".json"]
    if plots:
        paths += write_plots(report, prefix)
    return paths
