"""A transformers ``Cache`` whose K/V live in a vattention ``KVCache``.

``VAttentionCache`` is a drop-in replacement for ``DynamicCache`` in ``model.generate()``:

* each batch row of the generate call owns one slot of the ``KVCache``;
* ``update()`` maps pages for the new length (one ``KVCache.step`` per forward pass, on the first
  layer that grows) and writes only the new tokens into the slot rows in place -- no
  ``torch.cat`` of the whole cache per step as ``DynamicCache`` does;
* it returns to attention zero-copy views of the *backed prefix* only, ``k[rows, :seq_len]``
  transposed to transformers' ``[batch, heads, seq, head_dim]``.

With ``compileable=True`` transformers compiles the decoding forward, as it does for
``StaticCache``: attention then gets views of the whole *bucket* (the tokens rounded up to
``bucket_tokens``), whose pages :meth:`VAttentionCache.prepare_forward` maps before each forward,
outside the graph (transformers reaches it through ``get_mask_sizes``); the mask it builds for
that length hides the rest, and ``update()`` writes through the compile-safe
:func:`vattention.ops.append_kv` (docs/compile.md). Compiled path tested on transformers 4.57.6,
5.17.0 and 5.23.0, on a CPU.

Why only the prefix (eager): masked SDPA and eager attention read every key position they are given
and mask afterwards. Handing them the whole ``max_seq_len`` row would make them read unmapped
virtual memory (a fault on the host backend, an illegal address on CUDA) and would cost
``O(max_seq_len)`` work per step. Returning the prefix keeps the mask sizes identical to
``DynamicCache``'s (``get_mask_sizes`` reports ``past + query`` keys, offset 0), so the attention
inputs -- and hence the generated tokens -- are the same. The alternative, backing the untouched
space with a shared read-only zero page, would still make every step read ``max_seq_len`` keys; it
is not used.

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
from ..errors import ArgumentTypeError, ConfigError, InvalidSlotError, SequenceTooLongError
from ..ops import append_kv

__all__ = ["VAttentionCache", "VAttentionLayer", "model_kv_shape", "model_windows"]

# transformers layer types this cache can hold; anything else (Mamba/linear attention state,
# chunked attention, ...) is refused by name.
_ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
# compileable=True: views are a multiple of this many tokens long (a 1024 + 256 generation stays
# in one bucket, 1280, the length StaticCache attends over for it).
DEFAULT_BUCKET_TOKENS = 256

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

    ``keys``/``values`` are zero-copy views ``[batch, kv_heads, length, head_dim]`` of this layer's
    K/V rows: the backed prefix (``length`` = tokens cached), or with ``compileable=True`` the
    whole bucket (``length`` = :attr:`VAttentionCache.view_len`, the mask hides the rest). Built
    by :class:`VAttentionCache`; not meant to be made alone.

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
        # Per instance: transformers compiles decoding only for caches whose layers all say so.
        self.is_compileable = owner.compileable
        # This cache's rows of the layer in transformers' order, [batch, heads, max_seq_len,
        # head_dim] (zero-copy), set when the slots are claimed: every update narrows them, so
        # the hot path is two narrow() calls and one fused copy per tensor pair.
        self._k_rows: Optional[torch.Tensor] = None
        self._v_rows: Optional[torch.Tensor] = None
        # compileable: the whole layer tensors (the compile-safe append writes into them), the
        # rows [start, end) of this cache's slots and their indices as a tensor, the shared
        # 0-d tensor holding the write position, the view length. The compiled graph reads only
        # these, so it is specialised on the view length alone (plus the batch rows).
        self._k_all: Optional[torch.Tensor] = None
        self._v_all: Optional[torch.Tensor] = None
        self._row_range = (0, 0)
        self._slot_index: Optional[torch.Tensor] = None
        self._position: Optional[torch.Tensor] = None
        self._view_len = 0
        # Set by every bucketed update (a plain attribute store, which a compiled graph replays
        # after each call): the cache's next prepare_forward() knows a forward has run.
        self.wrote = False

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

        Returns views ``[batch, kv_heads, seq_len + new, head_dim]`` of the backed prefix (with
        ``compileable=True``: ``[..., view_len, ...]``); nothing of the past cache is copied.
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.is_compileable:
            return self._update_bucketed(key_states, value_states)
        n = key_states.shape[-2]
        start, end = self.seq_len, self.seq_len + n
        owner = self._owner
        if end > owner._backed_len:
            owner._ensure_backed(end)
        k_rows, v_rows = self._k_rows, self._v_rows
        assert k_rows is not None and v_rows is not None  # set by _claim_slots
        # One dispatch writes K and V: the per-call cost here is host time on a GPU.
        torch._foreach_copy_(
            [k_rows.narrow(2, start, n), v_rows.narrow(2, start, n)], [key_states, value_states]
        )
        self.seq_len = end
        first = self._start() if self.is_sliding else 0
        self.keys = keys = k_rows.narrow(2, first, end - first)
        self.values = values = v_rows.narrow(2, first, end - first)
        return keys, values

    def _update_bucketed(
        self, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The compileable update: views of the whole bucket, whose pages prepare_forward mapped.

        Compiled: traceable ops only, no call into the ``KVCache``; the new tokens go in at the
        position prepare_forward left in ``_position``, through :func:`vattention.ops.append_kv`
        (a write through a view would make the graph copy the whole virtual tensor). Eager (the
        prefill, or no compile at all): the host knows the position, and the write is the eager
        path's.
        """
        n = key_states.shape[-2]
        if not torch.compiler.is_compiling():
            owner = self._owner
            if self.wrote or not owner._ready or owner._pending != n:
                owner.prepare_forward(n)  # no mask was built for this forward: the hook did not run
            k_rows, v_rows = self._k_rows, self._v_rows
            assert k_rows is not None and v_rows is not None  # set by _claim_slots
            start = owner._len
            torch._foreach_copy_(
                [k_rows.narrow(2, start, n), v_rows.narrow(2, start, n)],
                [key_states, value_states],
            )
            self.wrote = True
            self.keys = keys = k_rows.narrow(2, 0, self._view_len)
            self.values = values = v_rows.narrow(2, 0, self._view_len)
            return keys, values
        batch, heads = key_states.shape[:2]
        position, slot_index = self._position, self._slot_index
        k_all, v_all = self._k_all, self._v_all
        assert position is not None and slot_index is not None  # set by _claim_slots
        assert k_all is not None and v_all is not None
        positions = (position + torch.arange(n, device=position.device)).repeat(batch)
        slots = slot_index.repeat_interleave(n) if n > 1 else slot_index
        keys_new = key_states.transpose(1, 2).reshape(batch * n, heads, key_states.shape[-1])
        values_new = value_states.transpose(1, 2).reshape(batch * n, heads, value_states.shape[-1])
        append_kv(k_all, v_all, keys_new, values_new, slots, positions)
        self.wrote = True
        first, last = self._row_range
        length = self._view_len
        return (
            k_all[first:last, :length].transpose(1, 2),
            v_all[first:last, :length].transpose(1, 2),
        )

    def get_mask_sizes(self, query_length: Union[int, torch.Tensor]) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` for the mask: past + query keys from the first backed one.

        Offset 0 (as DynamicCache) on full-attention layers. On sliding-window layers the pages
        for this forward pass are mapped here, before the mask is built, because mapping them
        also releases the pages before the window: the offset is the first token still backed,
        which :meth:`update` then starts its views at. With ``compileable=True`` this is the
        hook that prepares each forward (:meth:`VAttentionCache.prepare_forward`): the length is
        the bucket, offset 0.
        """
        if isinstance(query_length, torch.Tensor):  # transformers 4.57-5.0 pass cache_position
            query_length = query_length.shape[0]
        if self.is_compileable:
            if torch.compiler.is_compiling():  # prepared before the graph ran
                return self._view_len, 0
            return self._owner.prepare_forward(int(query_length)), 0
        end = self.seq_len + int(query_length)
        start = 0
        if self.is_sliding and self._owner.slots:
            self._owner._ensure_backed(end)
            start = min(self._owner._window_start(self.layer_idx), self.seq_len)
        return end - start, start

    def get_seq_length(self) -> Any:
        """Tokens cached in this layer (under ``torch.compile``, with ``compileable=True``: a 0-d
        tensor, as ``StaticCache`` gives, so that the graph does not specialise on it)."""
        if self.is_compileable:
            if torch.compiler.is_compiling() and self._position is not None:
                return self._position
            return self._owner._tokens()
        return self.seq_len

    def get_max_length(self) -> int:
        """``-1``: like ``DynamicCache``, the mask is sized by the tokens present, not a maximum."""
        return -1

    get_max_cache_shape = get_max_length  # the name transformers <= 5.12 uses

    def reset(self) -> None:
        """Forget the cached tokens (the slot's pages stay with the ``KVCache``)."""
        self.seq_len = 0
        self.keys = self.values = None
        self._k_rows = self._v_rows = self._k_all = self._v_all = None
        self._slot_index = self._position = None
        self._row_range, self._view_len, self.wrote = (0, 0), 0, False
        self.is_initialized = False

    def crop(self, max_length: int) -> None:
        """Keep the first tokens: ``max_length >= 0`` keeps that many, ``< 0`` drops
        ``-max_length``."""
        keep = max_length if max_length >= 0 else self.seq_len + max_length
        self.seq_len = max(0, min(self.seq_len, keep))
        if self.is_initialized and not self.is_compileable:
            assert self._k_rows is not None and self._v_rows is not None
            first = self._start()
            self.keys = self._k_rows.narrow(2, first, self.seq_len - first)
            self.values = self._v_rows.narrow(2, first, self.seq_len - first)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Permute batch rows in place (beam search): copies the backed prefix of each row once."""
        n = self._owner._tokens() if self.is_compileable else self.seq_len
        if n == 0 or self._k_rows is None or self._v_rows is None:
            return
        idx = beam_idx.to(self._k_rows.device)
        a = 0 if self.is_compileable else self._start()  # released window pages: not touched
        for rows in (self._k_rows, self._v_rows):
            prefix = rows.narrow(2, a, n - a)
            prefix.copy_(prefix.index_select(0, idx))

    def offload(self) -> None:  # the KV cache lives in fixed virtual memory: nothing to move
        return None

    def prefetch(self) -> None:
        return None

    def _bind(self, rows: slice, slot_index: Optional[torch.Tensor], position: Any) -> None:
        """Point this layer at the claimed rows (and, compileable, the shared index tensors)."""
        k_all, v_all = self._owner._layer_tensors(self.layer_idx)
        self._k_rows = k_all[rows].transpose(1, 2)
        self._v_rows = v_all[rows].transpose(1, 2)
        if self.is_compileable:
            self._k_all, self._v_all = k_all, v_all
            self._row_range = (rows.start, rows.stop)
            self._slot_index, self._position = slot_index, position

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

    With ``compileable=True`` transformers compiles the decoding forward as it does for
    ``StaticCache`` (on CUDA by default; elsewhere with a ``CompileConfig`` that asks for it).
    Attention then sees views of fixed length, the *bucket*: the tokens rounded up to a multiple
    of ``bucket_tokens``, whose pages are mapped before each forward by
    :meth:`prepare_forward` (transformers calls it through ``get_mask_sizes`` when it builds the
    mask, outside the compiled graph); the mask hides the positions past each row's length. A
    generation compiles once per bucket it reaches (``dynamic=False``), or twice in all with
    transformers' default ``dynamic=None`` (the second compile makes the length symbolic), and
    holds pages for the bucket, never for ``max_seq_len``.

    Parameters
    ----------
    kv_cache : vattention.KVCache
        The cache to store K/V in; its config must match the model (layers, KV heads, head_dim,
        dtype, device).
    owns_cache : bool
        Close ``kv_cache`` in :meth:`close` (``True`` when built by :meth:`from_model`).
    compileable : bool
        Offer transformers' compiled decoding path (bucketed views; see above). The ``KVCache``
        must zero the pages it hands out (``scrub=True``: attention reads masked positions of
        the bucket, which must hold finite values) and must release no window pages within
        ``max_seq_len``.
    bucket_tokens : int
        Bucket granularity in tokens (``compileable=True``): view lengths are multiples of it,
        capped at ``max_seq_len``. Default 256.

    Examples
    --------
    >>> cache = VAttentionCache.from_model(model, max_batch_size=2,
    ...                                    max_seq_len=256)                 # doctest: +SKIP
    >>> model.generate(ids, max_new_tokens=20, past_key_values=cache)      # doctest: +SKIP
    >>> cache.kv_cache.stats()["bytes_mapped"]                             # doctest: +SKIP
    """

    def __init__(
        self,
        kv_cache: KVCache,
        *,
        owns_cache: bool = False,
        compileable: bool = False,
        bucket_tokens: int = DEFAULT_BUCKET_TOKENS,
    ) -> None:
        cfg: KVCacheConfig = kv_cache.config
        if compileable:
            _check_compileable(cfg, bucket_tokens)
        self.kv_cache = kv_cache
        self.config = cfg
        self.compileable = compileable
        self.bucket_tokens = bucket_tokens
        self._owns_cache = owns_cache
        self.slots: list[int] = []
        self._row_slice: Optional[slice] = None
        self._backed_len = 0
        self._starts = [0] * cfg.num_layers  # per layer: first token still backed
        # compileable: tokens of the forwards done, the query length of the forward prepared
        # (None: none), the view length and the pages mapped for it, the write position
        self._len = 0
        self._pending: Optional[int] = None
        self._ready = False  # prepare_forward() mapped and positioned the pending forward
        self._view_len = 0
        self._slot_index: Optional[torch.Tensor] = None
        self._index_key: Any = None
        self._position: Optional[torch.Tensor] = None
        self._position_value = -1
        super().__init__(layers=[VAttentionLayer(self, i) for i in range(cfg.num_layers)])

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
        compileable: bool = False,
        bucket_tokens: int = DEFAULT_BUCKET_TOKENS,
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
        compileable : bool
            transformers' compiled decoding path (see :class:`VAttentionCache`); the ``KVCache``
            is then built with ``scrub=True``. Models whose windows would release pages within
            ``max_seq_len`` are refused (their views could not keep a fixed shape).
        bucket_tokens : int
            View length granularity with ``compileable=True``, in tokens.

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
            scrub=bool(compileable),
        )
        if compileable:
            _check_compileable(cfg, bucket_tokens)
        return cls(
            KVCache(cfg, memory_budget=memory_budget),
            owns_cache=True,
            compileable=compileable,
            bucket_tokens=bucket_tokens,
        )

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
        self._layer_tensors(0)  # a K-only cache is refused before any slot is taken
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
        self._row_slice = rows = slice(slots[0], slots[0] + batch)
        self._backed_len = 0
        self._starts = [0] * self.config.num_layers
        if self.compileable:
            self._len, self._pending, self._view_len, self._ready = 0, None, 0, False
            self._index_tensors(rows, key_states.device)
        for layer in self._vattention_layers():
            layer._bind(rows, self._slot_index, self._position)
            if self.compileable:
                self._mark_static(layer._k_all, layer._v_all)

    def _index_tensors(self, rows: slice, device: torch.device) -> None:
        """The slot indices and the write position the compiled graph reads; kept from one
        generate() call to the next with the same rows, so that the graph compiled for the
        first serves the next ones (a new tensor would fail its guards: a recompile per call)."""
        key = (rows.start, rows.stop, device)
        if self._slot_index is None or self._index_key != key:
            self._index_key = key
            self._slot_index = torch.arange(rows.start, rows.stop, device=device)
            self._position = torch.zeros((), dtype=torch.long, device=device)
            self._mark_static(self._slot_index, self._position)
        self._position_value = -1  # prepare_forward() writes the position

    @staticmethod
    def _mark_static(*tensors: Optional[torch.Tensor]) -> None:
        """Tell torch.compile these tensors never move: CUDA graphs then take them (the cache
        tensors are mutated in the graph) instead of copying them in, which for a cache tensor
        would read every byte of its virtual range."""
        for t in tensors:
            if t is not None:
                torch._dynamo.mark_static_address(t)

    def _ensure_backed(self, seq_len: int) -> None:
        """Map pages so every slot backs ``seq_len`` tokens (one ``step`` per forward pass)."""
        if seq_len > self._backed_len:
            self.kv_cache.step(dict.fromkeys(self.slots, seq_len))
            self._backed_len = seq_len
            if self.config.sliding_window:
                self._starts = [
                    max(self.kv_cache.window_start(s, layer) for s in self.slots)
                    for layer in range(self.config.num_layers)
                ]

    def _window_start(self, layer_idx: int) -> int:
        return self._starts[layer_idx]

    def _layer_tensors(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.kv_cache.layer(layer_idx)
        if v is None:
            raise ConfigError(
                "VAttentionCache stores keys and values: its KVCache needs value_cache=True"
            )
        return k, v

    def _vattention_layers(self) -> list[VAttentionLayer]:
        # Cache types its layers as any transformers layer; ours are all built in __init__.
        return cast("list[VAttentionLayer]", self.layers)

    # -- the compileable path -----------------------------------------------------------------
    @property
    def view_len(self) -> int:
        """``compileable=True``: the length of the views attention gets (the bucket), 0 before
        the first forward."""
        return self._view_len

    def bucket_for(self, tokens: int) -> int:
        """The view length for ``tokens`` tokens: a multiple of ``bucket_tokens`` at or above it,
        capped at ``max_seq_len``.

        Examples
        --------
        >>> cache.bucket_tokens, cache.bucket_for(1025), cache.bucket_for(1280)  # doctest: +SKIP
        (256, 1280, 1280)
        """
        rounded = -(-tokens // self.bucket_tokens) * self.bucket_tokens
        return min(rounded, self.config.max_seq_len)

    def prepare_forward(self, query_length: int) -> int:
        """Make the next forward's ``query_length`` new tokens writable: returns the view length.

        ``compileable=True`` only. Counts the forward that ran since the last call, maps the
        pages of the bucket the new tokens reach (``KVCache.step``, only when the bucket grows)
        and sets the write position. transformers' ``generate()`` calls it through
        ``get_mask_sizes`` before every forward, outside the compiled graph; a loop of your own
        that runs the compiled model calls it before each forward. Calling it again before the
        forward changes nothing. Before the first forward (no slots claimed yet) nothing is
        mapped: the eager prefill maps its own bucket.

        Raises :class:`vattention.SequenceTooLongError` when the tokens would pass
        ``max_seq_len``; nothing changes then.
        """
        if not self.compileable:
            raise ConfigError(
                "prepare_forward() is for a VAttentionCache built with compileable=True"
            )
        done = self._tokens()
        end = done + query_length
        limit = self.config.max_seq_len
        if end > limit:
            raise SequenceTooLongError(
                f"{done} cached + {query_length} new tokens = {end} exceeds max_seq_len={limit}"
            )
        if not self.slots:
            self._pending, self._ready = query_length, False
            return self.bucket_for(end)
        view_len = max(self.bucket_for(end), self._view_len)
        if view_len > self._view_len:
            self.kv_cache.step(dict.fromkeys(self.slots, view_len))
            self._view_len = self._backed_len = view_len
            for layer in self._vattention_layers():
                layer._view_len = view_len
        for layer in self._vattention_layers():
            layer.wrote = False
        self._len, self._pending, self._ready = done, query_length, True
        if done != self._position_value:
            assert self._position is not None  # set with the slots
            self._position.fill_(done)
            self._position_value = done
        return view_len

    def _wrote(self) -> bool:
        return any(layer.wrote for layer in self._vattention_layers())

    def _tokens(self) -> int:
        """compileable: tokens cached, counting a forward that has run since prepare_forward."""
        if self._pending is not None and self._wrote():
            return self._len + self._pending
        return self._len

    # -- whole-cache operations ---------------------------------------------------------------
    def reset(self) -> None:
        """Free the slots (their pages stay mapped for the next call) and forget all tokens."""
        for slot in self.slots:
            self.kv_cache.free(slot)
        self.slots, self._row_slice, self._backed_len = [], None, 0
        self._starts = [0] * self.config.num_layers
        self._len, self._pending, self._view_len, self._ready = 0, None, 0, False
        for layer in self.layers:
            layer.reset()

    def crop(self, max_length: int) -> None:
        """Drop tokens from the end (assisted decoding); the pages stay mapped."""
        if self.compileable:
            done = self._tokens()
            keep = max_length if max_length >= 0 else done + max_length
            self._len, self._pending, self._ready = max(0, min(done, keep)), None, False
            for layer in self._vattention_layers():
                layer.wrote = False
            return
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
            layer.reset()
        if self._owns_cache:
            self.kv_cache.close()

    def __enter__(self) -> VAttentionCache:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _check_compileable(cfg: KVCacheConfig, bucket_tokens: Any) -> None:
    """Refuse what the compileable path cannot serve, naming the value and the limit."""
    if isinstance(bucket_tokens, bool) or not isinstance(bucket_tokens, int):
        raise ArgumentTypeError(
            f"bucket_tokens={bucket_tokens!r} must be an int (tokens), got "
            f"{type(bucket_tokens).__name__}"
        )
    if bucket_tokens < 1:
        raise ConfigError(f"bucket_tokens={bucket_tokens} must be >= 1")
    if not cfg.scrub:
        raise ConfigError(
            "compileable=True: attention reads the masked positions of each bucket, which must "
            "hold finite values (0 x NaN is NaN); build the KVCache with scrub=True"
        )
    short = [w for w in cfg.layer_windows if 0 < w < cfg.max_seq_len]
    if short:
        raise ConfigError(
            f"compileable=True: sliding_window={short[0]} < max_seq_len={cfg.max_seq_len} "
            "releases pages under the views, whose shape a compiled graph keeps fixed; use "
            "compileable=False for this model (or max_seq_len <= its window)"
        )
