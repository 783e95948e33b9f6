"""Named model shapes for ``bench vllm --model``: real architectures with random weights.

A preset is a real checkpoint's architecture as its ``config.json`` gives it: the layer count,
hidden and intermediate sizes, attention heads, KV heads, head size, rope theta (and scaling),
norm epsilon, q/k/v biases and tied embeddings, in the checkpoint's dtype (bfloat16). Attention,
the MLP and the KV cache are the real model's size. What is not real: the weights are random
(:func:`~vattention.bench.tiny_models.build_tiny_model`'s initializer), and the vocabulary is the
tiny models' 512 words instead of the checkpoint's 128,256 or 151,936, so that the tokenizer and
the embedding stay small. With the real vocabulary the output layer would be about a fifth
(Llama-3.2-1B: 263M of 1.24B weights) to over a quarter (Qwen2.5-0.5B: 136M of 494M) of a decode
step's matmul work; here it is negligible, so a step spends a larger share in attention and the
MLP than the real model's would. The shapes are the checkpoints' published ``config.json``.

``gqa4-bf16`` is not a released model: a Llama of 8 layers, hidden 1024, 16 heads / 4 KV heads
x 64 in bfloat16, the shape of an earlier measurement, kept so that old and new figures compare.

:func:`preset_from_config` reads the same fields from any Llama, Qwen2 or Mistral checkpoint's
``config.json``, so that ``bench vllm --model PATH`` measures the shape a user serves.

>>> p = PRESETS["qwen2.5-0.5b"]
>>> p.architecture, p.num_layers, p.num_heads, p.num_kv_heads, p.head_dim, p.gqa_group
('Qwen2ForCausalLM', 24, 14, 2, 64, 7)
>>> p.qkv_bias, p.tie_word_embeddings, p.dtype
(True, True, 'bfloat16')
>>> p.with_layers(2).shape().split(", ")[:3]
['Qwen2ForCausalLM', '2 of its 24 layers', 'hidden 896']
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Dict, List, Mapping, Optional

from .tiny_models import DTYPES

__all__ = [
    "CONFIG_FAMILIES",
    "PRESETS",
    "VOCAB_SIZE",
    "ModelPreset",
    "get_preset",
    "preset_from_config",
]

# The tiny models' vocabulary (build_tiny_model's default; bench vllm draws token ids below it).
VOCAB_SIZE = 512


@dataclasses.dataclass(frozen=True)
class ModelPreset:
    """One model shape to build with random weights (see the module docstring).

    ``family``: :func:`~vattention.bench.tiny_models.build_tiny_model`'s. ``source``: the
    checkpoint whose ``config.json`` the shape is from (None: a made-up shape). ``real_vocab_size``:
    that checkpoint's vocabulary, which the preset scales to :data:`VOCAB_SIZE`.
    ``max_positions``: the checkpoint's ``max_position_embeddings`` (None: as many as the run needs,
    at least 4096, like the tiny models). ``full_layers``: the preset's own layer count when
    :meth:`with_layers` cut it. None in a rope or norm field: the config class's default.
    """

    name: str
    family: str
    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    rope_theta: Optional[float] = None
    rope_scaling: Optional[Mapping[str, Any]] = dataclasses.field(default=None, hash=False)
    rms_norm_eps: Optional[float] = None
    max_positions: Optional[int] = None
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    source: Optional[str] = None
    real_vocab_size: Optional[int] = None
    full_layers: Optional[int] = None

    @property
    def gqa_group(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def qkv_bias(self) -> bool:
        """Whether q, k and v have biases: Llama's flag, always in Qwen2."""
        return self.attention_bias or self.family.startswith("qwen2")

    def with_layers(self, num_layers: int) -> ModelPreset:
        """The same shape with ``num_layers`` layers (quick checks; the widths stay real)."""
        if not 1 <= num_layers <= (self.full_layers or self.num_layers):
            raise ValueError(
                f"num_layers={num_layers}: {self.name} has 1 to "
                f"{self.full_layers or self.num_layers} layers"
            )
        return dataclasses.replace(
            self, num_layers=num_layers, full_layers=self.full_layers or self.num_layers
        )

    def shape(self) -> str:
        """The architecture in one line (the benchmark's header, ``--help``)."""
        layers = (
            f"{self.num_layers} of its {self.full_layers} layers"
            if self.full_layers not in (None, self.num_layers)
            else f"{self.num_layers} layers"
        )
        parts = [
            self.architecture,
            layers,
            f"hidden {self.hidden_size}",
            f"intermediate {self.intermediate_size}",
            f"{self.num_heads} heads / {self.num_kv_heads} KV heads x {self.head_dim} "
            f"(GQA group {self.gqa_group})",
        ]
        if self.qkv_bias:
            parts.append("qkv bias")
        if self.tie_word_embeddings:
            parts.append("tied embeddings")
        if self.rope_theta is not None:
            scaling = self.rope_scaling.get("rope_type") if self.rope_scaling else None
            parts.append(
                f"rope theta {self.rope_theta:.0f}" + (f" ({scaling} scaling)" if scaling else "")
            )
        return ", ".join(parts + [self.dtype])

    def provenance(self) -> str:
        """What is real and what is not, in one clause."""
        vocab = f"vocabulary scaled to {VOCAB_SIZE}"
        if self.real_vocab_size:
            vocab += f" (real: {self.real_vocab_size})"
        source = f"the shape of {self.source}; " if self.source else ""
        return f"{source}random weights, {vocab}"

    def summary(self) -> Dict[str, Any]:
        """The shape as the benchmark's JSON records it."""
        return {
            **{k: v for k, v in dataclasses.asdict(self).items() if k != "rope_scaling"},
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "gqa_group": self.gqa_group,
            "qkv_bias": self.qkv_bias,
            "vocab_size": VOCAB_SIZE,
            "vocab_scaled": True,
            "weights": "random",
        }

    def build(self, path: str, max_positions: int = 4096, seed: int = 0) -> str:
        """Write the model to ``path`` (kept if already there) and return ``path``;
        ``max_positions`` applies where the preset has none of its own."""
        from .tiny_models import build_tiny_model

        return build_tiny_model(
            path,
            self.family,
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            vocab_size=VOCAB_SIZE,
            max_positions=self.max_positions or max_positions,
            dtype=self.dtype,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            rms_norm_eps=self.rms_norm_eps,
            attention_bias=self.attention_bias,
            tie_word_embeddings=self.tie_word_embeddings,
            seed=seed,
        )

    def expected_config(self) -> Dict[str, Any]:
        """The ``config.json`` fields a model built from this preset has (those it sets)."""
        expected: Dict[str, Any] = {
            "architectures": [self.architecture],
            "num_hidden_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "tie_word_embeddings": self.tie_word_embeddings,
            "vocab_size": VOCAB_SIZE,
        }
        optional = {
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_positions,
        }
        expected.update({k: v for k, v in optional.items() if v is not None})
        if self.family == "llama":
            expected["attention_bias"] = self.attention_bias
        return expected

    def mismatches(self, path: str) -> List[str]:
        """How the model at ``path`` differs from this preset: ``field: found X, expected Y``
        for each field of :meth:`expected_config` (empty when it is this preset's model)."""
        found = read_config(path)
        return [
            f"{k}: found {found.get(k)!r}, expected {v!r}"
            for k, v in self.expected_config().items()
            if found.get(k) != v
        ]


def config_path(path: str) -> str:
    """The ``config.json`` that ``path`` names: the file itself, or the one in that folder."""
    return path if os.path.isfile(path) else os.path.join(path, "config.json")


def read_config(path: str) -> Dict[str, Any]:
    """:func:`config_path`'s file as a dict, with ``rope_theta`` and ``dtype`` where
    transformers 5 and 4 each put them (in ``rope_parameters``; ``torch_dtype``)."""
    with open(config_path(path)) as f:
        config: Dict[str, Any] = json.load(f)
    if not isinstance(config, dict):
        raise ValueError("not a JSON object")
    if config.get("rope_theta") is None:
        config["rope_theta"] = (config.get("rope_parameters") or {}).get("rope_theta")
    config["dtype"] = config.get("dtype") or config.get("torch_dtype")
    return config


# meta-llama/Llama-3.2-1B's config.json; its rope_scaling block as it is there.
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

PRESETS: Dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset(
            name="llama-3.2-1b",
            family="llama",
            architecture="LlamaForCausalLM",
            num_layers=16,
            hidden_size=2048,
            intermediate_size=8192,
            num_heads=32,
            num_kv_heads=8,
            head_dim=64,
            dtype="bfloat16",
            rope_theta=500000.0,
            rope_scaling=_LLAMA3_ROPE,
            rms_norm_eps=1e-5,
            max_positions=131072,
            tie_word_embeddings=True,
            source="meta-llama/Llama-3.2-1B",
            real_vocab_size=128256,
        ),
        # Qwen/Qwen2.5-0.5B's config.json. Its sliding_window (32768) is left out: the checkpoint
        # has use_sliding_window false, so every layer attends to the whole row either way.
        ModelPreset(
            name="qwen2.5-0.5b",
            family="qwen2",
            architecture="Qwen2ForCausalLM",
            num_layers=24,
            hidden_size=896,
            intermediate_size=4864,
            num_heads=14,
            num_kv_heads=2,
            head_dim=64,
            dtype="bfloat16",
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            max_positions=32768,
            tie_word_embeddings=True,
            source="Qwen/Qwen2.5-0.5B",
            real_vocab_size=151936,
        ),
        # Not a released model: an earlier measurement's GQA-4 bf16 Llama; 8 layers and an
        # intermediate size of 2.75x hidden (Llama-2's ratio) complete the shape.
        ModelPreset(
            name="gqa4-bf16",
            family="llama",
            architecture="LlamaForCausalLM",
            num_layers=8,
            hidden_size=1024,
            intermediate_size=2816,
            num_heads=16,
            num_kv_heads=4,
            head_dim=64,
            dtype="bfloat16",
        ),
    )
}


def get_preset(name: str) -> ModelPreset:
    """The preset called ``name``; ``ValueError`` naming the presets if there is none.

    >>> get_preset("gqa4-bf16").gqa_group
    4
    >>> get_preset("llama-7b")
    Traceback (most recent call last):
    ...
    ValueError: model preset 'llama-7b' is not one of ('llama-3.2-1b', 'qwen2.5-0.5b', 'gqa4-bf16')
    """
    if name not in PRESETS:
        raise ValueError(f"model preset {name!r} is not one of {tuple(PRESETS)}")
    return PRESETS[name]


# A checkpoint's architecture -> the family build_tiny_model builds it as: the decoders whose whole
# shape a preset's fields hold (full attention in every layer).
CONFIG_FAMILIES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
}


def preset_from_config(path: str) -> ModelPreset:
    """The shape of the checkpoint whose ``config.json`` is ``path`` (the file, or the folder
    holding it), as a preset: its architecture, layers, widths, heads, KV heads, head size, rope,
    norm epsilon, biases, tied embeddings, positions and dtype (bfloat16 where it names none);
    the weights random and the vocabulary scaled, as for every preset. ``ValueError`` naming the
    field and its value where the shape is not one a preset can hold (another architecture, a
    sliding window, MLP biases, heads that KV heads do not divide).

    >>> import json, tempfile
    >>> folder = tempfile.mkdtemp()
    >>> with open(f"{folder}/config.json", "w") as f:
    ...     json.dump({"architectures": ["MistralForCausalLM"], "_name_or_path": "org/My-7B",
    ...                "num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336,
    ...                "num_attention_heads": 32, "num_key_value_heads": 8,
    ...                "sliding_window": None, "torch_dtype": "bfloat16", "vocab_size": 32768}, f)
    >>> p = preset_from_config(folder)
    >>> p.name, p.family, p.head_dim, p.gqa_group, p.real_vocab_size
    ('My-7B', 'mistral', 128, 4, 32768)
    """
    where = f"config.json at {path}"
    try:
        config = read_config(path)
    except OSError as e:
        raise ValueError(f"{where}: cannot be read ({e.strerror or e})") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e})") from e
    except ValueError as e:  # read_config's: JSON, but not an object
        raise ValueError(f"{where}: {e}") from e

    architecture = (config.get("architectures") or [None])[0]
    if architecture not in CONFIG_FAMILIES:
        raise ValueError(
            f"{where}: architectures={config.get('architectures')!r}; a shape is read from "
            f"one of {tuple(CONFIG_FAMILIES)}"
        )
    family = CONFIG_FAMILIES[architecture]

    def count(key: str, default: Optional[int] = None) -> int:
        value = config.get(key)
        value = default if value is None else value
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}: {key}={value!r} must be a positive integer")
        return value

    layers, hidden = count("num_hidden_layers"), count("hidden_size")
    heads = count("num_attention_heads")
    kv_heads = count("num_key_value_heads", heads)
    if heads % kv_heads:
        raise ValueError(
            f"{where}: num_attention_heads={heads} is not a multiple of "
            f"num_key_value_heads={kv_heads}"
        )
    if config.get("head_dim") is None and hidden % heads:
        raise ValueError(
            f"{where}: no head_dim, and hidden_size={hidden} is not a multiple of "
            f"num_attention_heads={heads}"
        )
    head_dim = count("head_dim", hidden // heads)
    dtype = config.get("dtype") or "bfloat16"
    if dtype not in DTYPES:
        raise ValueError(f"{where}: dtype={dtype!r} must be one of {DTYPES}")
    windowed = family == "mistral" or (family == "qwen2" and config.get("use_sliding_window"))
    window = config.get("sliding_window") if windowed else None
    if window is not None:
        raise ValueError(
            f"{where}: sliding_window={window!r}; a preset's layers attend to the whole row "
            "(the vLLM plugin serves windows, bench vllm's model builder does not)"
        )
    if config.get("mlp_bias"):
        raise ValueError(f"{where}: mlp_bias=True; a preset's MLP has no biases")
    if family == "mistral" and config.get("attention_bias"):
        raise ValueError(f"{where}: attention_bias=True; Mistral has no such option")

    rope_scaling = config.get("rope_scaling")
    rope = config.get("rope_parameters")
    if rope_scaling is None and isinstance(rope, dict):  # transformers 5: theta and scaling in one
        if rope.get("rope_type") not in (None, "default"):
            rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    folder = os.path.dirname(os.path.abspath(config_path(path)))
    source = str(config.get("_name_or_path") or folder)
    base = os.path.basename(source.rstrip("/"))
    name = "".join(c if c.isalnum() or c in "._-" else "-" for c in base) or "config"
    vocab = config.get("vocab_size")
    return ModelPreset(
        name=name,
        family=family,
        architecture=architecture,
        num_layers=layers,
        hidden_size=hidden,
        intermediate_size=count("intermediate_size"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        rope_theta=config.get("rope_theta"),
        rope_scaling=rope_scaling,
        rms_norm_eps=config.get("rms_norm_eps"),
        max_positions=config.get("max_position_embeddings"),
        attention_bias=bool(config.get("attention_bias", False)) and family == "llama",
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        source=source,
        real_vocab_size=vocab if isinstance(vocab, int) else None,
    )
