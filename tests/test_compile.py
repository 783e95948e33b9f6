"""torch.compile over vattention caches, and the compile-safe append op (vattention.ops).

The compiled decode (tests/support/compile_decode_check.py) runs in a subprocess: a graph that read
unmapped cache memory would die of SIGSEGV there. CUDA-graph capture and replay is a GPU check
(tests/gpu/test_gpu_cuda_graph.py).
"""

from __future__ import annotations

import doctest
import os
import pathlib
import signal
import subprocess
import sys

import pytest
import torch

import vattention
import vattention.ops
from vattention import ConfigError
from vattention.ops import append, append_kv

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_compiled_decode_equals_eager_without_graph_breaks_recompiles_or_unmapped_reads():
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    script = ROOT / "tests" / "support" / "compile_decode_check.py"
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode == -signal.SIGSEGV:
        pytest.fail(
            "the compiled decode read unmapped cache memory (SIGSEGV)\n" + proc.stderr[-3000:]
        )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-5000:]
    for layout in ("layer", "mega"):
        assert (
            f"{layout}: compiled decode equals eager; no graph break, no recompilation"
            in proc.stdout
        )


def test_docstring_examples():
    result = doctest.testmod(vattention.ops, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


@pytest.fixture
def cache():
    cfg = vattention.KVCacheConfig(
        num_layers=1,
        num_kv_heads=2,
        head_dim=64,
        max_batch_size=2,
        max_seq_len=256,
        dtype=torch.float32,
        page_size="64KB",
    )
    with vattention.KVCache(cfg) as c:
        c.step({c.alloc(): 8})
        yield c


def test_append_writes_only_the_given_rows(cache):
    k, v = cache.layer(0)
    before_k, before_v = k[0, :8].clone(), v[0, :8].clone()
    x = torch.randn(2, 2, 64)
    append_kv(k, v, x, -x, torch.tensor([0, 0]), torch.tensor([1, 6]))
    assert torch.equal(k[0, 1], x[0]) and torch.equal(k[0, 6], x[1]) and torch.equal(v[0, 6], -x[1])
    untouched = [p for p in range(8) if p not in (1, 6)]
    assert torch.equal(k[0, untouched], before_k[untouched])
    assert torch.equal(v[0, untouched], before_v[untouched])


@pytest.mark.parametrize(
    "bad, match",
    [
        (
            dict(x=torch.zeros(1, 2, 32)),
            r"new tokens have shape \(1, 2, 32\); this cache takes \(1, 2, 64\)",
        ),
        (
            dict(x=torch.zeros(1, 2, 64, dtype=torch.float16)),
            "dtype torch.float16; the cache holds torch.float32",
        ),
        (
            dict(slots=torch.tensor([[0]])),
            r"slots must be a 1-D int64 or int32 tensor, got shape \(1, 1\)",
        ),
        (dict(positions=torch.tensor([0.0])), "positions must be a 1-D int64 or int32 tensor"),
        (dict(positions=torch.tensor([0, 1])), "positions has 2 entries but slots has 1"),
    ],
)
def test_append_rejects_mismatched_inputs_and_writes_nothing(cache, bad, match):
    k, _ = cache.layer(0)
    before = k[0, :8].clone()
    args = dict(x=torch.ones(1, 2, 64), slots=torch.tensor([0]), positions=torch.tensor([0]))
    args.update(bad)
    with pytest.raises(ConfigError, match=match):
        append(k, args["x"], args["slots"], args["positions"])
    assert torch.equal(k[0, :8], before)


def test_the_stream_lookup_runs_at_run_time_under_torch_compile(monkeypatch):
    """Traced, torch.cuda.current_stream() is a generic torch.Stream without ``cuda_stream``
    (transformers' compiled generate() failed on it on the first GPU run): the lookup leaves the
    graph and runs at every call, giving the stream current then."""
    from vattention import streams

    current = [101]
    lookups = []

    class FakeStream:
        def __init__(self, handle):
            self.cuda_stream = handle

    def torch_stream(dev):
        lookups.append(dev)
        return torch.Stream() if torch.compiler.is_compiling() else FakeStream(current[0])

    monkeypatch.setattr(streams, "_torch_stream", torch_stream)
    compiled = torch.compile(lambda x: x + streams.current_stream("cuda:0"), backend="eager")
    first = int(compiled(torch.zeros((), dtype=torch.long)))
    current[0] = 202  # another stream made current: the next call must see it
    second = int(compiled(torch.zeros((), dtype=torch.long)))
    assert (first, second) == (101, 202) and len(lookups) == 2
