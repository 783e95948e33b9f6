"""A transformers ``Cache`` whose K/V live in a vattention ``KVCache``.

``VAttentionCache`` is a drop-in replacement for ``DynamicCache`` in ``model.generate()``:

* each batch row of the generate call owns one slot of the ``KVCache``;
* ``update()`` maps pages for the new length (one ``KVCache.step`` per forward pass, on the first
  layer that grows) and writes only the new tokens into the slot rows in place -- no
  ``torch.cat`` of the whole cache per step as ``DynamicCache`` does;
* it returns to attention zero-copy views of the *backed prefix* only, ``k[rows, :seq_len]``
  transposed to transformers' ``[batch, heads, seq, head_dim]``.

Why only the prefix: masked SDPA and eager attention read every key position they are given and
mask afterwards. Handing them the whole ``max_seq_len`` row would make them read unmapped virtual
memory (a fault on the host backend, an illegal address on CUDA) and would cost ``O(max_seq_len)``
work per step. Returning the prefix keeps the mask sizes identical to ``DynamicCache``'s
(``get_mask_sizes`` reports ``past + query`` keys, offset 0), so the attention inputs -- and hence
the generated tokens -- are the same. The alternative, backing the untouched space with a shared
read-only zero page, would still make every step read ``max_seq_len`` keys; it is not used.

Supported transformers versions: 4.57 to 5.23 (tested: 4.57.6, 5.0.0, 5.12.1, 5.23.0; see
``docs/integrations.md``), which share the layer-based cache API (``CacheLayerMixin``,
``Cache(layers=...)``; ``get_mask_sizes`` takes ``cache_position`` in 4.57-5.0 and a query length
by 5.12; ``get_max_cache_shape`` was renamed ``get_max_length`` after 5.12: both are provided).

Examples
--------
>>> import torch, transformers
>>> from vattention.integrations.transformers import VAttentionCache
>>> cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
>>> model = transformers.LlamaForCausalLM(cfg).eval()
>>> cache = VAttentionCache.from_model(model, max_batch_size=1, max_seq_len=64, page_size="4KB")
>>> out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=5, min_new_tokens=5,
...                      do_sample=False, past_key_values=cache)
>>> cache.get_seq_length()      # 3 prompt + 4 fed-back tokens (the 5th is never fed back)
7
>>> cache.close()
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Optional, Union, cast

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .. import KVCache, KVCacheConfig
from ..errors import ConfigError, InvalidSlotError

__all__ = ["VAttentionCache", "VAttentionLayer", "model_kv_shape", "model_windows"]

# transformers layer types this cache can hold; anything else (Mamba/linear attention state,
# chunked attention, ...) is refused by name.
_ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")

logger = logging.getLogger(__name__)


def model_kv_shape(model_or_config: Any) -> dict:
    """Return ``num_layers``, ``num_kv_heads`` and ``head_dim`` of a decoder-only model.

    Parameters
    ----------
    model_or_config : transformers.PreTrainedModel or transformers.PretrainedConfig
        The model (or its config). Multimodal configs are reduced to their text decoder config.

    Returns
    -------
    dict
        ``{"num_layers": int, "num_kv_heads": int, "head_dim": int}``; for models whose layers
        differ (transformers' heterogeneous configs, ``config.per_layer_config``, e.g. Gemma 4's
        global layers with ``global_head_dim``), ``num_kv_heads``/``head_dim`` are tuples with one
        entry per layer, as :class:`vattention.KVCacheConfig` takes them.

    Examples
    --------
    >>> import transformers
    >>> cfg = transformers.Qwen2Config(hidden_size=64, num_hidden_layers=3,
    ...                                num_attention_heads=4, num_key_value_heads=2)
    >>> model_kv_shape(cfg)
    {'num_layers': 3, 'num_kv_heads': 2, 'head_dim': 16}
    """
    config = _text_config(model_or_config)
    layers = config.num_hidden_layers
    per_layer = (
        getattr(config, "per_layer_config", None)
        if getattr(config, "is_heterogeneous", False)
        else None
    )
    shapes = [_layer_shape(c) for c in per_layer] if per_layer else [_layer_shape(config)] * layers
    if len(shapes) != layers:
        raise ConfigError(
            f"model_type={config.model_type!r} describes {len(shapes)} layers in "
            f"per_layer_config but has num_hidden_layers={layers}"
        )
    heads, dims = (tuple(x) for x in zip(*shapes))
    return {
        "num_layers": layers,
        "num_kv_heads": heads[0] if len(set(heads)) == 1 else heads,
        "head_dim": dims[0] if len(set(dims)) == 1 else dims,
    }


def _layer_shape(config: Any) -> tuple:
    """(KV heads, head dim) of a (layer) config, with transformers' defaults."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return kv_heads, getattr(config, "head_dim", None) or config.hidden_size // heads


def _text_config(model_or_config: Any) -> Any:
    """The decoder text config, after refusing what a dense K/V cache cannot hold."""
    config = getattr(model_or_config, "config", model_or_config)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    model_type = getattr(config, "model_type", type(config).__name__)
    if not hasattr(config, "num_attention_heads") or getattr(config, "is_encoder_decoder", False):
        raise ConfigError(
            f"model_type={model_type!r} has no decoder self-attention K/V cache that "
            "vattention can hold (state-space, recurrent or encoder-decoder models "
            "are not supported)"
        )
    bad = sorted(set(getattr(config, "layer_types", None) or ()) - set(_ATTENTION_LAYER_TYPES))
    if bad:
        raise ConfigError(
            f"model_type={model_type!r} has layer types {bad}; vattention serves "
            f"only {list(_ATTENTION_LAYER_TYPES)} layers"
        )
    if getattr(config, "use_bidirectional_attention", False):
        raise ConfigError(
            f"model_type={model_type!r} uses bidirectional attention "
            "(use_bidirectional_attention=True); vattention serves causal models "
            "only"
        )
    if getattr(config, "num_kv_shared_layers", 0):
        # Layers that reuse another layer's K/V never call the cache: a KVCache tensor per layer
        # would map pages for them that nothing reads.
        raise ConfigError(
            f"model_type={model_type!r} shares K/V between layers "
            f"(num_kv_shared_layers={config.num_kv_shared_layers}); vattention "
            "serves models whose every attention layer keeps its own K/V"
        )
    return config


def model_windows(model_or_config: Any) -> Union[None, int, tuple]:
    """The model's sliding windows, as ``KVCacheConfig(sliding_window=...)`` takes them.

    ``None`` when every layer attends to all tokens; an int when every layer uses the same window
    (Mistral's ``sliding_window``); else one entry per layer, ``None`` on full-attention layers
    (Gemma 2/3 alternating layers, Qwen2 with ``use_sliding_window`` and ``max_window_layers``,
    read from ``config.layer_types``).

    Examples
    --------
    >>> import transformers
    >>> cfg = transformers.Qwen2Config(hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
    ...                                use_sliding_window=True, sliding_window=8,
    ...                                max_window_layers=1)
    >>> model_windows(cfg)
    (None, 8, 8)
    >>> model_windows(transformers.MistralConfig(sliding_window=4096))
    4096
    """
    config = _text_config(model_or_config)
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None:
        return None
    if not layer_types:
        return int(window)
    per_layer = tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
    return per_layer if any(w is not None for w in per_layer) else None


class VAttentionLayer(CacheLayerMixin):
    """One model layer's view of a :class:`VAttentionCache` (K/V stored in the shared ``KVCache``).

    ``keys``/``values`` are zero-copy views ``[batch, kv_heads, seq_len, head_dim]`` of the backed
    prefix of this layer's K/V rows. Built by :class:`VAttentionCache`; not meant to be made alone.

    Examples
    --------
    >>> cache = VAttentionCache(kv)                      # doctest: +SKIP
    >>> cache.layers[0].get_seq_length()                 # doctest: +SKIP
    0
    """

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self, owner: VAttentionCache, layer_idx: int) -> None:
        super().__init__()
        # A proxy, not a reference: no cache <-> layer cycle, so a dropped cache (and the KV
        # tensors it holds) is freed at once instead of at the next garbage collection.
        self._owner = weakref.proxy(owner)
        self.layer_idx = layer_idx
        self.seq_len = 0
        # A sliding-window layer: views start at the first token the KVCache still backs (it
        # released the pages before the window), and the mask is told that offset.
        self.sliding_window = owner.config.layer_windows[layer_idx]
        self.is_sliding = self.sliding_window > 0

    # -- transformers layer API ---------------------------------------------------------------
    def lazy_initialization(
        self, key_states: torch.Tensor, value_states: Optional[torch.Tensor] = None
    ) -> None:
        """Check shapes/dtype against this layer of the ``KVCache`` and claim slots for the batch
        (first layer)."""
        values = key_states if value_states is None else value_states
        self._owner._check_states(self.layer_idx, key_states, values)
        self._owner._claim_slots(key_states)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``key_states``/``value_states`` ``[batch, kv_heads, new, head_dim]`` in place.

        Returns views ``[batch, kv_heads, seq_len + new, head_dim]`` of the backed prefix; nothing
        of the past cache is copied.
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.seq_len, self.seq_len + key_states.shape[-2]
        self._owner._ensure_backed(end)
        k_rows, v_rows = self._owner._rows(self.layer_idx)
        # [B, H, n, D] -> [B, n, H, D]: the write touches only the new token positions.
        k_rows[:, start:end].copy_(key_states.transpose(1, 2))
        v_rows[:, start:end].copy_(value_states.transpose(1, 2))
        self.seq_len = end
        self._refresh_views()
        keys, values = self.keys, self.values
        assert keys is not None and values is not None  # set by _refresh_views (initialized)
        return keys, values

    def get_mask_sizes(self, query_length: Union[int, torch.Tensor]) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` for the mask: past + query keys from the first backed one.

        Offset 0 (as DynamicCache) on full-attention layers. On sliding-window layers the pages
        for this forward pass are mapped here, before the mask is built, because mapping them
        also releases the pages before the window: the offset is the first token still backed,
        which :meth:`update` then starts its views at.
        """
        if isinstance(query_length, torch.Tensor):  # transformers 4.57-5.0 pass cache_position
            query_length = query_length.shape[0]
        end = self.seq_len + int(query_length)
        start = 0
        if self.is_sliding and self._owner.slots:
            self._owner._ensure_backed(end)
            start = min(self._owner._window_start(self.layer_idx), self.seq_len)
        return end - start, start

    def get_seq_length(self) -> int:
        """Tokens cached in this layer."""
        return self.seq_len

    def get_max_length(self) -> int:
        """``-1``: like ``DynamicCache``, the mask is sized by the tokens present, not a maximum."""
        return -1

    get_max_cache_shape = get_max_length  # the name transformers <= 5.12 uses

    def reset(self) -> None:
        """Forget the cached tokens (the slot's pages stay with the ``KVCache``)."""
        self.seq_len = 0
        self.keys = self.values = None
        self.is_initialized = False

    def crop(self, max_length: int) -> None:
        """Keep the first tokens: ``max_length >= 0`` keeps that many, ``< 0`` drops
        ``-max_length``."""
        keep = max_length if max_length >= 0 else self.seq_len + max_length
        self.seq_len = max(0, min(self.seq_len, keep))
        self._refresh_views()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Permute batch rows in place (beam search): copies the backed prefix of each row once."""
        if self.seq_len == 0:
            return
        k_rows, v_rows = self._owner._rows(self.layer_idx)
        idx = beam_idx.to(k_rows.device)
        a, n = self._start(), self.seq_len  # released window pages must not be touched
        k_rows[:, a:n].copy_(k_rows[:, a:n].index_select(0, idx))
        v_rows[:, a:n].copy_(v_rows[:, a:n].index_select(0, idx))

    def offload(self) -> None:  # the KV cache lives in fixed virtual memory: nothing to move
        return None

    def prefetch(self) -> None:
        return None

    def _refresh_views(self) -> None:
        if not self.is_initialized:
            return
        k_rows, v_rows = self._owner._rows(self.layer_idx)
        start = self._start()
        self.keys = k_rows[:, start : self.seq_len].transpose(1, 2)
        self.values = v_rows[:, start : self.seq_len].transpose(1, 2)

    def _start(self) -> int:
        if not self.is_sliding:
            return 0
        return min(self._owner._window_start(self.layer_idx), self.seq_len)


class VAttentionCache(Cache):
    """transformers ``Cache`` backed by a :class:`vattention.KVCache` (no per-step copies).

    Batch row ``b`` of the generate call uses slot ``slots[b]``; slots are claimed on the first
    ``update`` (from the batch size of the key states) and must form a contiguous range so that the
    rows are a zero-copy slice. Physical pages are mapped as the sequence grows
    (``KVCache.step``), so memory follows the tokens generated, not ``max_seq_len``.

    Parameters
    ----------
    kv_cache : vattention.KVCache
        The cache to store K/V in; its config must match the model (layers, KV heads, head_dim,
        dtype, device).
    owns_cache : bool
        Close ``kv_cache`` in :meth:`close` (``True`` when built by :meth:`from_model`).

    Examples
    --------
    >>> cache = VAttentionCache.from_model(model, max_batch_size=2,
    ...                                    max_seq_len=256)                 # doctest: +SKIP
    >>> model.generate(ids, max_new_tokens=20, past_key_values=cache)      # doctest: +SKIP
    >>> cache.kv_cache.stats()["bytes_mapped"]                             # doctest: +SKIP
    """

    def __init__(self, kv_cache: KVCache, *, owns_cache: bool = False) -> None:
        self.kv_cache = kv_cache
        self.config: KVCacheConfig = kv_cache.config
        self._owns_cache = owns_cache
        self.slots: list[int] = []
        self._row_slice: Optional[slice] = None
        self._backed_len = 0
        self._starts = [0] * self.config.num_layers  # per layer: first token still backed
        super().__init__(layers=[VAttentionLayer(self, i) for i in range(self.config.num_layers)])

    @classmethod
    def from_model(
        cls,
        model: Any,
        *,
        max_batch_size: int,
        max_seq_len: int,
        page_size: Union[int, str] = "2MB",
        layout: str = "layer",
        dtype: Optional[torch.dtype] = None,
        device: Optional[str] = None,
        memory_budget: Union[int, str, None] = None,
    ) -> VAttentionCache:
        """Build a cache sized for ``model`` with its own ``KVCache``.

        Sliding windows come from the model config (:func:`model_windows`): Mistral's
        ``sliding_window``, Gemma 2/3/4 alternating local/global layers, Qwen2's
        ``use_sliding_window``/``max_window_layers``. Windowed layers then hold ``O(window)``
        pages however long the generation. Per-layer KV shapes come from it too
        (:func:`model_kv_shape`: Gemma 4's global layers have ``global_head_dim``), each layer's
        tensors shaped for it. Models without a dense causal K/V cache (Mamba, linear/chunked
        attention layers, encoder-decoders, layers that share another layer's K/V) raise
        :class:`ConfigError` naming the model type.

        Parameters
        ----------
        model : transformers.PreTrainedModel
            A decoder-only model (Llama, Qwen2, Mistral, Gemma 2/3, ... families).
        max_batch_size : int
            Largest batch passed to ``generate`` (rows x ``num_return_sequences`` x beams).
        max_seq_len : int
            Largest prompt + generated length, in tokens (virtual only: costs no memory).
        page_size : int or str
            Physical page size in bytes or as ``"4KB"``/``"2MB"`` (host: a multiple of the OS page;
            CUDA: a multiple of 2 MB).
        layout : {"layer", "mega"}
            vattention layout (see :class:`vattention.KVCacheConfig`); models mixing window and
            full-attention layers need ``"layer"``.
        dtype, device : optional
            Default to the model's parameter dtype and device.
        memory_budget : int or str, optional
            Cap on physical bytes of pages.

        Returns
        -------
        VAttentionCache

        Examples
        --------
        >>> cache = VAttentionCache.from_model(model, max_batch_size=4, max_seq_len=4096,
        ...                                    page_size="64KB")           # doctest: +SKIP
        """
        param = next(model.parameters())
        cfg = KVCacheConfig(
            **model_kv_shape(model),
            max_batch_size=max_batch_size,
            max_seq_len=max_seq_len,
            dtype=dtype or param.dtype,
            device=device or str(param.device),
            page_size=page_size,
            layout=layout,
            sliding_window=model_windows(model),
        )
        return cls(KVCache(cfg, memory_budget=memory_budget), owns_cache=True)

    # -- slot management ----------------------------------------------------------------------
    def _check_states(
        self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> None:
        cfg = self.config
        _, heads, _, head_dim = key_states.shape
        want = (cfg.layer_kv_heads[layer_idx], cfg.layer_head_dims[layer_idx])
        if (heads, head_dim) != want or tuple(value_states.shape[1::2]) != want:
            raise ConfigError(
                f"key/value states of layer {layer_idx} have kv_heads={heads}, "
                f"head_dim={head_dim}; the KVCache was configured with num_kv_heads={want[0]}, "
                f"head_dim={want[1]} there"
            )
        if key_states.dtype != cfg.dtype:
            raise ConfigError(
                f"key states are {key_states.dtype}; the KVCache holds {cfg.dtype} "
                "(build it with dtype=model.dtype)"
            )

    def _claim_slots(self, key_states: torch.Tensor) -> None:
        cfg = self.config
        batch = key_states.shape[0]
        if self.slots:
            if batch != len(self.slots):
                raise ConfigError(
                    f"batch size changed from {len(self.slots)} to {batch}; call "
                    "cache.reset() before a generate() call with another batch"
                )
            return
        if batch > cfg.max_batch_size:
            raise ConfigError(f"batch size {batch} exceeds max_batch_size={cfg.max_batch_size}")
        slots = sorted(self.kv_cache.alloc() for _ in range(batch))
        if slots != list(range(slots[0], slots[0] + batch)):
            for slot in slots:
                self.kv_cache.free(slot)
            raise InvalidSlotError(
                f"free slots {slots} are not contiguous, so batch rows cannot be a zero-copy "
                "slice; "
                "use a KVCache whose other slots are free (or max_batch_size equal to the batch)"
            )
        self.slots = slots
        self._row_slice = slice(slots[0], slots[0] + batch)
        self._backed_len = 0
        self._starts = [0] * self.config.num_layers

    def _ensure_backed(self, seq_len: int) -> None:
        """Map pages so every slot backs ``seq_len`` tokens (one ``step`` per forward pass)."""
        if seq_len > self._backed_len:
            self.kv_cache.step({slot: seq_len for slot in self.slots})
            self._backed_len = seq_len
            if self.config.sliding_window:
                self._starts = [
                    max(self.kv_cache.window_start(s, layer) for s in self.slots)
                    for layer in range(self.config.num_layers)
                ]

    def _window_start(self, layer_idx: int) -> int:
        return self._starts[layer_idx]

    def _rows(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.kv_cache.layer(layer_idx)
        if v is None:
            raise ConfigError(
                "VAttentionCache stores keys and values: its KVCache needs value_cache=True"
            )
        return k[self._row_slice], v[self._row_slice]

    def _vattention_layers(self) -> list[VAttentionLayer]:
        # Cache types its layers as any transformers layer; ours are all built in __init__.
        return cast("list[VAttentionLayer]", self.layers)

    # -- whole-cache operations ---------------------------------------------------------------
    def reset(self) -> None:
        """Free the slots (their pages stay mapped for the next call) and forget all tokens."""
        for slot in self.slots:
            self.kv_cache.free(slot)
        self.slots, self._row_slice, self._backed_len = [], None, 0
        self._starts = [0] * self.config.num_layers
        for layer in self.layers:
            layer.reset()

    def crop(self, max_length: int) -> None:
        """Drop tokens from the end (assisted decoding); the pages stay mapped."""
        for layer in self._vattention_layers():
            layer.crop(max_length)

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError(
            "VAttentionCache cannot change its batch size after prefill; "
            "expand the inputs before generate() instead"
        )

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("VAttentionCache cannot change its batch size after prefill")

    @property
    def batch_size(self) -> int:
        """Batch rows in use, or ``-1`` before the first update."""
        return len(self.slots) if self.slots else -1

    def memory_bytes(self) -> int:
        """Physical bytes of pages mapped by the ``KVCache`` (``stats()["bytes_mapped"]``)."""
        return int(self.kv_cache.stats()["bytes_mapped"])

    def close(self) -> None:
        """Free the slots; close the ``KVCache`` too when this cache created it."""
        if self.slots and not self.kv_cache.closed:
            self.reset()
        for layer in self._vattention_layers():
            layer.keys = layer.values = None
        if self._owns_cache:
            self.kv_cache.close()

    def __enter__(self) -> VAttentionCache:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
