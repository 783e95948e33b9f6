"""Tooling around the library: benchmarks, the demo, request traces.

``python -m vattention bench memory|vllm`` (:mod:`.cli`), ``python -m vattention demo``
(:mod:`.demo`), the one trace reader (:mod:`.traces`) and the packaged trace samples
(``data/``), the progress display (:mod:`.progress`). The library (the modules at the top of
``vattention``) never imports this package.

The memory benchmark drives the real allocator on the host backend through a
continuous-batching simulation and compares it with static and paged allocation on the same
request sequence. Importing this package needs only NumPy; the vattention rows need the built
core; plots need matplotlib and the progress bar tqdm (optional extra ``bench``).
"""

from .memory import BenchReport, run_memory_benchmark, simulate, summarize
from .workload import MODELS, ModelShape, Workload, load_workload

__all__ = [
    "BenchReport",
    "run_memory_benchmark",
    "simulate",
    "summarize",
    "MODELS",
    "ModelShape",
    "Workload",
    "load_workload",
]
