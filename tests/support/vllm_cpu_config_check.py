"""vLLM's own CPU-platform config code with the plugin's hook, on a model whose 128-token block
is a 1 MB page in the mega layout: the layout and block size each engine would run with, without
starting one.

Run in the vLLM venv with ``VATTENTION_VLLM=1`` (``python vllm_cpu_config_check.py DIR``); prints
one JSON document of ``[layout, block size]`` pairs. vLLM loads the plugin through its entry
point, ``EngineArgs`` builds the config and the platform's ``check_and_update_config`` (hooked by
the plugin) sets both, for:

* ``default``: vLLM's defaults (its CPU block size, 128 tokens) with small sizes (4 seqs x 1024
  tokens: the layer layout's mappings fit);
* ``large``: vLLM's default ``max_num_seqs`` and 8192-token rows (they do not);
* ``middle``: 100 seqs of 8192 tokens (they do not in 128-token blocks; they do in 256-token
  ones, which ``auto`` then takes);
* ``middle_given``: that and ``--block-size 128`` on the command line (``mega``);
* ``mega``: ``VATTENTION_VLLM_LAYOUT=mega``;
* ``mega_given``: that and ``--block-size 128`` on the command line;
* ``mega_huge_off``: that and ``VATTENTION_HOST_HUGE_PAGES=0``.
"""

from __future__ import annotations

import json
import os
import sys

from vllm.engine.arg_utils import EngineArgs
from vllm.platforms import current_platform
from vllm.plugins import load_general_plugins

import vattention
from vattention.bench.tiny_models import build_tiny_model
from vattention.integrations.vllm.settings import LAYOUT_KEY

# mega layout: 2 layers x 8 KV heads x 128 x fp32 = 8 KB per token, 1 MB per 128-token block
GEOMETRY = dict(num_layers=2, hidden_size=256, num_heads=8, num_kv_heads=8, head_dim=128)


def layout_and_block_size(model: str, **args) -> list:
    sizes = dict(max_model_len=1024, max_num_seqs=4, kv_cache_memory_bytes=64 << 20)
    config = EngineArgs(model=model, dtype="float32", **{**sizes, **args}).create_engine_config()
    chosen = [config.additional_config[LAYOUT_KEY], config.cache_config.block_size]
    # vLLM may check a config again (VllmConfig.__post_init__ after dataclasses.replace): the
    # hook must keep what it chose, not choose again from the block size it set
    current_platform.check_and_update_config(config)
    again = [config.additional_config[LAYOUT_KEY], config.cache_config.block_size]
    assert again == chosen, (args, chosen, again)
    return chosen


def main(workdir: str) -> None:
    load_general_plugins()
    model = build_tiny_model(
        os.path.join(workdir, "llama-8kb-rows"), "llama", max_positions=8192, **GEOMETRY
    )
    out = {
        "huge_unit": vattention._C.host_huge_unit(),
        "mapping_limit": vattention._C.host_mapping_limit(),
        "default": layout_and_block_size(model),
        "large": layout_and_block_size(model, max_num_seqs=None, max_model_len=8192),
        # 100 x 64 blocks x 2 x 2 = 25600 mappings: layer in 256-token blocks (12800), and
        # a check of the config again keeps it; mega where the user gave 128
        "middle": layout_and_block_size(model, max_num_seqs=100, max_model_len=8192),
        "middle_given": layout_and_block_size(
            model, max_num_seqs=100, max_model_len=8192, block_size=128
        ),
    }
    os.environ["VATTENTION_VLLM_LAYOUT"] = "mega"
    out["mega"] = layout_and_block_size(model)
    out["mega_given"] = layout_and_block_size(model, block_size=128)
    os.environ["VATTENTION_HOST_HUGE_PAGES"] = "0"
    out["mega_huge_off"] = layout_and_block_size(model)
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
