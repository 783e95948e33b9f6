"""A folder too large for one call of the device tool, carried in parts: FA4's wheel set (98 MB,
92 MB of it one wheel) to a GPU machine with no network, where one call carries at most 64 MiB
with the working tree.

Here, on a machine with the folder (docs/cuda.md, "FlashAttention-4 on a GPU machine without
network"), ``pack`` writes it as a tar cut into parts of at most ``--max-mib`` MiB, one folder per
call, each under the repository's ignored ``gpu-check/`` and with the whole tar's SHA-256::

    python benchmarks/gpu/carry.py pack fa4-wheels gpu-check/carry

prints the folders (``gpu-check/carry/1``, ``gpu-check/carry/2``) and one device call per folder,
to be made back to back while the machine stays warm (files under /tmp outlive a call only
then): each call's ``stage`` copies its part to ``--stage`` (under /tmp); the call that completes
the set checks the SHA-256 and unpacks the folder into ``--into``, then runs what follows it::

    python3 benchmarks/gpu/carry.py stage gpu-check/carry/1 --stage /tmp/vattention-carry \\
        --into /tmp/vattention-carried
    python3 benchmarks/gpu/carry.py stage gpu-check/carry/2 --stage /tmp/vattention-carry \\
        --into /tmp/vattention-carried && GPU_CHECK_WHEELS=/tmp/vattention-carried/fa4-wheels \\
        make gpu-check PYTHON=/opt/torch/.venv/bin/python3

Exit status of ``stage``: 0 when the folder is unpacked (now or by an earlier call), 3 while parts
are missing (it names them: a machine that went back between calls lost the staged ones, which
are carried again), 2 on a damaged set (a SHA-256 that does not match) or a folder with no
part. Standard library only: the GPU machine's Python runs it.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import shutil
import sys
import tarfile
from pathlib import Path
from typing import List

MANIFEST = "carry.json"
MIB = 1 << 20


def pack(folder: Path, out: Path, max_mib: int) -> List[Path]:
    """Writes ``folder`` as a tar in parts of at most ``max_mib`` MiB: ``out/1``, ``out/2``...,
    each with the manifest. Returns the part folders."""
    if not folder.is_dir():
        raise SystemExit(f"pack: {folder} is not a folder")
    if max_mib < 1:
        raise SystemExit(f"pack: --max-mib {max_mib} must be >= 1")
    if out.exists():
        if any(not (old / MANIFEST).exists() for old in out.iterdir()):
            raise SystemExit(f"pack: {out} holds files of its own; give an empty or new folder")
        shutil.rmtree(out)  # an earlier pack's parts only
    out.mkdir(parents=True)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:  # wheels are compressed already
        tar.add(folder, arcname=folder.name)
    data = buffer.getvalue()
    size = max_mib * MIB
    chunks = [data[i : i + size] for i in range(0, len(data), size)]
    manifest = {
        "name": folder.name,
        "parts": len(chunks),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    parts = []
    for i, chunk in enumerate(chunks, 1):
        part = out / str(i)
        part.mkdir()
        (part / f"part-{i:03d}").write_bytes(chunk)
        (part / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        parts.append(part)
    return parts


def stage(carried: Path, stage_dir: Path, into: Path) -> int:
    """Copies the part in ``carried`` to ``stage_dir``; once every part is there, checks the
    whole and unpacks it into ``into``. Returns the exit status (module docstring)."""
    if not (carried / MANIFEST).is_file():
        print(f"carry: {carried} holds no part (was it carried with this call?)", file=sys.stderr)
        return 2
    manifest = json.loads((carried / MANIFEST).read_text())
    done = into / f".carried-{manifest['sha256']}"
    if done.exists():
        print(f"carry: {manifest['name']} already unpacked in {into}")
        return 0
    stage_dir.mkdir(parents=True, exist_ok=True)
    for part in carried.glob("part-*"):
        shutil.copyfile(part, stage_dir / part.name)
    names = [f"part-{i:03d}" for i in range(1, manifest["parts"] + 1)]
    missing = [n for n in names if not (stage_dir / n).exists()]
    if missing:
        print(
            f"carry: {manifest['name']}: {len(names) - len(missing)} of {len(names)} parts "
            f"staged in {stage_dir}; missing {', '.join(missing)} (carry them next, while the "
            "machine is warm)"
        )
        return 3
    data = b"".join((stage_dir / n).read_bytes() for n in names)
    digest = hashlib.sha256(data).hexdigest()
    if digest != manifest["sha256"]:
        print(
            f"carry: {manifest['name']}: the staged parts do not make the packed tar (SHA-256 "
            f"{digest[:12]} != {manifest['sha256'][:12]}): pack and carry again",
            file=sys.stderr,
        )
        return 2
    into.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    done.touch()
    print(f"carry: {manifest['name']} unpacked in {into / manifest['name']}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    pk = sub.add_parser("pack", help="cut a folder into parts, one per device call")
    pk.add_argument("folder", type=Path)
    pk.add_argument("out", type=Path, help="under gpu-check/ (ignored by git, carried by name)")
    pk.add_argument(
        "--max-mib", type=int, default=56, help="per part (default 56: the tree needs ~4 MiB)"
    )
    st = sub.add_parser("stage", help="on the GPU machine: stage a part, unpack a full set")
    st.add_argument("carried", type=Path)
    st.add_argument("--stage", type=Path, required=True, dest="stage_dir")
    st.add_argument("--into", type=Path, required=True)
    args = p.parse_args(argv)
    if args.command == "stage":
        return stage(args.carried, args.stage_dir, args.into)
    parts = pack(args.folder, args.out, args.max_mib)
    for part in parts:
        size = sum(f.stat().st_size for f in part.iterdir()) / MIB
        print(
            f"{part} ({size:.1f} MiB): run(carry=[{str(part)!r}], command='python3 "
            f"benchmarks/gpu/carry.py stage {part} --stage /tmp/vattention-carry --into "
            f"/tmp/vattention-carried')"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
