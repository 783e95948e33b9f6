"""KV memory budgets shared across processes: several engines of one machine draw on one pool.

Engines that name the same pool (separate processes, different models) share one budget of bytes
on one device. Before an engine maps memory for a request it asks its :class:`PoolLedger` for a
grant; a grant happens under a lock all processes take, so the sum of the live engines' held bytes
never exceeds the budget through this module. Without a pool, :class:`LocalLedger` answers the
same calls for one engine alone (its budget is its own ``max_bytes``; no files, no locks).

The files, in :func:`pool_directory` (``/dev/shm/vattention-pools`` by default):

* ``NAME.lock``: taken with ``flock(LOCK_EX)`` around every read-modify of the pool. Its eight
  bytes count the pool's changes (an engine joined or left, the budget changed), so a ledger
  rereads the directory only when the count moved.
* ``NAME.pool``: JSON (budget, device, created time), replaced whole (write, then rename).
* ``NAME.<pid>.<hex>.engine``: one per engine, a fixed-size record (held bytes and the figures
  the command line shows) on which its engine holds ``flock(LOCK_EX)`` for its lifetime.

The directory and its files are private to the user who starts a pool's first engine: the
directory is created with mode 0700 and every file with 0600, and a directory (or a link to one)
that another user owns, or that others can write in, is refused with :class:`ConfigError` naming
it and its owner, before any file in it is opened. Engines of one pool run as one user.

Crash safety comes from the kernel, not from a counter: the kernel drops a dead process's locks,
so an entry whose lock can be taken (``LOCK_NB`` on a descriptor of one's own) belongs to a dead
engine, and whoever sees that next (a grant, a join, a listing) removes it. Nothing counts an
entry without asking the kernel first, so no file a killed process leaves behind (dead entry,
half-written temporary file, lock file without pool) can make the budget look smaller.

>>> import tempfile
>>> from vattention.pool_ledger import PoolLedger, list_pools
>>> tmp = tempfile.TemporaryDirectory(); d = tmp.name
>>> a = PoolLedger.join("demo", 1000, device="cpu", model="a", max_bytes=800, directory=d)
>>> b = PoolLedger.join("demo", 1000, device="cpu", model="b", max_bytes=800, directory=d)
>>> a.try_grow(700, unit=100), b.try_grow(700, unit=100), b.grow(1)
(700, 300, False)
>>> a.set_held(200); b.try_grow(700, unit=100)
500
>>> [(p.name, p.budget_bytes, p.held) for p in list_pools(d)]
[('demo', 1000, 1000)]
>>> a.close(); b.close(); list_pools(d)
[]
>>> tmp.cleanup()
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import pwd
import re
import secrets
import signal
import stat
import struct
import tempfile
import threading
import time
import weakref
from typing import Callable, Dict, List, Mapping, Optional, Tuple, Union

from .arguments import INT64_MAX, as_int
from .config import parse_size
from .errors import ArgumentTypeError, CacheClosedError, ConfigError

__all__ = [
    "ENV_POOL",
    "ENV_POOL_BYTES",
    "ENV_POOL_DIR",
    "ENV_TEST_PAUSE",
    "PAUSE_POINTS",
    "EngineInfo",
    "Ledger",
    "LocalLedger",
    "PoolInfo",
    "PoolLedger",
    "ledger_from_env",
    "list_pools",
    "pool_directory",
    "set_budget",
]

ENV_POOL_DIR = "VATTENTION_POOL_DIR"  # where the pool files live (default: pool_directory())
ENV_POOL = "VATTENTION_VLLM_POOL"  # the pool an engine joins; unset: a LocalLedger
ENV_POOL_BYTES = "VATTENTION_VLLM_POOL_BYTES"  # the pool's budget (bytes or a size like "8GiB")
# A point of PAUSE_POINTS: the process stops itself (SIGSTOP) there, for crash tests.
ENV_TEST_PAUSE = "VATTENTION_POOL_TEST_PAUSE"

# Where a grant, a join and a close can be caught (and killed) by the crash tests, in order.
PAUSE_POINTS = (
    "locked",  # grant: the pool lock is held
    "read",  # grant: the other entries are read, the grant decided
    "written",  # grant: the own entry holds the new figure
    "unlocking",  # grant: about to drop the pool lock
    "join-created",  # join: the entry file exists and is locked, its record not written
    "close-unlinked",  # close: the entry file is gone, its lock still held
)


def _stop_self_at(point: str) -> Callable[[str], None]:
    def stop(reached: str) -> None:
        if reached == point:
            os.kill(os.getpid(), signal.SIGSTOP)

    return stop


# Called with each point of PAUSE_POINTS a ledger passes; None (nothing to call) outside tests.
# Tests in a forked child assign their own; VATTENTION_POOL_TEST_PAUSE sets it at import.
pause_hook: Optional[Callable[[str], None]] = (
    _stop_self_at(os.environ[ENV_TEST_PAUSE]) if os.environ.get(ENV_TEST_PAUSE) else None
)


def _pause(point: str) -> None:
    hook = pause_hook
    if hook is not None:
        hook(point)


# ---- names, arguments, the directory -----------------------------------------------------------

_NAME_RULE = "1 to 64 of A-Z a-z 0-9 _ . -, not starting with '.'"
_NAME_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,63}")
_DEVICE_BYTES = 64  # the record's device field
_MODEL_BYTES = 256  # the record's model field (longer names are cut)


def _check_name(name: object) -> str:
    if not isinstance(name, str):
        raise ArgumentTypeError(f"pool name {name!r} must be a str, got {type(name).__name__}")
    if not _NAME_RE.fullmatch(name):
        raise ConfigError(f"pool name {name!r} is not valid: use {_NAME_RULE}")
    return name


def _check_bytes(value: object, name: str) -> int:
    if type(value) is int and 0 <= value <= INT64_MAX:  # the hot path: grants every step
        return value
    n = as_int(value, name)
    if not 0 <= n <= INT64_MAX:
        raise ConfigError(f"{name}={n} must be in [0, {INT64_MAX}] bytes")
    return n


def _check_unit(unit: object) -> int:
    if type(unit) is int and 1 <= unit <= INT64_MAX:
        return unit
    n = as_int(unit, "unit")
    if not 1 <= n <= INT64_MAX:
        raise ConfigError(f"unit={n} must be in [1, {INT64_MAX}] bytes")
    return n


def _check_device(device: object) -> str:
    if not isinstance(device, str):
        raise ArgumentTypeError(f"device={device!r} must be a str such as 'cuda:0'")
    if not device or len(device.encode()) > _DEVICE_BYTES:
        raise ConfigError(f"device={device!r} must be 1 to {_DEVICE_BYTES} bytes long")
    return device


def _check_model(model: object) -> str:
    if not isinstance(model, str):
        raise ArgumentTypeError(f"model={model!r} must be a str")
    return model


def pool_directory(directory: Optional[str] = None) -> str:
    """The directory of the pool files: ``directory``, else ``$VATTENTION_POOL_DIR``, else
    ``/dev/shm/vattention-pools`` (memory, gone at reboot like the engines), else the same under
    the temporary directory where there is no ``/dev/shm``."""
    if directory:
        return os.fspath(directory)
    env = os.environ.get(ENV_POOL_DIR)
    if env:
        return env
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, "vattention-pools")


_FILE_MODE = 0o600  # the pool's files: read and written by their user only
_DIR_MODE = 0o700  # the directory a first engine creates


def _user(uid: int) -> str:
    """``uid 1000 (alice)``, or ``uid 12345`` where the system has no name for it."""
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def _private_directory(directory: str, *, create: bool) -> bool:
    """Check that ``directory`` is this user's alone before any pool file in it is opened;
    ``create``: make it (mode 0700) where it is missing. Returns whether it exists.

    A pool's files decide how much memory engines map, and an engine trusts its grants: another
    user who could rewrite them (or had placed the directory, or a link to one, in the shared
    ``/dev/shm``) could make an engine map memory its pool never granted. So the directory, and
    the link to it if it is one, must belong to the process's effective user and be writable by
    nobody else (mode bits 0o022 clear); its files are then this user's too. Raises
    :class:`ConfigError` naming the path, its owner and mode otherwise.
    """
    if create:
        try:
            os.makedirs(directory, mode=_DIR_MODE)
        except FileExistsError:
            pass
    try:
        link, st = os.lstat(directory), os.stat(directory)
    except FileNotFoundError:
        return False
    me = os.geteuid()
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(
            f"pool directory {directory} is not a directory (owner {_user(st.st_uid)}): set "
            f"{ENV_POOL_DIR} to a directory of this user's"
        )
    checked = [("a link owned by", link)] if stat.S_ISLNK(link.st_mode) else []
    for what, info in checked + [("owned by", st)]:
        if info.st_uid != me:
            raise ConfigError(
                f"pool directory {directory} is {what} {_user(info.st_uid)}, not by this "
                f"process's user, {_user(me)}: another user's pool files are never used (set "
                f"{ENV_POOL_DIR} to a directory of this user's, or remove that one)"
            )
    if st.st_mode & 0o022:
        raise ConfigError(
            f"pool directory {directory} (owner {_user(st.st_uid)}) has mode "
            f"{stat.S_IMODE(st.st_mode):04o}: others can write in it, so they could rewrite a "
            f"pool's files; make it private (chmod 700 {directory}) or set {ENV_POOL_DIR} to "
            "another directory"
        )
    return True


def _fit(nbytes: int, unit: int, room: int) -> int:
    """The largest multiple of ``unit`` no larger than ``nbytes`` and ``room`` (0 if none)."""
    fit = min(nbytes, room)
    return fit - fit % unit if fit > 0 else 0


# ---- the files ---------------------------------------------------------------------------------

# An entry: magic, version, reserved, pid, held, live, cached, headroom, max_bytes, updated,
# device, model. Fixed size, so that rewriting it is one pwrite (always under the pool lock, as
# every read is: no torn reads).
_RECORD = struct.Struct(f"<4sHHqqqqqqd{_DEVICE_BYTES}s{_MODEL_BYTES}s")
_MAGIC = b"VAPE"
_VERSION = 1
_HEAD = struct.Struct("<4sHHqq")  # up to and including held: all a grant reads of another entry
_FIGURES = struct.Struct("<qqqqqd")  # held .. updated, rewritten as one
_FIGURES_AT = _HEAD.size - 8
_EPOCH_BYTES = 8
_POOL_FORMAT = 1


def _parse_file(filename: str) -> Optional[Tuple[str, str]]:
    """(pool name, kind) of a file of the pool directory, kind one of lock, pool, engine, tmp;
    None for anything else. Names may hold dots, so the fixed parts are split off the right."""
    stem, dot, kind = filename.rpartition(".")
    if not dot:
        return None
    if kind == "engine":
        parts = stem.rsplit(".", 2)
        if len(parts) != 3 or not parts[1].isdigit():
            return None
        stem = parts[0]
    elif kind == "tmp":
        stem = stem.rpartition(".")[0]
    elif kind not in ("lock", "pool"):
        return None
    return (stem, kind) if _NAME_RE.fullmatch(stem) else None


def _take_lock(path: str, fd: int) -> Tuple[int, bool]:
    """Hold ``flock(LOCK_EX)`` on the lock file at ``path``: through ``fd`` while that still
    names it, else through a fresh descriptor. Returns (descriptor, whether it is a fresh one).

    The last engine to leave removes the lock file (holding it), so a waiter may wake up holding
    a file nobody else will ever lock: an unlinked one (no links left) is dropped and the path
    opened again. Nothing else replaces the file, so one ``fstat`` tells.
    """
    fresh = False
    while True:
        if fd < 0:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, _FILE_MODE)
            fresh = True
        fcntl.flock(fd, fcntl.LOCK_EX)
        if os.fstat(fd).st_nlink > 0:
            return fd, fresh
        os.close(fd)
        fd = -1


def _owner_alive(fd: int) -> bool:
    """Whether the engine whose entry ``fd`` (a descriptor of ours) opens still holds its lock.
    The kernel drops a lock when its holder dies, so taking it here means the owner is gone."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    return False


def _held_of(head: bytes) -> int:
    """Held bytes of an entry's first bytes; 0 for a record this module did not write."""
    if len(head) < _HEAD.size:
        return 0
    magic, _, _, _, held = _HEAD.unpack(head[: _HEAD.size])
    return max(held, 0) if magic == _MAGIC else 0


@dataclasses.dataclass
class EngineInfo:
    """One live engine's entry, as the command line shows it."""

    pid: int
    model: str
    device: str
    held: int  # bytes granted and not given back
    live: int  # of held: memory live requests use
    cached: int  # of held: freed blocks kept for reuse (prefix cache)
    headroom: int  # of held: mapped ahead, not yet used
    max_bytes: int  # the most this engine may ever hold
    updated: float  # time.time() of the entry's last write


@dataclasses.dataclass
class PoolInfo:
    """One pool: its budget and its live engines."""

    name: str
    device: str
    budget_bytes: int
    engines: List[EngineInfo]
    created: float = 0.0  # time.time() when the pool's first engine set the budget

    @property
    def held(self) -> int:
        return sum(e.held for e in self.engines)

    @property
    def over_budget(self) -> int:
        """Bytes by which the engines hold more than the budget (after it shrank), else 0."""
        return max(self.held - self.budget_bytes, 0)


def _engine_info(filename: str, record: bytes) -> EngineInfo:
    pid = int(filename.rsplit(".", 3)[1])
    if len(record) < _RECORD.size or record[:4] != _MAGIC:
        return EngineInfo(pid, "?", "?", 0, 0, 0, 0, 0, 0.0)
    fields = _RECORD.unpack(record[: _RECORD.size])
    _, _, _, pid, held, live, cached, headroom, max_bytes, updated, device, model = fields
    text = [f.rstrip(b"\0").decode(errors="replace") for f in (device, model)]
    return EngineInfo(pid, text[1], text[0], held, live, cached, headroom, max_bytes, updated)


@dataclasses.dataclass
class _PoolRecord:
    budget_bytes: int
    device: str
    created: float


class _PoolFiles:
    """The paths of one pool and what is done to them; every method expects the pool lock held
    (through ``lock_fd`` where it takes one)."""

    def __init__(self, directory: str, name: str):
        self.directory, self.name = directory, name
        self.lock_path = os.path.join(directory, name + ".lock")
        self.pool_path = os.path.join(directory, name + ".pool")

    def path(self, filename: str) -> str:
        return os.path.join(self.directory, filename)

    def read_pool(self) -> Optional[_PoolRecord]:
        """The pool file's content; None when it is missing or not one this module wrote."""
        try:
            with open(self.pool_path, "rb") as f:
                data = json.loads(f.read())
            record = _PoolRecord(data["budget_bytes"], data["device"], float(data["created"]))
        except (OSError, ValueError, TypeError, KeyError):
            return None
        valid = (
            data.get("name") == self.name
            and type(record.budget_bytes) is int
            and 0 <= record.budget_bytes <= INT64_MAX
            and isinstance(record.device, str)
        )
        return record if valid else None

    def write_pool(self, record: _PoolRecord) -> None:
        """Replace the pool file whole: a process killed while writing leaves a temporary file
        (removed by the next scan), never a half-written pool file."""
        content = dict(format=_POOL_FORMAT, name=self.name, **dataclasses.asdict(record))
        tmp = self.path(f"{self.name}.{secrets.token_hex(4)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, _FILE_MODE)
        try:
            os.write(fd, json.dumps(content).encode())
        finally:
            os.close(fd)
        os.replace(tmp, self.pool_path)

    def scan(self, known: Dict[str, int], own: Optional[str]) -> Tuple[Dict[str, int], bool]:
        """The live entries but ``own``: filename -> a descriptor of ours on it (reusing those in
        ``known``, closing the rest). Dead entries and temporary files are removed; the flag says
        whether an entry was (the pool changed)."""
        live: Dict[str, int] = {}
        removed = False
        try:
            filenames = os.listdir(self.directory)
        except FileNotFoundError:
            filenames = []
        for filename in filenames:
            parsed = _parse_file(filename)
            if parsed is None or parsed[0] != self.name or filename == own:
                continue
            if parsed[1] == "tmp":
                _unlink(self.path(filename))  # writes happen under the lock we hold: abandoned
            if parsed[1] != "engine":
                continue
            fd = known.pop(filename, -1)
            if fd < 0:
                try:
                    fd = os.open(self.path(filename), os.O_RDONLY | os.O_CLOEXEC)
                except FileNotFoundError:
                    continue
            if _owner_alive(fd):
                live[filename] = fd
            else:
                _unlink(self.path(filename))
                os.close(fd)
                removed = True
        for fd in known.values():  # entries gone since: their engines left
            os.close(fd)
        known.clear()
        return live, removed

    def others_held(self, entries: Dict[str, int]) -> Tuple[int, bool]:
        """Sum of the live ``entries``' held bytes; dead ones are removed from the directory and
        from ``entries`` (the flag says whether any was)."""
        total, dead = 0, []
        for filename, fd in entries.items():
            if _owner_alive(fd):
                total += _held_of(os.pread(fd, _HEAD.size, 0))
            else:
                dead.append(filename)
        for filename in dead:
            _unlink(self.path(filename))
            os.close(entries.pop(filename))
        return total, bool(dead)

    def remove_pool(self) -> None:
        """Remove the pool file, then the lock file (still held: its waiters see it unlinked and
        start over on a fresh one)."""
        _unlink(self.pool_path)
        _unlink(self.lock_path)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _read_epoch(lock_fd: int) -> bytes:
    return os.pread(lock_fd, _EPOCH_BYTES, 0)


def _bump_epoch(lock_fd: int) -> bytes:
    """Count one change of the pool (an entry added or removed, the budget set) in its lock
    file, which every ledger reads before trusting what it cached of the pool."""
    old = _read_epoch(lock_fd)
    count = int.from_bytes(old, "little") + 1 if len(old) == _EPOCH_BYTES else 1
    new = (count % (1 << 64)).to_bytes(_EPOCH_BYTES, "little")
    os.pwrite(lock_fd, new, 0)
    return new


# ---- a ledger's descriptors, and fork -----------------------------------------------------------


class _Handles:
    """A pool ledger's descriptors and mutex. Apart from the ledger so that a dropped ledger
    (finalizer) and a forked child can close them without touching the files: a flock belongs to
    the open file description, which fork shares, so a child that kept the descriptor would keep
    its parent's entry alive after the parent died."""

    def __init__(self) -> None:
        self.mutex = threading.Lock()
        self.lock_fd = -1
        self.entry_fd = -1
        self.others: Dict[str, int] = {}  # live entries of the pool's other engines

    def close_all(self) -> None:
        for fd in (self.lock_fd, self.entry_fd, *self.others.values()):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.lock_fd = self.entry_fd = -1
        self.others = {}


_HANDLES: weakref.WeakSet[_Handles] = weakref.WeakSet()


def _detach_in_child() -> None:
    for handles in list(_HANDLES):
        handles.close_all()
        handles.mutex = threading.Lock()  # another thread may have held it at fork


os.register_at_fork(after_in_child=_detach_in_child)


# ---- ledgers ------------------------------------------------------------------------------------


class Ledger:
    """What an engine's block pool asks before it maps memory: one engine's held bytes under a
    budget. :class:`PoolLedger` shares the budget with other processes, :class:`LocalLedger` is
    one engine alone. Both are thread-safe."""

    name: str
    device: str
    model: str
    max_bytes: int
    _held: int
    _figures: Tuple[int, int, int]

    @property
    def held(self) -> int:
        """This engine's held bytes: granted and not given back."""
        return self._held

    @property
    def budget_bytes(self) -> int:
        raise NotImplementedError

    def try_grow(self, nbytes: int, unit: int = 1) -> int:
        """Grant the largest multiple of ``unit`` no larger than ``nbytes`` that fits the budget
        (less what the other live engines and this one hold) and ``max_bytes``; returns the
        bytes granted (0 if none), which ``held`` now includes."""
        return self._grant(_check_bytes(nbytes, "nbytes"), _check_unit(unit))

    def grow(self, nbytes: int) -> bool:
        """Grant all ``nbytes`` or nothing; whether it was granted."""
        nbytes = _check_bytes(nbytes, "nbytes")
        return nbytes == 0 or self._grant(nbytes, nbytes) == nbytes

    def _grant(self, nbytes: int, unit: int) -> int:
        raise NotImplementedError

    def _check_lower(self, nbytes: object) -> int:
        n = _check_bytes(nbytes, "nbytes")
        if n > self._held:
            raise ConfigError(
                f"set_held({n}) would raise held from {self._held} bytes: set_held only gives "
                "memory back; raise it with grow() or try_grow(), which check the budget"
            )
        return n

    def set_held(self, nbytes: int) -> None:
        """Lower this engine's held bytes to ``nbytes`` (memory given back). Raising goes through
        :meth:`grow` or :meth:`try_grow`, which check the budget: ConfigError here."""
        raise NotImplementedError

    def available(self) -> int:
        """Bytes a grant could give this engine now (nothing is granted)."""
        raise NotImplementedError

    def over_budget(self) -> int:
        """Bytes by which the engines hold more than the budget: 0, unless the budget shrank
        below what they hold (:func:`set_budget`); each engine then gives back cached memory."""
        raise NotImplementedError

    def report(self, *, live: int, cached: int, headroom: int) -> None:
        """Record how this engine's held bytes are used (live requests, cached blocks, headroom
        mapped ahead), for ``python -m vattention pool``."""
        raise NotImplementedError

    @property
    def figures(self) -> Tuple[int, int, int]:
        """(live, cached, headroom) as last reported."""
        return self._figures

    @property
    def closed(self) -> bool:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalLedger(Ledger):
    """The ledger of an engine outside any pool: the budget is its own ``max_bytes``; no files,
    no other process."""

    def __init__(self, max_bytes: Union[int, str], *, device: str = "cpu", model: str = ""):
        self.name = ""
        self.device = _check_device(device)
        self.model = _check_model(model)
        self.max_bytes = parse_size(max_bytes, name="max_bytes")
        self._held = 0
        self._figures = (0, 0, 0)
        self._mutex = threading.Lock()
        self._open = True

    @property
    def budget_bytes(self) -> int:
        return self.max_bytes

    @property
    def closed(self) -> bool:
        return not self._open

    def _check_open(self) -> None:
        if not self._open:
            raise CacheClosedError("local ledger was used after close()")

    def _grant(self, nbytes: int, unit: int) -> int:
        with self._mutex:
            self._check_open()
            granted = _fit(nbytes, unit, self.max_bytes - self._held)
            self._held += granted
            return granted

    def set_held(self, nbytes: int) -> None:
        with self._mutex:
            self._check_open()
            self._held = self._check_lower(nbytes)

    def available(self) -> int:
        self._check_open()
        return max(self.max_bytes - self._held, 0)

    def over_budget(self) -> int:
        self._check_open()
        return 0  # grants never pass max_bytes, and nothing else changes the budget

    def report(self, *, live: int, cached: int, headroom: int) -> None:
        figures = (
            _check_bytes(live, "live"),
            _check_bytes(cached, "cached"),
            _check_bytes(headroom, "headroom"),
        )
        self._check_open()
        self._figures = figures

    def close(self) -> None:
        self._open = False

    def __repr__(self) -> str:
        return f"LocalLedger(held={self._held}, max_bytes={self.max_bytes})"


class PoolLedger(Ledger):
    """One engine's entry in pool ``name``: its grants count against the budget all the pool's
    live engines share. Create with :meth:`join`; :meth:`close` (or the end of the process,
    however it ends) gives the entry's bytes back.

    Every call that reads or changes the pool takes the pool lock, reads the other live entries
    (a dead engine's entry is removed on the spot) and, for a grant, rewrites this entry, all
    before letting go: grants are whole under the lock, never check-then-allocate.
    """

    def __init__(
        self,
        name: str,
        budget_bytes: Union[int, str],
        *,
        device: str,
        model: str,
        max_bytes: Union[int, str],
        directory: Optional[str] = None,
    ):
        self.name = _check_name(name)
        budget = parse_size(budget_bytes, name="budget_bytes")
        self.device = _check_device(device)
        self.model = _check_model(model)
        self.max_bytes = parse_size(max_bytes, name="max_bytes")
        self.directory = pool_directory(directory)
        self.pid = os.getpid()
        self._files = _PoolFiles(self.directory, self.name)
        self._held = 0
        self._figures = (0, 0, 0)
        self._budget = budget
        self._created = 0.0
        self._epoch: Optional[bytes] = None  # the lock file's count when self._h.others was read
        self._entry = ""
        self._h = _Handles()
        _HANDLES.add(self._h)
        weakref.finalize(self, _Handles.close_all, self._h)
        try:
            _private_directory(self.directory, create=True)
            self._join(budget)
        except BaseException:
            self._h.close_all()
            raise

    @classmethod
    def join(
        cls,
        name: str,
        budget_bytes: Union[int, str],
        *,
        device: str,
        model: str,
        max_bytes: Union[int, str],
        directory: Optional[str] = None,
    ) -> PoolLedger:
        """Join pool ``name`` with an entry holding 0 bytes.

        The first engine of a pool (also the first after all others left or died) sets its
        budget and device; a later one must give the same, else :class:`ConfigError` names both.
        ``max_bytes`` is the most this engine may ever hold (its own KV cache size). The
        directory is created (mode 0700) where missing; one that another user owns or can write
        in raises :class:`ConfigError` naming it and its owner, and nothing is created in it.
        """
        return cls(
            name, budget_bytes, device=device, model=model, max_bytes=max_bytes, directory=directory
        )

    def _join(self, budget: int) -> None:
        h, files = self._h, self._files
        h.lock_fd, _ = _take_lock(files.lock_path, -1)
        try:
            h.others, _ = files.scan({}, own=None)
            pool = files.read_pool()
            if h.others:
                pool = self._check_joinable(pool, budget)
            else:
                pool = _PoolRecord(budget, self.device, time.time())
                files.write_pool(pool)
            self._budget, self._created = pool.budget_bytes, pool.created
            self._entry = f"{self.name}.{self.pid}.{secrets.token_hex(4)}.engine"
            flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
            h.entry_fd = os.open(files.path(self._entry), flags, _FILE_MODE)
            fcntl.flock(h.entry_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            _pause("join-created")
            os.pwrite(h.entry_fd, self._record(), 0)
            self._epoch = _bump_epoch(h.lock_fd)
        except BaseException:
            if self._entry:
                _unlink(files.path(self._entry))
            raise
        finally:
            fcntl.flock(h.lock_fd, fcntl.LOCK_UN)

    def _check_joinable(self, pool: Optional[_PoolRecord], budget: int) -> _PoolRecord:
        pids = sorted(int(f.rsplit(".", 3)[1]) for f in self._h.others)
        if pool is None:
            raise ConfigError(
                f"pool {self.name!r}: {self._files.pool_path} is unreadable while engines "
                f"(pids {pids}) hold entries; it was not written by vattention"
            )
        if pool.device != self.device:
            raise ConfigError(
                f"pool {self.name!r} is on device {pool.device!r}, this engine on "
                f"{self.device!r}: a pool's engines share one device's memory (name another "
                "pool for this device)"
            )
        if pool.budget_bytes != budget:
            raise ConfigError(
                f"pool {self.name!r} has a budget of {pool.budget_bytes} bytes, this engine "
                f"gives {budget} bytes: the engines of a pool give the same budget (pids {pids} "
                f"are in it; `python -m vattention pool {self.name} --budget SIZE` changes it)"
            )
        return pool

    def _record(self) -> bytes:
        live, cached, headroom = self._figures
        figures = (self._held, live, cached, headroom, self.max_bytes, time.time())
        text = (self.device.encode(), self.model.encode()[:_MODEL_BYTES])
        return _RECORD.pack(_MAGIC, _VERSION, 0, self.pid, *figures, *text)

    def _write_figures(self, held: int, figures: Tuple[int, int, int]) -> None:
        live, cached, headroom = figures
        packed = _FIGURES.pack(held, live, cached, headroom, self.max_bytes, time.time())
        os.pwrite(self._h.entry_fd, packed, _FIGURES_AT)

    # ---- the pool lock and what is read under it ----

    def _lock(self) -> None:
        """Take the pool lock (the mutex held). Raises CacheClosedError after close()."""
        h = self._h
        if h.entry_fd < 0:
            raise CacheClosedError(
                f"pool ledger {self.name!r} was used after close() (or in a forked child of the "
                f"process that joined, pid {self.pid})"
            )
        h.lock_fd, fresh = _take_lock(self._files.lock_path, h.lock_fd)
        if fresh:
            self._epoch = None

    def _unlock(self) -> None:
        fcntl.flock(self._h.lock_fd, fcntl.LOCK_UN)

    def _refresh(self) -> int:
        """Bring the cached budget and entries up to date (the lock held) and return the other
        live engines' held bytes."""
        h, files = self._h, self._files
        epoch = _read_epoch(h.lock_fd)
        if epoch != self._epoch:
            pool = files.read_pool()
            if pool is None:
                # Only written whole (rename), so damage is not ours: put back what we know.
                files.write_pool(_PoolRecord(self._budget, self.device, self._created))
            else:
                self._budget = pool.budget_bytes
            h.others, removed = files.scan(h.others, own=self._entry)
            self._epoch = _bump_epoch(h.lock_fd) if removed else epoch
        others, removed = files.others_held(h.others)
        if removed:
            self._epoch = _bump_epoch(h.lock_fd)
        return others

    # ---- the calls ----

    @property
    def budget_bytes(self) -> int:
        """The pool's budget now (read under the lock; the last known value after close())."""
        with self._h.mutex:
            if self._h.entry_fd < 0:
                return self._budget
            self._lock()
            try:
                self._refresh()
                return self._budget
            finally:
                self._unlock()

    @property
    def closed(self) -> bool:
        return self._h.entry_fd < 0

    def _grant(self, nbytes: int, unit: int) -> int:
        with self._h.mutex:
            self._lock()
            try:
                _pause("locked")
                others = self._refresh()
                room = min(self._budget - others, self.max_bytes) - self._held
                granted = _fit(nbytes, unit, room)
                _pause("read")
                if granted:
                    self._write_figures(self._held + granted, self._figures)
                    _pause("written")
                    self._held += granted
                _pause("unlocking")
                return granted
            finally:
                self._unlock()

    def set_held(self, nbytes: int) -> None:
        with self._h.mutex:
            n = self._check_lower(nbytes)
            if n == self._held:
                return
            self._lock()
            try:
                self._write_figures(n, self._figures)
                self._held = n
            finally:
                self._unlock()

    def available(self) -> int:
        with self._h.mutex:
            self._lock()
            try:
                others = self._refresh()
                return max(min(self._budget - others, self.max_bytes) - self._held, 0)
            finally:
                self._unlock()

    def over_budget(self) -> int:
        with self._h.mutex:
            self._lock()
            try:
                others = self._refresh()
                return max(others + self._held - self._budget, 0)
            finally:
                self._unlock()

    def report(self, *, live: int, cached: int, headroom: int) -> None:
        """(See :meth:`Ledger.report`.) Unchanged figures are not written again."""
        figures = (
            _check_bytes(live, "live"),
            _check_bytes(cached, "cached"),
            _check_bytes(headroom, "headroom"),
        )
        with self._h.mutex:
            if figures == self._figures:
                return
            self._lock()
            try:
                self._write_figures(self._held, figures)
                self._figures = figures
            finally:
                self._unlock()

    def close(self) -> None:
        """Remove this engine's entry (its bytes go back to the pool) and, when it was the last,
        the pool's files. Idempotent; a no-op in a forked child."""
        h, files = self._h, self._files
        with h.mutex:
            if h.entry_fd < 0:
                return
            try:
                self._lock()
                _unlink(files.path(self._entry))
                _pause("close-unlinked")
                os.close(h.entry_fd)
                h.entry_fd = -1
                h.others, _ = files.scan(h.others, own=None)
                if h.others:
                    _bump_epoch(h.lock_fd)
                else:
                    files.remove_pool()
            finally:
                h.close_all()  # drops the locks: a failure above leaves a dead entry, no more

    def __repr__(self) -> str:
        return (
            f"PoolLedger(name={self.name!r}, device={self.device!r}, model={self.model!r}, "
            f"held={self._held}, max_bytes={self.max_bytes}, pid={self.pid})"
        )


def ledger_from_env(
    *,
    device: str,
    model: str,
    max_bytes: Union[int, str],
    environ: Optional[Mapping[str, str]] = None,
    directory: Optional[str] = None,
) -> Ledger:
    """The ledger the environment asks for: a :class:`PoolLedger` joined to
    ``$VATTENTION_VLLM_POOL`` with budget ``$VATTENTION_VLLM_POOL_BYTES``, else (no pool named)
    a :class:`LocalLedger`."""
    env = os.environ if environ is None else environ
    name = env.get(ENV_POOL)
    if not name:
        return LocalLedger(max_bytes, device=device, model=model)
    size = env.get(ENV_POOL_BYTES)
    if not size:
        raise ConfigError(
            f"{ENV_POOL}={name!r} needs {ENV_POOL_BYTES}, the pool's budget (bytes or a size "
            "such as '8GiB')"
        )
    budget = parse_size(size, name=ENV_POOL_BYTES)
    return PoolLedger.join(
        name, budget, device=device, model=model, max_bytes=max_bytes, directory=directory
    )


# ---- the pools of a directory (the command line) ------------------------------------------------


def _read_state(files: _PoolFiles, lock_fd: int) -> Tuple[Optional[_PoolRecord], List[EngineInfo]]:
    """The pool file and the live engines' entries (the lock held); dead entries removed."""
    entries, removed = files.scan({}, own=None)
    try:
        engines = [_engine_info(f, os.pread(fd, _RECORD.size, 0)) for f, fd in entries.items()]
    finally:
        for fd in entries.values():
            os.close(fd)
    if removed:
        _bump_epoch(lock_fd)
    return files.read_pool(), sorted(engines, key=lambda e: e.pid)


def list_pools(directory: Optional[str] = None) -> List[PoolInfo]:
    """Every pool of the directory, by name, with its live engines. Dead engines' entries are
    removed as they are found; a pool left without a live engine is listed once with none and
    its files removed (its next engine sets the budget afresh anyway). A directory that is not
    this user's alone raises :class:`ConfigError` (see the module's docstring)."""
    directory = pool_directory(directory)
    if not _private_directory(directory, create=False):
        return []
    try:
        filenames = os.listdir(directory)
    except FileNotFoundError:
        return []
    names = sorted({p[0] for p in map(_parse_file, filenames) if p is not None})
    pools = []
    for name in names:
        files = _PoolFiles(directory, name)
        lock_fd, _ = _take_lock(files.lock_path, -1)
        try:
            pool, engines = _read_state(files, lock_fd)
            if not engines:
                files.remove_pool()
            if pool is not None:
                pools.append(PoolInfo(name, pool.device, pool.budget_bytes, engines, pool.created))
            elif engines:  # a pool file someone else damaged: its engines put it back
                pools.append(PoolInfo(name, engines[0].device, 0, engines))
        finally:
            os.close(lock_fd)
    return pools


def set_budget(
    name: str, budget_bytes: Union[int, str], directory: Optional[str] = None
) -> PoolInfo:
    """Change pool ``name``'s budget while its engines run; returns the pool afterwards.

    A budget below what the engines hold is allowed: no running request fails; the engines see
    it through ``over_budget()`` and give back cached memory. A pool that does not exist, or
    has no live engine (its next engine sets the budget), raises :class:`ConfigError`, as does a
    directory that is not this user's alone.
    """
    name = _check_name(name)
    budget = parse_size(budget_bytes, name="budget_bytes")
    directory = pool_directory(directory)
    _private_directory(directory, create=False)
    files = _PoolFiles(directory, name)
    if not os.path.exists(files.pool_path):  # no lock file is made for a pool that is not there
        raise _unknown_pool(name, directory)
    lock_fd, _ = _take_lock(files.lock_path, -1)
    try:
        pool, engines = _read_state(files, lock_fd)
        if engines:
            if pool is None:  # damaged by someone else: the budget is being set anyway
                pool = _PoolRecord(budget, engines[0].device, time.time())
            pool.budget_bytes = budget
            files.write_pool(pool)
            _bump_epoch(lock_fd)
            return PoolInfo(name, pool.device, budget, engines, pool.created)
        files.remove_pool()
    finally:
        os.close(lock_fd)
    if pool is None:
        raise _unknown_pool(name, directory)
    raise ConfigError(f"pool {name!r} has no live engine: the next engine to join sets its budget")


def _unknown_pool(name: str, directory: str) -> ConfigError:
    try:
        filenames = os.listdir(directory)
    except FileNotFoundError:
        filenames = []
    known = sorted({p[0] for p in map(_parse_file, filenames) if p and p[1] == "pool"})
    return ConfigError(
        f"no pool named {name!r} in {directory} (pools there: {', '.join(known) or 'none'})"
    )
