"""Run vLLM workloads in this process and write what happened as JSON.

``python -m vattention.bench.vllm_run SPEC.json OUT.json`` (needs vLLM) runs one workload. With
``--serve``, ``python -m vattention.bench.vllm_run --serve SPEC.json`` starts the engine once and
then runs one workload per JSON line read from stdin (``{"requests": [...]}``), answering each
with one JSON line on stdout, until ``{"quit": true}`` or the end of input: ``bench vllm`` keeps a
stock and a plugin engine alive this way and alternates them. The spec names the
model, the engine arguments, the requests (token ids, sampling parameters), whether to compute
transformers' greedy tokens too, and ``idle_s``: seconds the engine stays up, idle, after the
last request before it shuts down (with ``idle_until_released``, then until the plugin's worker
reports that its delayed release has applied: :func:`_await_release`). Whether the vattention
plugin is on is decided by the environment (``VATTENTION_VLLM=1``), as for any vLLM process: tests
and ``bench vllm`` start one process per engine so that stock vLLM and the plugin are measured
apart.

The output holds each request's generated token ids (and, where its sampling parameters ask for
``logprobs`` or ``prompt_logprobs``, the top logprobs at each generated or prompt token), the wall
time of ``generate()``, generated tokens per second, the process's peak resident memory
(``ru_maxrss``) and, with the plugin on and ``VATTENTION_VLLM_STATS`` set, the worker's final
cache statistics (read back after shutdown).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from typing import IO, Any, Dict, List

from .machine import cpu_name

__all__ = [
    "main",
    "run",
    "answer_channel",
    "engine_in_this_process",
    "timed_generate",
    "generated_tokens",
]


def engine_in_this_process() -> None:
    """The environment for a vLLM engine in the calling process (not a core process of its own),
    its OpenMP threads unbound (binding them on a 2-core machine slows it several-fold); where
    the caller has set either variable, its value stays."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def timed_generate(llm, requests: List[Dict[str, Any]]):
    """``llm.generate()`` on ``requests`` (token ids, sampling parameters): ``(outputs, seconds,
    tokens)``, the tokens being each request's completions' generated token ids."""
    import vllm

    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
    params = [vllm.SamplingParams(**r.get("sampling", {})) for r in requests]
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens: List[List[List[int]]] = [[list(c.token_ids) for c in o.outputs] for o in outputs]
    return outputs, seconds, tokens


def generated_tokens(tokens: List[List[List[int]]]) -> int:
    """How many tokens one pass generated (per request, per completion: token ids).

    >>> generated_tokens([[[5, 6, 7]], [[1], [2, 3]]])
    6
    """
    return sum(len(completion) for request in tokens for completion in request)


def run(spec: Dict[str, Any]) -> Dict[str, Any]:
    """Run ``spec`` (see the module docstring) and return the result document."""
    engine_in_this_process()
    import vllm

    t0 = time.perf_counter()
    llm = vllm.LLM(model=spec["model"], **spec.get("engine", {}))
    start_s = time.perf_counter() - t0
    peak = _track_running(llm)
    rss_before = _peak_rss()
    outputs, wall_s, tokens = timed_generate(llm, spec["requests"])
    generated = generated_tokens(tokens)
    result: Dict[str, Any] = {
        "logprobs": [[_ranked(c.logprobs) for c in o.outputs] for o in outputs],
        "prompt_logprobs": [_ranked(o.prompt_logprobs) for o in outputs],
        "plugin": os.environ.get("VATTENTION_VLLM") == "1",
        "vllm_version": vllm.__version__,
        "worker_cls": llm.llm_engine.vllm_config.parallel_config.worker_cls,
        "tokens": tokens,
        "start_s": start_s,
        "generate_s": wall_s,
        "generated_tokens": generated,
        "tokens_per_s": generated / wall_s if wall_s > 0 else 0.0,
        "peak_rss_before_generate": rss_before,
        "peak_rss": _peak_rss(),
        "max_concurrency": peak(),
    }
    if spec.get("idle_s"):  # the engine alive and idle before shutdown (its delayed release)
        _idle(llm)
        time.sleep(float(spec["idle_s"]))
    if spec.get("idle_until_released"):
        result["idle_wait_s"] = _await_release(os.environ.get("VATTENTION_VLLM_STATS"))
    _shutdown(llm)
    stats_file = os.environ.get("VATTENTION_VLLM_STATS")
    if result["plugin"] and stats_file and os.path.exists(stats_file):
        with open(stats_file) as f:
            result["vattention_stats"] = json.load(f)
    if spec.get("hf_reference"):
        result["hf_tokens"] = hf_greedy(spec["model"], spec["requests"])
    return result


def answer_channel() -> IO[str]:
    """The stream a line-driven engine process answers on: the real stdout. vLLM, torch and
    native code print, to Python's ``sys.stdout`` or straight to file descriptor 1, so fd 1
    becomes stderr for all of them."""
    sys.stdout.flush()
    answer = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return answer


def _line_driven_engine(spec: Dict[str, Any]):
    """The engine of ``spec`` in this process, and its :func:`answer_channel`."""
    engine_in_this_process()
    answer = answer_channel()
    import vllm

    return vllm.LLM(model=spec["model"], **spec.get("engine", {})), answer


def attention_kernel(llm, plugin: bool) -> str:
    """What this engine's attention runs on the CPU: the plugin's kernel variant, or the
    instruction set vLLM's CPU_ATTN backend gave its layers (their ``isa``, from its own
    ``_get_attn_isa``: ``amx`` for bf16 on a CPU with AMX tiles, ``vec``, ``vec16``...)."""
    if plugin:
        from vattention.attention import kernel_isa

        return f"vattention kernel, {kernel_isa()}"

    def layer_isas(model):
        return sorted({m.isa for m in model.modules() if isinstance(getattr(m, "isa", None), str)})

    try:
        isas = sorted({isa for worker in llm.apply_model(layer_isas) for isa in worker})
    except Exception as exc:  # an engine without apply_model: say so rather than guess
        return f"vLLM's op, isa unknown ({type(exc).__name__})"
    return f"vLLM's op, isa {'/'.join(isas) or 'unknown'}"


def serve(spec: Dict[str, Any]) -> int:
    """``--serve``: one engine, one workload per stdin line; 0 after a clean quit. Its first
    answer says it is ready, and on which CPU and attention kernel it runs."""
    llm, answer = _line_driven_engine(spec)
    peak = _track_running(llm)
    plugin = os.environ.get("VATTENTION_VLLM") == "1"
    print(
        json.dumps(
            {
                "ready": True,
                "plugin": plugin,
                "cpu": cpu_name(),
                "attention": attention_kernel(llm, plugin),
            }
        ),
        file=answer,
        flush=True,
    )
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("quit"):
            break
        _, wall_s, tokens = timed_generate(llm, command["requests"])
        generated = generated_tokens(tokens)
        print(
            json.dumps(
                {
                    "tokens": tokens,
                    "generate_s": wall_s,
                    "tokens_per_s": generated / wall_s if wall_s > 0 else 0.0,
                    "max_concurrency": peak(),
                    "peak_rss": _peak_rss(),
                }
            ),
            file=answer,
            flush=True,
        )
    _shutdown(llm)
    return 0


def serve_bursts(spec: Dict[str, Any]) -> int:
    """``--bursts``: one engine, one burst per stdin line, answered with per-request timings.

    A burst is ``{"requests": [...], "arrivals": [s, ...], "start_at": time.time() value}``:
    request i is added ``arrivals[i]`` seconds after ``start_at`` (engines of one benchmark share
    that clock), and the engine is stepped here (``LLMEngine.step``) so that each request's first
    token and completion are timed as they happen. The answer holds, per request, TTFT and the
    end (seconds from its arrival, from ``start_at``), its tokens, and the burst's preemptions.
    """
    import vllm

    llm, answer = _line_driven_engine(spec)
    engine = llm.llm_engine
    preemptions = _count_preemptions(llm)
    print(json.dumps({"ready": True, "pid": os.getpid()}), file=answer, flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("quit"):
            break
        requests, arrivals = command["requests"], command["arrivals"]
        start = float(command["start_at"])
        order = sorted(range(len(requests)), key=lambda i: arrivals[i])
        first: Dict[int, float] = {}
        end: Dict[int, float] = {}
        tokens: Dict[int, List[int]] = {}
        preempted_before = preemptions()
        while len(end) < len(requests):
            now = time.time() - start
            while order and arrivals[order[0]] <= now:
                i = order.pop(0)
                engine.add_request(
                    str(i),
                    {"prompt_token_ids": requests[i]["prompt_token_ids"]},
                    vllm.SamplingParams(**requests[i].get("sampling", {})),
                )
            if not engine.has_unfinished_requests():
                time.sleep(max(0.0, min(0.05, arrivals[order[0]] - now)) if order else 0.001)
                continue
            for out in engine.step():
                i, at = int(out.request_id), time.time() - start
                if i not in first and out.outputs and out.outputs[0].token_ids:
                    first[i] = at
                if out.finished:
                    end[i] = at
                    tokens[i] = list(out.outputs[0].token_ids)
        _idle(llm)
        print(
            json.dumps(
                {
                    "ttft": [first[i] - arrivals[i] for i in range(len(requests))],
                    "end": [end[i] for i in range(len(requests))],
                    "tokens": [tokens[i] for i in range(len(requests))],
                    "preemptions": preemptions() - preempted_before,
                }
            ),
            file=answer,
            flush=True,
        )
    _shutdown(llm)
    return 0


def _count_preemptions(llm):
    """Count the requests the scheduler preempts (its outputs' ``preempted_req_ids``), stock and
    plugin alike; the engine must run in this process."""
    core = llm.llm_engine.engine_core.engine_core
    scheduler = core.scheduler
    count = [0]
    schedule = scheduler.schedule

    def counted(*args, **kwargs):
        out = schedule(*args, **kwargs)
        count[0] += len(getattr(out, "preempted_req_ids", None) or ())
        return out

    scheduler.schedule = counted
    return lambda: count[0]


def _ranked(logprobs) -> List[List[List[float]] | None] | None:
    """A completion's ``logprobs`` (one ``{token: Logprob}`` per generated token: the top
    ``SamplingParams.logprobs`` and the sampled token) or a request's ``prompt_logprobs`` (one
    per prompt token: the top ``SamplingParams.prompt_logprobs`` and the prompt's token; None
    for the first, which has no context) as ``[[token, logprob], ...]`` per token, best first;
    None where the request asked for none."""
    if logprobs is None:
        return None
    return [
        None
        if step is None
        else sorted(([t, lp.logprob] for t, lp in step.items()), key=lambda e: -e[1])
        for step in logprobs
    ]


def _await_release(stats_file: str | None, timeout_s: float = 120.0) -> float:
    """Wait until the plugin's worker reports (in its periodically rewritten statistics) that its
    delayed release has applied the budget of its last step, and return the seconds waited. Its
    thread wakes ``release_delay_s`` after the last request; on a loaded machine it may act late,
    so a test waits for the event instead of sleeping a fixed time. ``timeout_s`` guards a hang."""
    start = time.monotonic()
    while stats_file and time.monotonic() - start < timeout_s:
        try:
            with open(stats_file) as f:
                elastic = json.load(f).get("elastic", {})
        except (OSError, ValueError):  # not written yet
            elastic = {}
        if "applied_budget_bytes" in elastic and (
            elastic["applied_budget_bytes"] == elastic.get("budget_bytes")
        ):
            break
        time.sleep(0.25)
    return time.monotonic() - start


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _track_running(llm):
    """Count the scheduler's peak running requests (vLLM keeps no such counter).

    Works with the engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the scheduler
    instance's ``schedule`` is wrapped to record ``len(running)`` after each call. Returns a
    function giving the peak (-1 when the scheduler is in another process).
    """
    core = getattr(
        getattr(getattr(llm, "llm_engine", None), "engine_core", None), "engine_core", None
    )
    scheduler = getattr(core, "scheduler", None)
    if scheduler is None:
        return lambda: -1
    peak = [0]
    schedule = scheduler.schedule

    def counted(*args, **kwargs):
        out = schedule(*args, **kwargs)
        peak[0] = max(peak[0], len(scheduler.running))
        return out

    scheduler.schedule = counted
    return lambda: peak[0]


def _idle(llm) -> None:
    """In this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) ``generate()`` returns with the last
    finished requests not yet told to the workers; vLLM's engine loop (its own process, the
    default) runs that one more step before it idles. So does this: the engine is then as idle
    as a served one (with the plugin: its cache capped, its headroom trimmed)."""
    engine = getattr(llm, "llm_engine", None)
    core = getattr(getattr(engine, "engine_core", None), "engine_core", None)
    if engine is not None and core is not None and core.scheduler.has_requests():
        engine.step()


def _shutdown(llm) -> None:
    """Shut the engine down now (an idle one, :func:`_idle`) so that workers write their final
    statistics."""
    _idle(llm)
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()


def hf_greedy(model_path: str, requests: List[Dict[str, Any]]) -> List[List[int]]:
    """transformers' greedy tokens for each request (``max_tokens`` each, EOS ignored)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_path, dtype=torch.float32
    ).eval()
    out = []
    for r in requests:
        n = r.get("sampling", {}).get("max_tokens", 16)
        ids = torch.tensor([r["prompt_token_ids"]])
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        out.append(gen[0, ids.shape[1] :].tolist())
    return out


def main(argv: List[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2 and argv[0] in ("--serve", "--bursts"):
        with open(argv[1]) as f:
            return (serve if argv[0] == "--serve" else serve_bursts)(json.load(f))
    if len(argv) != 2:
        print(
            "usage: python -m vattention.bench.vllm_run SPEC.json OUT.json\n"
            "       python -m vattention.bench.vllm_run --serve SPEC.json\n"
            "       python -m vattention.bench.vllm_run --bursts SPEC.json",
            file=sys.stderr,
        )
        return 2
    with open(argv[0]) as f:
        spec = json.load(f)
    result = run(spec)
    with open(argv[1], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
