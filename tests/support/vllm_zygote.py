"""Imports vLLM once, then runs each command it is sent in a child forked from this process.

Run in the vLLM venv by ``vllm_harness.Zygote``; not a user entry point. Importing vLLM costs
about 12-16 CPU-seconds a process here (torch._inductor, transformers, openai's types), and the
vLLM tests start about twenty processes at once on two cores: forking them from one process that
has imported vLLM, and done nothing else, saves that import in each.

What a child gets is what ``python -m MOD ...``, ``python -c CODE ...`` or ``python SCRIPT ...``
would get, minus the import: its own environment (replaced whole, before any vLLM code reads it),
working directory, ``sys.argv``, ``sys.path[0]``, stdout and stderr (a log file), no stdin, and an
exit that runs ``threading``'s and ``atexit``'s handlers as the interpreter's would. vLLM loads its
plugins lazily, when an engine or its arguments are built (``load_general_plugins``), never at
import: this process loads none (it asserts so), so each child finds the plugin through its entry
point, on or off by its environment, as a fresh ``vllm`` process does.

Protocol, one JSON document a line. In: ``{"id", "argv", "env", "cwd", "log"}``. Out:
``{"ready": true}`` once imported; ``{"id", "pid"}`` when a child started; ``{"id", "rc"}`` when it
ended (``-N`` for signal N). The process ends when its input does and every child has ended.
"""

from __future__ import annotations

import json
import os
import select
import sys


def _child(cmd: dict) -> None:
    """In the forked child: becomes the command, never returns."""
    code = 1
    try:
        import atexit
        import runpy
        import threading
        import traceback

        log = os.open(cmd["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.chdir(cmd["cwd"])
        os.environ.clear()
        os.environ.update(cmd["env"])
        argv = cmd["argv"]
        try:
            if argv[0] == "-m":
                sys.argv = [argv[1], *argv[2:]]
                sys.path[0] = os.getcwd()
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            elif argv[0] == "-c":
                sys.argv = ["-c", *argv[2:]]
                sys.path[0] = ""
                exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
            else:
                sys.argv = list(argv)
                sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
                runpy.run_path(argv[0], run_name="__main__")
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:  # noqa: BLE001 - reported as the interpreter would
            traceback.print_exc()
            code = 1
        threading._shutdown()  # the interpreter's exit: join non-daemon threads, then atexit
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 - before the command ran (its log), or in the exit
        import traceback

        traceback.print_exc()
        code = code or 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def main() -> int:
    # Replies go to a copy of fd 1; fd 1 itself becomes stderr (this process's log), where vLLM's
    # and torch's own prints land.
    sys.stdout.flush()
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    import vllm  # noqa: F401
    import vllm.plugins
    import vllm.v1.engine.llm_engine  # noqa: F401 - the offline engine's modules
    from vllm import LLM, SamplingParams  # noqa: F401

    assert not vllm.plugins.plugins_loaded, "importing vLLM loaded its plugins"

    def reply(doc: dict) -> None:
        replies.write(json.dumps(doc) + "\n")
        replies.flush()

    reply({"ready": True})
    children: dict = {}  # pid -> id
    buffered, done = b"", False
    while not done or children:
        if not done and select.select([0], [], [], 0.2)[0]:
            data = os.read(0, 1 << 16)
            done = not data
            buffered += data
            while b"\n" in buffered:
                line, buffered = buffered.split(b"\n", 1)
                cmd = json.loads(line)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    replies.close()
                    _child(cmd)
                children[pid] = cmd["id"]
                reply({"id": cmd["id"], "pid": pid})
        elif done:
            select.select([], [], [], 0.2)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid in children:
                reply({"id": children.pop(pid), "rc": os.waitstatus_to_exitcode(status)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
