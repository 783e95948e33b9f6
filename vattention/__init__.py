"""vattention: KV caches contiguous in virtual memory, backed by physical pages mapped on demand.

Unmodified attention kernels (FlashAttention's ``flash_attn_with_kvcache``, torch SDPA, any kernel
taking a dense ``[batch, seq, heads, head_dim]`` cache) read the tensors directly, while physical
memory grows with the tokens really held.

>>> import torch, vattention
>>> cfg = vattention.KVCacheConfig(num_layers=2, num_kv_heads=2, head_dim=64, max_batch_size=2,
...                                max_seq_len=512, dtype=torch.float16, page_size="64KB")
>>> cache = vattention.KVCache(cfg)
>>> cache.close()
"""

import importlib.util as _importlib_util
import os as _os

# Run from a clone's root, Python imports the source folder, which has no compiled core unless it
# was built in place; the import below would then fail deep inside, blaming a circular import.
if _importlib_util.find_spec(__name__ + "._C") is None:
    raise ImportError(
        f"vattention's compiled core (the extension module vattention._C) is not in "
        f"{_os.path.dirname(_os.path.abspath(__file__))}: that folder holds vattention's sources "
        "without a build, and Python imports it because it is the current directory or on "
        "sys.path. Build the core there (`make build`, or `pip install --no-build-isolation -e .` "
        "in the clone), or run from another directory to use the vattention you installed."
    )

from . import ops  # compile-safe append ops (torch.library custom ops: vattention::append)
from .cache import Capacity, KVCache
from .config import KVCacheConfig, parse_size
from .errors import (
    ArgumentTypeError,
    BackendUnavailableError,
    CacheClosedError,
    ConfigError,
    DriverError,
    InvalidSlotError,
    OutOfPagesError,
    SequenceTooLongError,
    SwapSpaceError,
    UnmappedReadError,
    VAttentionError,
)

__version__ = "0.1.0"

__all__ = [
    "KVCache",
    "KVCacheConfig",
    "Capacity",
    "parse_size",
    "VAttentionError",
    "ConfigError",
    "InvalidSlotError",
    "SequenceTooLongError",
    "OutOfPagesError",
    "DriverError",
    "BackendUnavailableError",
    "CacheClosedError",
    "SwapSpaceError",
    "ArgumentTypeError",
    "UnmappedReadError",
    "ops",
    "__version__",
]
