"""Small random-weight decoder models written to disk, with a tokenizer built locally.

Tests and the vLLM benchmark need real model directories (``config.json``, safetensors weights,
``tokenizer.json``) that vLLM and transformers load like any checkpoint, without downloading
anything. The tokenizer is a word-level one over ``w0 w1 ...``; prompts are token ids.

``initializer_range`` defaults to 0.1 rather than transformers' 0.02: with 0.02 the top-2 logit
gaps of a random model are ~1e-3, so token-equality tests between attention kernels would flip on
rounding noise.
"""

from __future__ import annotations

import os
from typing import Any, Dict

__all__ = ["FAMILIES", "build_tiny_model"]

# The decoder families the vLLM plugin is tested with: Llama, Qwen2 and Mistral, and with sliding
# windows Mistral (every layer), Gemma 3 (local and global layers alternating: two KV cache
# groups in vLLM) and Qwen2 (every layer; vLLM's Qwen2 asserts that windows are all or nothing).
FAMILIES = ("llama", "qwen2", "mistral", "mistral-window", "gemma3", "qwen2-window")

SPECIAL = ("<unk>", "<s>", "</s>")


def build_tiny_model(
    path: str,
    family: str = "llama",
    *,
    num_layers: int = 2,
    hidden_size: int = 128,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    vocab_size: int = 512,
    max_positions: int = 4096,
    initializer_range: float = 0.1,
    window: int = 64,
    seed: int = 0,
    dtype: str = "float32",
) -> str:
    """Write a random ``family`` model and its tokenizer to ``path``; return ``path``.

    Idempotent: an existing ``config.json`` at ``path`` is kept as it is. ``window``: the sliding
    window, in tokens, of the windowed families. ``dtype``: the torch dtype the weights are saved
    in, also the config's (``config.json`` names it ``dtype``, transformers 5's spelling of
    ``torch_dtype``), which vLLM's default ``dtype="auto"`` serves the model in.

    Examples
    --------
    >>> import tempfile, transformers
    >>> path = build_tiny_model(tempfile.mkdtemp(), "qwen2", num_layers=1)
    >>> transformers.AutoConfig.from_pretrained(path).model_type
    'qwen2'
    """
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    if family not in FAMILIES:
        raise ValueError(f"family={family!r} must be one of {FAMILIES}")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    vocab: Dict[str, int] = {tok: i for i, tok in enumerate(SPECIAL)}
    for i in range(vocab_size - len(SPECIAL)):
        vocab[f"w{i}"] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    common: Dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        initializer_range=initializer_range,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        dtype=dtype,
    )
    config: transformers.PretrainedConfig
    model_cls: type[transformers.PreTrainedModel]
    if family == "llama":
        config = transformers.LlamaConfig(**common)
        model_cls = transformers.LlamaForCausalLM
    elif family in ("qwen2", "qwen2-window"):
        windowed = family == "qwen2-window"
        config = transformers.Qwen2Config(
            **common,
            use_sliding_window=windowed,
            sliding_window=window if windowed else None,
            max_window_layers=0 if windowed else num_layers,
        )
        model_cls = transformers.Qwen2ForCausalLM
    elif family == "gemma3":
        kinds = ("sliding_attention", "full_attention")
        config = transformers.Gemma3TextConfig(
            **common,
            sliding_window=window,
            query_pre_attn_scalar=head_dim,
            layer_types=[kinds[i % 2] for i in range(num_layers)],
        )
        model_cls = transformers.Gemma3ForCausalLM
    else:
        windowed = family == "mistral-window"
        config = transformers.MistralConfig(**common, sliding_window=window if windowed else None)
        model_cls = transformers.MistralForCausalLM
    torch.manual_seed(seed)
    # Each branch above pairs a model class with its own config class; mypy cannot tie the two.
    model = model_cls(config)  # type: ignore[arg-type]
    # Drawn in float32 whatever the dtype (the same draw for every dtype), then cast.
    weights_dtype: torch.dtype = getattr(torch, dtype)
    # transformers' PreTrainedModel.to is wrapped with functools.wraps(torch.nn.Module.to), which
    # types it as the unbound function: mypy takes the dtype for `self`.
    model = model.to(weights_dtype)  # type: ignore[arg-type]
    os.makedirs(path, exist_ok=True)
    fast.save_pretrained(path)
    model.save_pretrained(path)  # config.json last-but-one: its presence marks a complete model
    return path
