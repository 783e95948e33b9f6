"""``bench vllm``'s model presets (vattention/bench/model_presets.py) and its model options.

Each preset is built with one layer (a full one is up to 1.2B random weights, 2.5 GB): its
``config.json`` must carry the documented shape, and its weights the dtype, biases and tied
output layer of the real checkpoint. The documented values are written out below, from the
checkpoints' published ``config.json`` (docs/vllm.md lists them), not read back from the code.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from vattention.bench import cli, vllm_bench
from vattention.bench.model_presets import PRESETS, get_preset, preset_from_config, read_config
from vattention.bench.tiny_models import build_tiny_model

# name -> the config.json fields of the full preset (layer count included).
DOCUMENTED = {
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": 16,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "attention_bias": False,
        "tie_word_embeddings": True,
        "dtype": "bfloat16",
        "vocab_size": 512,
    },
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"],
        "num_hidden_layers": 24,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
        "dtype": "bfloat16",
        "vocab_size": 512,
    },
    "gqa4-bf16": {
        "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": 8,
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
        "vocab_size": 512,
    },
}
# name -> (q/k/v biases in the weights, the output layer tied to the embedding)
WEIGHTS = {
    "llama-3.2-1b": (False, True),
    "qwen2.5-0.5b": (True, True),
    "gqa4-bf16": (False, False),
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def test_presets_are_the_documented_ones():
    assert set(PRESETS) == set(DOCUMENTED) == set(WEIGHTS)


@pytest.fixture(scope="module")
def one_layer_models(tmp_path_factory):
    """Each preset built with one layer: name -> path."""
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("presets")
    return {name: p.with_layers(1).build(str(root / name)) for name, p in PRESETS.items()}


@pytest.mark.parametrize("name", list(DOCUMENTED))
def test_built_config_has_the_documented_shape(name, one_layer_models):
    config = read_config(one_layer_models[name])
    expected = dict(DOCUMENTED[name], num_hidden_layers=1)  # cut to one layer, nothing else
    assert {k: config.get(k) for k in expected} == expected
    assert get_preset(name).num_layers == DOCUMENTED[name]["num_hidden_layers"]
    assert get_preset(name).with_layers(1).mismatches(one_layer_models[name]) == []
    if name == "llama-3.2-1b":
        rope = config.get("rope_parameters") or config.get("rope_scaling")
        assert {k: rope[k] for k in LLAMA3_ROPE} == LLAMA3_ROPE
    if name == "qwen2.5-0.5b":  # the real checkpoint's: no sliding window in effect
        assert config["use_sliding_window"] is False


@pytest.mark.parametrize("name", list(WEIGHTS))
def test_built_weights_have_the_preset_dtype_biases_and_tying(name, one_layer_models):
    from safetensors import safe_open

    qkv_bias, tied = WEIGHTS[name]
    with safe_open(f"{one_layer_models[name]}/model.safetensors", "pt") as f:
        names = set(f.keys())
        dtypes = {f.get_tensor(k).dtype for k in names}
    assert {str(d) for d in dtypes} == {"torch.bfloat16"}
    biases = {n.split(".")[-2] for n in names if n.endswith("_proj.bias")}
    assert biases == ({"q_proj", "k_proj", "v_proj"} if qkv_bias else set())
    assert ("lm_head.weight" not in names) == tied
    assert get_preset(name).qkv_bias == qkv_bias


def test_default_arguments_build_what_they_did(tmp_path):
    """build_tiny_model's new arguments leave its existing callers' models as they were, and
    --model-size's models are the random Llamas of before (fp32, intermediate 2 x hidden)."""
    pytest.importorskip("transformers")
    old = build_tiny_model(
        str(tmp_path / "old"),
        "llama",
        num_layers=2,
        hidden_size=256,
        num_heads=4,
        num_kv_heads=4,
        head_dim=64,
        max_positions=4096,
    )  # bench vllm's call for --model-size tiny, before the presets
    new = vllm_bench.size_model("tiny").build(str(tmp_path / "new"), max_positions=4096)
    drop = ("transformers_version",)
    old_config, new_config = (
        {k: v for k, v in json.loads(open(f"{p}/config.json").read()).items() if k not in drop}
        for p in (old, new)
    )
    assert new_config == old_config
    assert old_config["dtype"] == "float32" and old_config["intermediate_size"] == 512
    assert old_config["tie_word_embeddings"] is False and old_config["attention_bias"] is False
    assert (
        open(f"{old}/model.safetensors", "rb").read()
        == open(f"{new}/model.safetensors", "rb").read()
    )


def test_build_tiny_model_refuses_unknown_dtype_and_misplaced_bias(tmp_path):
    with pytest.raises(ValueError, match=r"dtype='fp16' must be one of \('float32'"):
        build_tiny_model(str(tmp_path / "a"), dtype="fp16")
    with pytest.raises(ValueError, match="family='mistral' has no such option"):
        build_tiny_model(str(tmp_path / "b"), "mistral", attention_bias=True)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_with_layers_keeps_the_widths_and_refuses_out_of_range():
    cut = get_preset("llama-3.2-1b").with_layers(2)
    assert (cut.num_layers, cut.full_layers, cut.hidden_size, cut.num_kv_heads) == (2, 16, 2048, 8)
    assert cut.with_layers(16).full_layers == 16  # cut again: still out of the real 16
    for bad in (0, 17):
        with pytest.raises(ValueError, match=f"num_layers={bad}: llama-3.2-1b has 1 to 16 layers"):
            cut.with_layers(bad)
    with pytest.raises(ValueError, match=r"'llama-7b' is not one of \('llama-3.2-1b'"):
        get_preset("llama-7b")


def _args(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(["vllm", *argv])


def test_model_and_model_size_options():
    default = _args()
    model, title = vllm_bench.bench_model(default)
    assert (title, model.dtype, model.num_layers) == ("random Llama 'small'", "float32", 4)
    model, title = vllm_bench.bench_model(_args("--model", "gqa4-bf16", "--num-layers", "3"))
    assert (title, model.dtype, model.num_layers, model.gqa_group) == (
        "preset 'gqa4-bf16'",
        "bfloat16",
        3,
        4,
    )
    with pytest.raises(ValueError, match="--num-layers 2: applies to --model presets"):
        vllm_bench.bench_model(_args("--model-size", "tiny", "--num-layers", "2"))
    with pytest.raises(ValueError, match="gqa4-bf16 has 1 to 8 layers"):
        vllm_bench.bench_model(_args("--model", "gqa4-bf16", "--num-layers", "9"))


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--model", "qwen2.5-0.5b", "--model-size", "small"], "not allowed with argument"),
        (["--model", "llama-7b"], "'llama-7b' is neither a preset (llama-3.2-1b, qwen2.5-0.5b, "),
    ],
)
def test_model_option_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        _args(*argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err


def test_help_lists_each_preset_with_its_shape(capsys):
    with pytest.raises(SystemExit):
        cli.main(["vllm", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse's line breaks undone
    assert "vocabulary scaled to 512 tokens" in out and "random weights" in out
    for preset in PRESETS.values():
        assert f"{preset.name}: {preset.shape()}" in out
    assert "your model's shape (--model PATH): its config.json, or the folder holding it" in out


def test_model_dir_holding_another_model_is_refused(tmp_path, one_layer_models):
    args = argparse.Namespace(model="qwen2.5-0.5b", model_dir=one_layer_models["gqa4-bf16"])
    args.max_model_len = 512
    with pytest.raises(ValueError, match=r"holds another model than qwen2.5-0.5b \(archi"):
        vllm_bench.build_model(get_preset("qwen2.5-0.5b").with_layers(1), args, str(tmp_path))
    args.model_dir = one_layer_models["qwen2.5-0.5b"]  # its own model: kept as it is
    path = vllm_bench.build_model(get_preset("qwen2.5-0.5b").with_layers(1), args, "unused")
    assert path == one_layer_models["qwen2.5-0.5b"]
    args.max_model_len = 40000
    with pytest.raises(ValueError, match="40000 exceeds qwen2.5-0.5b's max_position_embeddings"):
        vllm_bench.build_model(get_preset("qwen2.5-0.5b"), args, str(tmp_path))


@pytest.mark.parametrize(
    "dtype,identical,status",
    [("float32", True, 0), ("float32", False, 1), ("bfloat16", True, 0), ("bfloat16", False, 0)],
)
def test_exit_status_fails_on_differing_tokens_in_fp32_only(dtype, identical, status):
    results = {
        "sharegpt": {"tokens_identical": True},
        "long-prompt": {"tokens_identical": identical},
    }
    assert vllm_bench.exit_status(results, dtype) == status


# The checkpoints' config.json as published (meta-llama/Llama-3.2-1B, Qwen/Qwen2.5-0.5B), keys
# the shape does not use included: what a user's --model PATH reads.
PUBLISHED = {
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 8192,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_hidden_layers": 16,
        "num_key_value_heads": 8,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": LLAMA3_ROPE,
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.45.0.dev0",
        "use_cache": True,
        "vocab_size": 128256,
    },
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "hidden_act": "silu",
        "hidden_size": 896,
        "initializer_range": 0.02,
        "intermediate_size": 4864,
        "max_position_embeddings": 32768,
        "max_window_layers": 24,
        "model_type": "qwen2",
        "num_attention_heads": 14,
        "num_hidden_layers": 24,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.40.1",
        "use_cache": True,
        "use_mrope": False,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
}


def write_config(folder, config) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def shape_fields(preset):
    """A preset's fields but its name and source (where it was read from)."""
    return {
        k: v
        for k, v in dataclasses.asdict(preset).items()
        if k not in ("name", "source", "real_vocab_size")
    }


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_a_checkpoints_config_json_reads_as_its_preset(name, tmp_path):
    """The published config.json, as the file or its folder, gives the preset's every field;
    transformers 5's spelling (dtype, rope_parameters holding theta and scaling) the same."""
    folder = write_config(tmp_path / name.upper(), PUBLISHED[name])
    want = shape_fields(PRESETS[name])
    for path in (folder, f"{folder}/config.json"):
        got = preset_from_config(path)
        assert shape_fields(got) == want
        assert (got.name, got.source) == (name.upper(), folder)
        assert got.real_vocab_size == PUBLISHED[name]["vocab_size"]
    v5 = {k: v for k, v in PUBLISHED[name].items() if k not in ("torch_dtype", "rope_theta")}
    v5.pop("rope_scaling", None)
    v5["dtype"] = "bfloat16"
    v5["rope_parameters"] = {
        "rope_theta": PUBLISHED[name]["rope_theta"],
        **(PUBLISHED[name].get("rope_scaling") or {"rope_type": "default"}),
    }
    v5["_name_or_path"] = f"org/{name}"
    got = preset_from_config(write_config(tmp_path / "v5", v5))
    assert shape_fields(got) == want and (got.name, got.source) == (name, f"org/{name}")


def test_a_config_preset_builds_the_users_shape(tmp_path):
    """A Mistral-shaped config (no head_dim: hidden / heads; fp16) builds, with --num-layers,
    into a model whose config.json is that shape, which --model-dir then recognizes."""
    pytest.importorskip("transformers")
    config = {
        "architectures": ["MistralForCausalLM"],
        "hidden_size": 256,
        "intermediate_size": 704,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "num_hidden_layers": 6,
        "max_position_embeddings": 8192,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-05,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "vocab_size": 32768,
    }
    folder = write_config(tmp_path / "my-model", config)
    model, title = vllm_bench.bench_model(_args("--model", folder, "--num-layers", "2"))
    assert title == "my-model's config.json" and model.source == folder
    assert (model.name, model.family, model.num_layers, model.full_layers) == (
        "my-model",
        "mistral",
        2,
        6,
    )
    assert (model.head_dim, model.gqa_group, model.dtype) == (32, 4, "float16")
    assert "MistralForCausalLM, 2 of its 6 layers, hidden 256" in model.shape()
    path = model.build(str(tmp_path / "built"))
    assert model.mismatches(path) == []
    built = read_config(path)
    assert (built["num_key_value_heads"], built["head_dim"], built["dtype"]) == (2, 32, "float16")
    assert built["vocab_size"] == 512 and built.get("sliding_window") is None


LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "num_hidden_layers": 2,
}


@pytest.mark.parametrize(
    "change,message",
    [
        (
            {"architectures": ["GPT2LMHeadModel"]},
            "architectures=['GPT2LMHeadModel']; a shape is "
            "read from one of ('LlamaForCausalLM', 'Qwen2ForCausalLM', 'MistralForCausalLM')",
        ),
        ({"architectures": None}, "architectures=None; a shape is read from one of"),
        ({"hidden_size": None}, "hidden_size=None must be a positive integer"),
        ({"num_hidden_layers": 0}, "num_hidden_layers=0 must be a positive integer"),
        ({"intermediate_size": "1024"}, "intermediate_size='1024' must be a positive integer"),
        (
            {"num_key_value_heads": 3},
            "num_attention_heads=8 is not a multiple of num_key_value_heads=3",
        ),
        (
            {"hidden_size": 500},
            "no head_dim, and hidden_size=500 is not a multiple of num_attention_heads=8",
        ),
        ({"torch_dtype": "int8"}, "dtype='int8' must be one of ('float32', 'bfloat16', 'float16')"),
        ({"mlp_bias": True}, "mlp_bias=True; a preset's MLP has no biases"),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 4096}, "sliding_window=4096;"),
        ({"architectures": ["MistralForCausalLM"], "attention_bias": True}, "Mistral has no such"),
        (
            {
                "architectures": ["Qwen2ForCausalLM"],
                "use_sliding_window": True,
                "sliding_window": 4096,
            },
            "sliding_window=4096; a preset's layers attend to the whole row",
        ),
    ],
)
def test_a_config_a_preset_cannot_hold_is_refused_naming_the_field(change, message, tmp_path):
    folder = write_config(tmp_path / "m", {**LLAMA, **change})
    with pytest.raises(ValueError) as e:
        preset_from_config(folder)
    assert message in str(e.value) and str(e.value).startswith(f"config.json at {folder}: ")


def test_an_unreadable_config_is_refused(tmp_path):
    with pytest.raises(ValueError, match="cannot be read"):
        preset_from_config(str(tmp_path / "absent"))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        preset_from_config(str(tmp_path / "bad"))
    (tmp_path / "list").mkdir()
    (tmp_path / "list" / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a JSON object"):
        preset_from_config(str(tmp_path / "list"))
