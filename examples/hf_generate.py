"""transformers generate() with a vattention KV cache, compared with DynamicCache and StaticCache.

A tiny Llama with random weights (built from a config: no download) generates the same tokens with
the three caches; the script prints, per cache, the KV bytes it holds at the end, and the bytes its
``update()`` calls allocate and copy during the decode steps (measured by wrapping each layer's
``update``: a call that returns tensors in fresh storage allocated and filled that storage; a call
that returns the old storage wrote only the new tokens in place).

Run: ``python examples/hf_generate.py [--new-tokens 128] [--batch 4] [--max-seq-len 2048]``.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

from vattention.integrations.transformers import VAttentionCache  # noqa: E402


class UpdateMeter:
    """Wrap every layer's ``update`` of a transformers cache and count bytes allocated/written."""

    def __init__(self, cache: transformers.Cache) -> None:
        self.calls = 0
        self.decode_calls = 0
        self.bytes_allocated = 0  # fresh K/V storage created by update (decode steps)
        self.bytes_written = 0  # bytes stored into the cache (decode steps)
        self.peak_bytes = 0  # KV bytes alive at once, old copies during cat included
        self._last_storage: dict[tuple[int, int], int] = {}  # (layer, K=0/V=1) -> data_ptr
        self._cache = cache
        self._wrapped_layers: set[int] = set()
        self._wrap_existing()

    def _wrap_existing(self) -> None:
        for index, layer in enumerate(self._cache.layers):
            if id(layer) not in self._wrapped_layers:
                self._wrapped_layers.add(id(layer))
                layer.update = self._spy(layer, layer.update, index)

    def _spy(self, layer, update, index: int):
        def wrapped(key_states, value_states, *args, **kwargs):
            before = [t for t in (layer.keys, layer.values) if t is not None and t.numel()]
            keys, values = update(key_states, value_states, *args, **kwargs)
            self.calls += 1
            decode = key_states.shape[-2] == 1
            replaced = 0
            for kind, (cached, new) in enumerate(((keys, key_states), (values, value_states))):
                ptr = cached.untyped_storage().data_ptr()
                # fresh storage while the previous one was still alive: allocated and filled
                fresh = self._last_storage.get((index, kind)) != ptr
                self._last_storage[(index, kind)] = ptr
                if decode:
                    self.bytes_allocated += cached.nbytes if fresh else 0
                    self.bytes_written += cached.nbytes if fresh else new.nbytes
                if fresh and kind < len(before):
                    replaced += before[kind].untyped_storage().nbytes()
            # the replaced tensors were alive until update returned
            self.peak_bytes = max(self.peak_bytes, kv_bytes(self._cache) + replaced)
            self.decode_calls += decode
            return keys, values

        return wrapped


def tiny_llama(layers: int) -> transformers.PreTrainedModel:
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def kv_bytes(cache: transformers.Cache) -> int:
    if isinstance(cache, VAttentionCache):
        return cache.memory_bytes()
    return sum(
        t.untyped_storage().nbytes()
        for layer in cache.layers
        for t in (layer.keys, layer.values)
        if t is not None
    )


def run(model, ids, new_tokens: int, cache) -> tuple[torch.Tensor, UpdateMeter]:
    # DynamicCache() creates its layers lazily on the first update: make them now to wrap them.
    if not cache.layers:
        cache.layers.extend(
            transformers.cache_utils.DynamicLayer() for _ in range(model.config.num_hidden_layers)
        )
        cache.layer_class_to_replicate = None
    meter = UpdateMeter(cache)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        past_key_values=cache,
    )
    return out, meter


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument(
        "--max-seq-len",
        type=int,
        default=2048,
        help="capacity of StaticCache and VAttentionCache, in tokens",
    )
    parser.add_argument(
        "--page-size", default="4KB", help="host pages can be 4KB; CUDA pages are 2MB multiples"
    )
    args = parser.parse_args()

    torch.set_num_threads(1)  # tiny tensors: extra threads only add overhead
    model = tiny_llama(args.layers)
    ids = torch.randint(
        1, 256, (args.batch, args.prompt_len), generator=torch.Generator().manual_seed(1)
    )
    caches = {
        "DynamicCache": transformers.DynamicCache(),
        "StaticCache": transformers.StaticCache(
            config=model.config, max_cache_len=args.max_seq_len
        ),
        "VAttentionCache": VAttentionCache.from_model(
            model, max_batch_size=args.batch, max_seq_len=args.max_seq_len, page_size=args.page_size
        ),
    }
    tokens = args.prompt_len + args.new_tokens - 1
    print(
        f"tiny Llama: {args.layers} layers, 2 KV heads x 16 dims, fp32; batch {args.batch}, "
        f"{args.prompt_len} prompt + {args.new_tokens} new tokens ({tokens} cached), "
        f"capacity {args.max_seq_len} tokens"
    )
    print(
        f"{'cache':<16} {'KV bytes held':>14} {'peak KV bytes':>14} {'alloc+copy/step':>16} "
        f"{'written/step':>13}"
    )
    outputs = {}
    for name, cache in caches.items():
        out, meter = run(model, ids, args.new_tokens, cache)
        outputs[name] = out
        steps = max(meter.decode_calls // args.layers, 1)
        print(
            f"{name:<16} {kv_bytes(cache):>14,} {meter.peak_bytes:>14,} "
            f"{meter.bytes_allocated // steps:>16,} {meter.bytes_written // steps:>13,}"
        )
    same = all(torch.equal(outputs["DynamicCache"], out) for out in outputs.values())
    print("tokens identical across caches:", same)
    caches["VAttentionCache"].close()
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
