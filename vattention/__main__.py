"""Command line: ``python -m vattention {info,demo,bench,pool}``."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional


def _info() -> int:
    import torch

    import vattention
    from vattention import backends

    print(f"vattention {vattention.__version__}")
    print(f"torch {torch.__version__}")
    for kind, device in (("host", "cpu"), ("cuda", "cuda:0")):
        reason = backends.unavailable_reason(kind)
        if reason:
            print(f"backend {kind}: unavailable: {reason}")
            continue
        try:
            gran = backends.granularity(device)
        except vattention.VAttentionError as e:
            print(f"backend {kind}: unavailable: {e}")
        else:
            print(f"backend {kind}: available, granularity {gran} bytes")
    from vattention.attention import kernel_report

    for line in kernel_report():  # the CPU attention kernel's variant here, and why
        print(line)
    return 0


COMMANDS = ("info", "demo", "bench", "pool")
# What each command does, for the top-level --help.
SUMMARIES = {
    "info": "the backends this build can use here (host, CUDA), and why not",
    "demo": "continuous batching on the CPU over a virtual KV cache, with a closing table",
    "bench": "benchmarks: memory (request traces), vllm (the plugin vs stock vLLM), elastic",
    "pool": "list the vLLM plugin's shared KV memory pools, or change one's budget",
}


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m vattention",
        description="vattention's command line: KV caches contiguous in virtual memory.",
        epilog="commands:\n"
        + "".join(f"  {name:<7}{SUMMARIES[name]}\n" for name in COMMANDS)
        + "\n`python -m vattention COMMAND --help` gives a command's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("command", choices=COMMANDS, help="one of the commands below")
    if not argv or argv[0] not in COMMANDS:
        parser.parse_args(argv)  # top-level usage: --help, an unknown command, none at all
        return 2
    # Everything after the command is the command's own (``demo --help`` prints demo's usage).
    command, rest = argv[0], argv[1:]
    if command == "info":
        parser = argparse.ArgumentParser(
            prog="python -m vattention info", description="Backends available here, and why not."
        )
        parser.parse_args(rest)
        return _info()
    if command == "demo":
        from .bench.demo import main as demo_main

        return demo_main(rest)
    if command == "pool":
        from .bench.pools import main as pool_main

        return pool_main(rest)
    try:
        from .bench.cli import main as bench_main
    except ImportError:
        print("the benchmarks are not part of this build", file=sys.stderr)
        return 2
    return bench_main(rest)


if __name__ == "__main__":
    sys.exit(main())
