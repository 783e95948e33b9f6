"""Touching unbacked cache memory on the host backend dies with a diagnostic.

Each case runs in a child interpreter (it must die). The child is killed by the signal as before
(non-zero status), but first stderr names the cache, tensor, slot and token, and what to do.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SETUP = """
import ctypes, torch, vattention
cfg = vattention.KVCacheConfig(num_layers=2, num_kv_heads={heads}, head_dim=64, max_batch_size=4,
                               max_seq_len=8192, dtype=torch.float16, page_size="64KB",
                               layout={layout!r})
cache = vattention.KVCache(cfg)
cache.alloc()
slot = cache.alloc()          # slot 1
cache.step({{slot: 100}})
k, v = cache.layer(1)
"""


def _run(layout, action, heads=2):
    code = (
        textwrap.dedent(SETUP.format(layout=layout, heads=heads))
        + textwrap.dedent(action)
        + "\nprint('survived')\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("PYTHONFAULTHANDLER", None)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )


@pytest.mark.parametrize("layout", ["layer", "mega"])
def test_reading_beyond_the_mapped_length_names_slot_and_token(layout):
    proc = _run(layout, "float(v[slot, 5000, 1, 3])")
    assert proc.returncode != 0 and "survived" not in proc.stdout
    assert "vattention: fatal memory access to KV cache #" in proc.stderr, proc.stderr
    assert "V of layer 1, slot 1, token 5000." in proc.stderr, proc.stderr
    assert "cache.mapped_tokens(1)" in proc.stderr and "cache.step({1: length})" in proc.stderr


def test_per_layer_shapes_name_the_position_in_each_layers_own_rows():
    # Layer 1 has 4x layer 0's KV heads: its rows are 4x as long, and the handler must use them.
    proc = _run("layer", "float(v[2, 3000, 7, 3])", heads=(2, 8))
    assert proc.returncode != 0 and "survived" not in proc.stdout
    assert "V of layer 1, slot 2, token 3000." in proc.stderr, proc.stderr


def test_printing_a_whole_layer_tensor_names_the_first_unbacked_position():
    proc = _run("layer", "print(k)")
    assert proc.returncode != 0 and "survived" not in proc.stdout
    assert "vattention: fatal memory access to KV cache #" in proc.stderr, proc.stderr
    assert "K of layer 1, slot " in proc.stderr and "never read a whole row" in proc.stderr


def test_a_tensor_used_after_close_says_the_cache_is_closed():
    proc = _run("layer", "cache.close()\nfloat(k[slot, 0, 0, 0])")
    assert proc.returncode != 0 and "survived" not in proc.stdout
    assert "K of layer 1, slot 1, token 0." in proc.stderr, proc.stderr
    assert "the cache is closed" in proc.stderr


def test_other_segfaults_are_left_to_the_previous_handler():
    proc = _run("layer", "ctypes.string_at(8)")
    assert proc.returncode != 0 and "survived" not in proc.stdout
    assert "vattention:" not in proc.stderr, proc.stderr


def test_backed_positions_are_untouched_by_the_handler():
    proc = _run("layer", "k[slot, :100] = 1.0\nassert float(k[slot, :100].sum()) == 100 * 2 * 64")
    assert proc.returncode == 0 and "survived" in proc.stdout, proc.stderr
