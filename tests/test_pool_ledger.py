"""Pools: engines in separate processes share one KV memory budget (vattention.pool_ledger).

Grants are whole under a lock every process takes; a process killed anywhere (mid-grant
included) gives its bytes back without anyone's help; nothing a dead process leaves behind makes
the budget look smaller; ``python -m vattention pool`` lists pools and changes budgets.

Other processes are forked (multiprocessing's "fork" context: no interpreter start, no torch
import); a forked child of a process that holds a ledger does not keep that ledger's entry alive,
which these tests rely on and check. Each stop point of a grant is reached through
``pool_ledger.pause_hook``, set in the child.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vattention import pool_ledger
from vattention.__main__ import main as cli_main
from vattention.errors import ArgumentTypeError, CacheClosedError, ConfigError
from vattention.pool_ledger import (
    PAUSE_POINTS,
    LocalLedger,
    PoolLedger,
    ledger_from_env,
    list_pools,
    set_budget,
)

ROOT = Path(__file__).resolve().parent.parent
FORK = multiprocessing.get_context("fork")
GRANT_POINTS = ("locked", "read", "written", "unlocking")
MiB = 1 << 20


def join(directory, name="p", budget=1000, *, model="m", max_bytes=1000, device="cpu"):
    return PoolLedger.join(
        name, budget, device=device, model=model, max_bytes=max_bytes, directory=str(directory)
    )


def engines(directory, name="p"):
    """{pid: held} of pool ``name``'s live engines, as a listing sees them."""
    pools = {p.name: p for p in list_pools(str(directory))}
    return {e.pid: e.held for e in pools[name].engines} if name in pools else {}


@pytest.fixture
def pool_dir(tmp_path):
    directory = tmp_path / "pools"
    yield directory
    # Every test leaves no live engine behind: a listing then removes all files.
    list_pools(str(directory))
    assert not directory.exists() or list(directory.iterdir()) == []


@pytest.fixture
def children():
    """Start ``target(conn, *args)`` in a forked process: (process, our end of its pipe). Any
    still alive at the end (stopped ones included) are killed."""
    started = []

    def start(target, *args):
        ours, theirs = FORK.Pipe()
        proc = FORK.Process(target=target, args=(theirs, *args), daemon=True)
        proc.start()
        theirs.close()
        started.append(proc)
        return proc, ours

    yield start
    for proc in started:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)


@pytest.fixture
def deadline():
    """Fail, rather than hang, when a call blocks on a lock a dead process should have lost."""

    def expire(signum, frame):
        raise TimeoutError("a pool call blocked for 20 s: a lock outlived its process")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def kill(proc):
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    assert proc.exitcode == -signal.SIGKILL


def stop_at(conn, point):
    """In a child: report reaching ``point``, then stop there until killed."""

    def hook(reached):
        if reached == point:
            conn.send(reached)
            os.kill(os.getpid(), signal.SIGSTOP)

    pool_ledger.pause_hook = hook


# ---- one process --------------------------------------------------------------------------------


def test_grants_fit_the_budget_in_whole_units(pool_dir):
    with join(pool_dir, model="a") as a, join(pool_dir, model="b") as b:
        assert a.budget_bytes == b.budget_bytes == 1000
        assert a.try_grow(650, unit=100) == 600 and a.held == 600
        assert b.available() == 400
        assert b.try_grow(450, unit=100) == 400 and b.held == 400
        assert b.try_grow(1) == 0 and not b.grow(1) and b.grow(0)
        a.set_held(250)
        assert b.try_grow(999, unit=300) == 300 and b.held == 700
        assert not a.grow(51) and a.grow(50) and a.held == 300
        assert a.available() == b.available() == 0 and a.over_budget() == 0
        (pool,) = list_pools(str(pool_dir))
        assert sorted((e.model, e.held) for e in pool.engines) == [("a", 300), ("b", 700)]


def test_max_bytes_caps_one_engine(pool_dir):
    with join(pool_dir, max_bytes=300) as a, join(pool_dir, max_bytes=2000) as b:
        assert a.try_grow(1000) == 300 and a.available() == 0
        assert b.available() == 700 and b.try_grow(2000, unit=200) == 600


def test_set_held_only_gives_back(pool_dir):
    with join(pool_dir) as a:
        a.try_grow(500)
        with pytest.raises(ConfigError, match=r"set_held\(600\) would raise held from 500"):
            a.set_held(600)
        a.set_held(500)
        a.set_held(0)
        assert a.held == 0 and a.available() == 1000


def test_budget_mismatch_is_refused_naming_both_sizes(pool_dir):
    with join(pool_dir, budget=1000) as a:
        with pytest.raises(ConfigError, match=r"budget of 1000 bytes.* gives 2000 bytes") as e:
            join(pool_dir, budget=2000)
        assert f"pids [{os.getpid()}]" in str(e.value) and "--budget" in str(e.value)
        assert a.budget_bytes == 1000 and len(engines(pool_dir)) == 1
        with join(pool_dir, budget="1000"):  # a size string names the same budget
            pass


def test_device_mismatch_is_refused_naming_both(pool_dir):
    with join(pool_dir, device="cuda:0"):
        with pytest.raises(ConfigError, match=r"device 'cuda:0', this engine on 'cuda:1'"):
            join(pool_dir, device="cuda:1")
        with join(pool_dir, name="p1", device="cuda:1") as other:  # another pool: fine
            assert other.device == "cuda:1"


@pytest.mark.parametrize("name", ["", ".hidden", "a/b", "x" * 65, "a b", "ü", "p\n"])
def test_bad_pool_names_are_refused_with_the_rule(pool_dir, name):
    with pytest.raises(ConfigError, match=r"pool name .* is not valid: use 1 to 64 of") as e:
        join(pool_dir, name=name)
    assert repr(name) in str(e.value)
    with pytest.raises(ConfigError, match="is not valid"):
        set_budget(name, 10, str(pool_dir))


def test_good_pool_names_with_dots_stay_apart(pool_dir):
    # Pool names may contain dots: "a" and "a.1" (and "a.lock") are distinct pools.
    with join(pool_dir, "a", 100) as a, join(pool_dir, "a.1", 200) as b:
        with join(pool_dir, "a.lock", 300), join(pool_dir, "x" * 64, 400):
            assert a.try_grow(1000) == 100 and b.try_grow(1000) == 200
            budgets = {p.name: (p.budget_bytes, p.held) for p in list_pools(str(pool_dir))}
            expected = {"a": (100, 100), "a.1": (200, 200), "a.lock": (300, 0), "x" * 64: (400, 0)}
            assert budgets == expected


def test_bad_arguments_get_typed_errors(pool_dir):
    with pytest.raises(ArgumentTypeError, match="must be a str"):
        join(pool_dir, name=3)
    with pytest.raises(ConfigError, match="budget_bytes"):
        join(pool_dir, budget=-1)
    with pytest.raises(ConfigError, match="device"):
        join(pool_dir, device="")
    with join(pool_dir) as a:
        with pytest.raises(ArgumentTypeError, match=r"nbytes=1.5 must be an int"):
            a.try_grow(1.5)
        with pytest.raises(ArgumentTypeError, match="got a bool"):
            a.grow(True)
        with pytest.raises(ConfigError, match=r"nbytes=-1 must be in \[0, "):
            a.try_grow(-1)
        with pytest.raises(ConfigError, match=r"unit=0 must be in \[1, "):
            a.try_grow(10, unit=0)
        with pytest.raises(ConfigError, match="live=-2"):
            a.report(live=-2, cached=0, headroom=0)
        assert a.held == 0


def test_close_is_idempotent_and_the_last_removes_the_files(pool_dir):
    a, b = join(pool_dir), join(pool_dir)
    a.try_grow(700)
    a.close()
    a.close()
    assert a.closed and a.budget_bytes == 1000
    with pytest.raises(CacheClosedError, match="used after close"):
        a.try_grow(1)
    assert b.try_grow(1000) == 1000
    b.close()
    assert list(pool_dir.iterdir()) == []


# ---- the files are their user's alone ------------------------------------------------------------

OTHER_UID = 12345  # a user with no name on this machine: chown to it needs root
needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="giving a file to another user needs root"
)


def _modes(directory):
    return {p.name.rsplit(".", 1)[1]: oct(p.stat().st_mode & 0o777) for p in directory.iterdir()}


def test_the_directory_and_files_are_private_to_their_user(pool_dir):
    old = os.umask(0)  # what the files get is the ledger's own choice, not the umask's
    try:
        with join(pool_dir, "kv") as a:
            set_budget("kv", 2000, str(pool_dir))  # the pool file written again (rename)
            assert a.budget_bytes == 2000
            assert oct(pool_dir.stat().st_mode & 0o777) == oct(0o700)
            assert _modes(pool_dir) == {"lock": "0o600", "pool": "0o600", "engine": "0o600"}
    finally:
        os.umask(old)


def test_a_directory_others_can_only_read_is_used(pool_dir):
    pool_dir.mkdir(mode=0o755)
    pool_dir.chmod(0o755)
    with join(pool_dir, "kv") as a:
        assert a.try_grow(10) == 10 and engines(pool_dir, "kv") == {os.getpid(): 10}


def _refused(directory, pattern):
    """Every entry point refuses ``directory`` with ``pattern`` and creates nothing in it."""
    before = sorted(os.listdir(directory))
    with pytest.raises(ConfigError, match=pattern):
        join(directory, "kv")
    with pytest.raises(ConfigError, match=pattern):
        list_pools(str(directory))
    with pytest.raises(ConfigError, match=pattern):
        set_budget("kv", 10, str(directory))
    assert sorted(os.listdir(directory)) == before
    proc = _pool_cli(directory)
    assert proc.returncode == 2 and "error: pool directory" in proc.stderr, proc.stderr


@needs_root
def test_a_directory_another_user_owns_is_refused_naming_it_and_its_owner(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, OTHER_UID, -1)
    me = f"uid {os.geteuid()}"
    _refused(theirs, rf"pool directory {theirs} is owned by uid {OTHER_UID}, not by .*{me}")


@needs_root
def test_a_link_another_user_owns_is_refused_even_to_a_directory_of_ours(tmp_path):
    ours = tmp_path / "ours"
    ours.mkdir(mode=0o700)
    link = tmp_path / "link"  # as another user of a shared /dev/shm could place it
    link.symlink_to(ours)
    os.lchown(link, OTHER_UID, -1)
    _refused(link, rf"pool directory {link} is a link owned by uid {OTHER_UID}")


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o1777], ids=["group", "other", "sticky"])
def test_a_directory_others_can_write_in_is_refused(tmp_path, mode):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    owner = f"uid {os.geteuid()}"
    _refused(shared, rf"pool directory {shared} \(owner {owner}.*\) has mode {mode:04o}: others")


def test_a_pool_directory_that_is_a_file_is_refused(tmp_path):
    path = tmp_path / "file"
    path.write_text("")
    with pytest.raises(ConfigError, match=f"pool directory {path} is not a directory"):
        join(path, "kv")


def test_a_pool_all_engines_left_takes_the_next_budget(pool_dir):
    with join(pool_dir, budget=1000, device="cuda:0"):
        pass
    with join(pool_dir, budget=2000, device="cuda:1") as a:
        assert a.budget_bytes == 2000 and a.try_grow(5000, unit=1) == 1000  # max_bytes


def test_set_budget_shrinks_below_held_and_engines_see_it(pool_dir):
    with join(pool_dir, max_bytes=1000) as a, join(pool_dir, max_bytes=1000) as b:
        a.try_grow(600)
        b.try_grow(300)
        info = set_budget("p", 700, str(pool_dir))
        assert (info.budget_bytes, info.held, info.over_budget) == (700, 900, 200)
        assert a.budget_bytes == 700 and a.over_budget() == b.over_budget() == 200
        assert b.try_grow(1) == 0 and b.available() == 0
        a.set_held(300)  # the engine gave back cached memory
        assert a.over_budget() == 0 and b.try_grow(500) == 100
        set_budget("p", "1KiB", str(pool_dir))
        assert b.available() == 1024 - 700
        # A later engine joins with the pool's budget as it is now.
        with pytest.raises(ConfigError, match="budget of 1024 bytes"):
            join(pool_dir, budget=1000)
    with pytest.raises(ConfigError, match=r"no pool named 'p' in .*pools there: none"):
        set_budget("p", 10, str(pool_dir))


def test_report_figures_are_listed(pool_dir):
    with join(pool_dir, model="llama", max_bytes=900, device="cuda:0") as a:
        a.try_grow(600)
        a.report(live=400, cached=150, headroom=50)
        (pool,) = list_pools(str(pool_dir))
        (e,) = pool.engines
        assert (pool.name, pool.device, pool.budget_bytes, pool.held) == ("p", "cuda:0", 1000, 600)
        assert (e.pid, e.model, e.device, e.held) == (os.getpid(), "llama", "cuda:0", 600)
        assert (e.live, e.cached, e.headroom, e.max_bytes) == (400, 150, 50, 900)
        assert abs(e.updated - time.time()) < 60 and a.figures == (400, 150, 50)


def test_local_ledger_has_the_same_calls(pool_dir):
    with LocalLedger(1000, device="cuda:0", model="m") as a:
        assert a.budget_bytes == 1000 and a.try_grow(650, unit=100) == 600
        assert not a.grow(401) and a.grow(400) and a.available() == 0
        a.set_held(100)
        assert a.held == 100 and a.over_budget() == 0
        with pytest.raises(ConfigError, match="would raise held"):
            a.set_held(101)
        a.report(live=1, cached=2, headroom=3)
        assert a.figures == (1, 2, 3)
    assert a.closed and not pool_dir.exists()
    with pytest.raises(CacheClosedError):
        a.try_grow(1)


def test_ledger_from_env(pool_dir):
    env = {"VATTENTION_POOL_DIR": str(pool_dir)}
    local = ledger_from_env(device="cpu", model="m", max_bytes=500, environ=env)
    assert isinstance(local, LocalLedger) and local.budget_bytes == 500
    env["VATTENTION_VLLM_POOL"] = "shared"
    with pytest.raises(ConfigError, match="VATTENTION_VLLM_POOL='shared' needs VATTENTION_VLLM"):
        ledger_from_env(device="cpu", model="m", max_bytes=500, environ=env)
    env["VATTENTION_VLLM_POOL_BYTES"] = "2KiB"
    with ledger_from_env(
        device="cpu", model="m", max_bytes=500, environ=env, directory=str(pool_dir)
    ) as led:
        assert isinstance(led, PoolLedger) and (led.name, led.budget_bytes) == ("shared", 2048)


# ---- several processes --------------------------------------------------------------------------

BUDGET, WORKER_MAX = 1000, 600
# The hammer is counted, not timed (a loaded 2-core machine runs a fraction of a fast one's
# operations in a second): each worker runs until it has been granted WORKER_GRANTS times and the
# test has read the pool SAMPLES times, killing one worker at sample KILL_AT, mid-run.
WORKER_GRANTS, SAMPLES, KILL_AT = 50, 40, 10


def _hammer(conn, directory, seed):
    rng = random.Random(seed)
    led = join(directory, budget=BUDGET, max_bytes=WORKER_MAX, model=f"w{seed}")
    conn.send("joined")
    grants, stop = 0, False
    while grants < WORKER_GRANTS or not stop:
        r = rng.random()
        if r < 0.45:
            grants += bool(led.try_grow(rng.randrange(1, 400), unit=rng.choice((1, 7, 64))))
        elif r < 0.6:
            grants += led.grow(rng.randrange(1, 300))
        elif r < 0.95:
            led.set_held(rng.randrange(0, led.held + 1))
        else:
            led.report(live=led.held, cached=0, headroom=0)
        assert led.held <= WORKER_MAX
        stop = stop or conn.poll()
    assert conn.recv() == "stop"
    conn.send((led.held, grants))
    conn.recv()  # keep the entry until the listing has been compared
    led.close()


def test_concurrent_grants_never_exceed_the_budget(pool_dir, children, deadline):
    workers = [children(_hammer, str(pool_dir), seed) for seed in range(4)]
    assert all(conn.recv() == "joined" for _, conn in workers)
    peak, sample = 0, 0
    # until the budget has been contended too (more than half held at once); `deadline` guards
    # against a hang
    while sample < SAMPLES or peak <= BUDGET // 2:
        assert all(proc.exitcode is None for proc, _ in workers[1:]), "a worker failed"
        for pool in list_pools(str(pool_dir)):  # each pool read whole under its lock
            assert pool.held <= pool.budget_bytes == BUDGET, pool
            assert all(e.held <= WORKER_MAX for e in pool.engines), pool
            peak = max(peak, pool.held)
        if sample == KILL_AT:
            kill(workers[0][0])  # mid-run, whatever it was doing: its bytes go back
        sample += 1
    for _, conn in workers[1:]:
        conn.send("stop")
    results = {proc.pid: conn.recv() for proc, conn in workers[1:]}
    assert all(grants >= WORKER_GRANTS for _, grants in results.values()), results
    assert engines(pool_dir) == {pid: held for pid, (held, _) in results.items()}
    for proc, conn in workers[1:]:
        conn.send("close")
        proc.join(10)
        assert proc.exitcode == 0
    assert engines(pool_dir) == {}


def _grant_then_stop(conn, directory, point):
    led = join(directory, model="victim")
    led.try_grow(100)
    stop_at(conn, point)
    led.try_grow(400)
    conn.send("passed")


def _join_then_stop(conn, directory, point):
    stop_at(conn, point)
    join(directory, model="victim")
    conn.send("passed")


def _close_then_stop(conn, directory, point):
    led = join(directory, model="victim")
    led.try_grow(500)
    stop_at(conn, point)
    led.close()
    conn.send("passed")


STOPS = {point: _grant_then_stop for point in GRANT_POINTS}
STOPS.update({"join-created": _join_then_stop, "close-unlinked": _close_then_stop})


def test_every_pause_point_is_tested():
    assert set(STOPS) == set(PAUSE_POINTS)


@pytest.mark.parametrize("point", PAUSE_POINTS)
def test_an_engine_killed_at_any_point_gives_its_bytes_back(pool_dir, children, deadline, point):
    with join(pool_dir, model="survivor") as survivor:
        survivor.try_grow(300)
        proc, conn = children(STOPS[point], str(pool_dir), point)
        assert conn.poll(10) and conn.recv() == point
        kill(proc)
        # At once, with no help: the dead engine's lock went with it, its entry counts for
        # nothing, and the next call removes it.
        assert survivor.available() == 700 and survivor.try_grow(1000) == 700
        assert engines(pool_dir) == {os.getpid(): 1000}
        assert len(list(pool_dir.glob("*.engine"))) == 1


@pytest.mark.parametrize("point", ["join-created", "written"])
def test_a_pool_whose_only_engine_died_takes_the_next_budget(pool_dir, children, deadline, point):
    proc, conn = children(STOPS[point], str(pool_dir), point)
    assert conn.poll(10) and conn.recv() == point
    kill(proc)
    with join(pool_dir, budget=2000, device="cuda:3", max_bytes=5000) as a:
        assert (a.budget_bytes, a.try_grow(5000)) == (2000, 2000)


def _hold(conn, directory, nbytes):
    led = join(directory, model="idle")
    led.try_grow(nbytes)
    conn.send(led.held)
    conn.recv()


def test_an_idle_engine_killed_gives_its_bytes_back(pool_dir, children, deadline):
    proc, conn = children(_hold, str(pool_dir), 600)
    assert conn.recv() == 600
    with join(pool_dir) as a:
        assert a.try_grow(1000) == 400
        assert engines(pool_dir) == {proc.pid: 600, os.getpid(): 400}
        kill(proc)
        assert a.over_budget() == 0 and a.try_grow(1000) == 600
        assert engines(pool_dir) == {os.getpid(): 1000}


def test_a_dead_engine_is_removed_by_a_listing(pool_dir, children, deadline):
    proc, conn = children(_hold, str(pool_dir), 600)
    assert conn.recv() == 600
    kill(proc)
    (pool,) = list_pools(str(pool_dir))
    assert (pool.name, pool.engines) == ("p", [])  # listed once, without engines
    assert list_pools(str(pool_dir)) == [] and list(pool_dir.iterdir()) == []


def test_the_env_pause_stops_a_fresh_interpreter_mid_grant(pool_dir, deadline):
    # VATTENTION_POOL_TEST_PAUSE: the hook for processes the test does not fork.
    script = (
        "import sys\nfrom vattention.pool_ledger import PoolLedger\n"
        "led = PoolLedger.join('p', 1000, device='cpu', model='victim', max_bytes=1000, "
        "directory=sys.argv[1])\nled.try_grow(800)\nprint('not stopped')\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT), VATTENTION_POOL_TEST_PAUSE="written")
    proc = subprocess.Popen([sys.executable, "-c", script, str(pool_dir)], env=env)
    try:
        state, end = "", time.monotonic() + 18
        while state != "T" and proc.poll() is None and time.monotonic() < end:
            time.sleep(0.05)
            state = Path(f"/proc/{proc.pid}/stat").read_text().rpartition(")")[2].split()[0]
        assert state == "T", f"not stopped: state {state!r}, exit {proc.poll()}"
        assert sorted(e.held for e in _entry_records(pool_dir)) == [800]  # written, then stopped
    finally:
        proc.kill()
        proc.wait()
    with join(pool_dir) as a:
        assert a.try_grow(1000) == 1000


def _entry_records(directory):
    """The records of every entry file (live or not), read from the files directly."""
    return [
        pool_ledger._engine_info(path.name, path.read_bytes())
        for path in Path(directory).glob("*.engine")
    ]


def _fork_and_report(conn, directory):
    led = join(directory, model="parent")
    led.try_grow(700)
    pid = os.fork()
    if pid == 0:  # the grandchild outlives its parent, holding nothing
        os.closerange(3, 1 << 16)  # nor the end of a pipe that tells when the parent exits
        time.sleep(30)
        os._exit(0)
    conn.send(pid)
    conn.recv()


def _check_inherited(conn, led):
    try:
        conn.send((led.closed, led.held))
        led.close()  # a no-op here: the entry is the parent's
    except BaseException as exc:
        conn.send(repr(exc))


def test_a_forked_child_neither_keeps_nor_removes_its_parents_entry(pool_dir, children, deadline):
    with join(pool_dir) as led:
        led.try_grow(400)
        proc, conn = children(_check_inherited, led)
        assert conn.recv() == (True, 400)
        proc.join(10)
        assert engines(pool_dir) == {os.getpid(): 400} and led.try_grow(1000) == 600
    # A process that forks and dies: its child must not keep its entry alive.
    proc, conn = children(_fork_and_report, str(pool_dir))
    grandchild = conn.recv()
    try:
        kill(proc)
        os.kill(grandchild, 0)  # still alive
        with join(pool_dir) as a:
            assert a.try_grow(1000) == 1000
    finally:
        os.kill(grandchild, signal.SIGKILL)


# ---- what dead processes (or others) leave behind -----------------------------------------------


def test_stale_files_never_make_the_budget_look_smaller(pool_dir):
    with join(pool_dir) as a:
        a.try_grow(900)
        live_record = next(pool_dir.glob("*.engine")).read_bytes()
    pool_dir.mkdir(exist_ok=True)
    # Entries nobody holds a lock on: a valid record claiming 900 bytes, garbage, an empty one;
    # a temporary pool file and a lock file with junk in it.
    (pool_dir / "p.4242.0bad.engine").write_bytes(live_record)
    (pool_dir / "p.4243.beef.engine").write_bytes(os.urandom(300))
    (pool_dir / "p.4244.f00d.engine").write_bytes(b"")
    (pool_dir / "p.1234abcd.tmp").write_text('{"budget_bytes": 1')
    (pool_dir / "p.lock").write_bytes(b"\xff" * 3)
    (pool_dir / "unrelated.txt").write_text("not ours")
    with join(pool_dir) as b:
        assert b.try_grow(1000) == 1000
        names = sorted(p.name for p in pool_dir.iterdir())
        assert names == sorted(["p.lock", "p.pool", b._entry, "unrelated.txt"])
    (pool_dir / "unrelated.txt").unlink()


@pytest.mark.parametrize("content", [b"", b'{"budget_bytes": 10', b"\x00" * 64, b"[]"])
def test_a_corrupt_pool_file_without_engines_is_replaced_by_the_next_join(pool_dir, content):
    pool_dir.mkdir()
    (pool_dir / "p.pool").write_bytes(content)
    (pool_dir / "p.lock").write_bytes(b"")
    with join(pool_dir, budget=800) as a:
        assert a.budget_bytes == 800 and a.try_grow(1000) == 800
        assert json.loads((pool_dir / "p.pool").read_text())["budget_bytes"] == 800


def test_a_damaged_pool_file_is_put_back(pool_dir):
    # Only ever replaced whole (write, then rename): damage comes from outside. A join cannot know
    # the budget then; the live engines put back what they know when the pool next changes, and
    # set_budget writes a whole file.
    with join(pool_dir, device="cuda:0") as a:
        b = join(pool_dir, device="cuda:0")
        a.try_grow(200)
        (pool_dir / "p.pool").write_bytes(b"{trunc")
        with pytest.raises(ConfigError, match=r"p.pool is unreadable while engines \(pids"):
            join(pool_dir, device="cuda:0")
        b.close()
        assert a.try_grow(1000) == 800
        (pool,) = list_pools(str(pool_dir))
        assert (pool.device, pool.budget_bytes, pool.held) == ("cuda:0", 1000, 1000)
        (pool_dir / "p.pool").write_bytes(b"")
        info = set_budget("p", 900, str(pool_dir))
        assert (info.device, info.budget_bytes) == ("cuda:0", 900) and a.over_budget() == 100


def test_lock_and_stray_files_of_a_gone_pool_are_removed_by_a_listing(pool_dir):
    pool_dir.mkdir()
    (pool_dir / "gone.lock").write_bytes(b"")
    (pool_dir / "gone.77.aa.engine").write_bytes(b"x")
    (pool_dir / "gone.99999999.tmp").write_bytes(b"{")
    assert list_pools(str(pool_dir)) == [] and list(pool_dir.iterdir()) == []


# ---- the command line ---------------------------------------------------------------------------


def _pool_cli(directory, *args):
    env = dict(os.environ, PYTHONPATH=str(ROOT), VATTENTION_POOL_DIR=str(directory))
    return subprocess.run(
        [sys.executable, "-m", "vattention", "pool", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_cli_lists_pools_as_text_and_json(pool_dir):
    with join(pool_dir, "kv", 8 << 30, model="llama-8b", max_bytes=6 << 30, device="cuda:0") as a:
        a.try_grow(3 << 30)
        a.report(live=2 << 30, cached=1 << 30, headroom=0)
        text = _pool_cli(pool_dir)
        assert text.returncode == 0, text.stderr
        assert "pool kv on cuda:0: budget 8GB, held 3GB by 1 engine" in text.stdout
        row = next(line.split() for line in text.stdout.splitlines() if str(os.getpid()) in line)
        assert row[:7] == [str(os.getpid()), "llama-8b", "3GB", "2GB", "1GB", "0B", "6GB"]
        listing = _pool_cli(pool_dir, "--json")
        assert listing.returncode == 0, listing.stderr
        data = json.loads(listing.stdout)
        (pool,) = data["pools"]
        assert data["directory"] == str(pool_dir)
        assert (pool["name"], pool["budget_bytes"], pool["held"]) == ("kv", 8 << 30, 3 << 30)
        assert pool["engines"][0]["pid"] == os.getpid()
        assert pool["engines"][0]["cached"] == 1 << 30


def test_cli_budget_change_reaches_a_live_engine(pool_dir):
    with join(pool_dir, "kv", 1024 * MiB, max_bytes=1024 * MiB) as a:
        a.try_grow(768 * MiB)
        proc = _pool_cli(pool_dir, "kv", "--budget", "512MiB")
        assert proc.returncode == 0, proc.stderr
        assert "pool kv on cpu: budget 512MB, held 768MB by 1 engine" in proc.stdout
        assert "over budget by 256MB" in proc.stdout
        assert a.budget_bytes == 512 * MiB and a.over_budget() == 256 * MiB


def test_cli_unknown_pool_is_exit_status_2(pool_dir):
    with join(pool_dir, "kv"):
        proc = _pool_cli(pool_dir, "nope", "--budget", "1GiB")
    assert proc.returncode == 2
    assert f"error: no pool named 'nope' in {pool_dir} (pools there: kv)" in proc.stderr


def test_cli_usage_errors_in_process(pool_dir, capsys, monkeypatch):
    monkeypatch.setenv("VATTENTION_POOL_DIR", str(pool_dir))
    with pytest.raises(SystemExit) as exit_:
        cli_main(["pool", "--budget", "1GiB"])
    assert exit_.value.code == 2 and "--budget needs the pool's NAME" in capsys.readouterr().err
    assert cli_main(["pool"]) == 0 and capsys.readouterr().out == f"no pools in {pool_dir}\n"
    with join(pool_dir, "kv"), join(pool_dir, "other"):
        assert cli_main(["pool", "kv"]) == 0
        out = capsys.readouterr().out
        assert "pool kv on cpu" in out and "pool other" not in out
        assert cli_main(["pool", "missing"]) == 2
        assert "no pool named 'missing'" in capsys.readouterr().err
        assert cli_main(["pool", "kv", "--budget", "lots"]) == 2
        assert "--budget='lots' is not a size" in capsys.readouterr().err
        assert cli_main(["pool", "bad/name", "--budget", "1"]) == 2
        assert "is not valid" in capsys.readouterr().err
