import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def ui_database(tmp_path_factory):
    """The UI tests' database (tests/test_ui.py's seed_database: sim runs, a live run on a real engine,
    a real search, a staged study), seeded once for test_ui.py and test_ui_browser.py. Both only read
    it; a test that writes works on a copy. Under pytest-xdist the two files may run on two workers:
    the first to get here seeds it in the run's shared folder, under a lock, and the other reads it."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return _seeded_ui_database(tmp_path_factory.mktemp("ui"))
    import dataclasses
    import fcntl
    import json

    from test_ui import Seeded
    folder = tmp_path_factory.getbasetemp().parent / "kvtune-ui"  # the run's, both workers'
    folder.mkdir(exist_ok=True)
    with open(folder / "lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        seeded = folder / "seeded.json"
        if not seeded.exists():
            seeded.write_text(json.dumps(dataclasses.asdict(_seeded_ui_database(folder))))
        return Seeded(**json.loads(seeded.read_text()))


def _seeded_ui_database(folder):
    from serverproc import ServerProcess
    from test_ui import DEVICE, PRESET, seed_database

    server = ServerProcess("--executor", "sim", "--preset", PRESET, "--device", DEVICE)
    try:
        return seed_database(folder, server.url)
    finally:
        server.stop()


# `make test` runs the suite on three pytest-xdist workers, a file to a worker (--dist loadfile), each
# taking the next file as it runs out. The files holding the longest tests go first, so that no worker
# is left alone with one at the end. Beside the serial file (first, below) the other workers run files
# of tests mostly in their own processes (fits, pages, reports), not the vLLM starts that took the
# serial calibration's memory reads 10 % off. A wrong guess here costs only time.
LONGEST_FIRST = ("test_calibrate.py", "test_ui.py", "test_report.py", "test_vllm_real.py", "test_vllm_sizing.py",
                 "test_fix_validity.py", "test_ray_stage2.py", "test_search.py", "test_live_targets.py",
                 "test_prometheus_real.py", "test_prometheus_alerts_real.py", "test_ui_browser.py",
                 "test_server_hostile.py", "test_signals.py", "test_vllm_differential.py")


# The files of `serial` tests go first: one runs beside the other workers' first files, which yield
# it the CPU (pytest_runtest_protocol), not at the end with the other workers out of work.
SERIAL_FIRST = ("test_calibrate_live.py",)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SERIAL_FIRST)}
    rank |= {name: len(rank) + i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its order


def pytest_sessionstart(session):
    """Each xdist worker leaves its pid where a serial test on another worker finds it."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        workers = _run_folder(session.config) / "kvtune-workers"
        workers.mkdir(exist_ok=True)
        (workers / worker).write_text(str(os.getpid()))


def _run_folder(config):
    return config._tmp_path_factory.getbasetemp().parent  # the run's, every worker's


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test marked `serial` times the host in real time (a calibration that mostly sleeps): under
    pytest-xdist the other workers' processes (the servers their fixtures started, and what they
    start meanwhile, which inherits it) run at SCHED_IDLE from its setup to its teardown, so that
    the CPU is its own whenever it wants it and the rest of the suite goes on with what it leaves.
    Where this user could not take SCHED_IDLE back, they run on the other CPUs instead. Serial tests
    take the host one at a time."""
    cpus = sorted(os.sched_getaffinity(0))
    if "PYTEST_XDIST_WORKER" not in os.environ or item.get_closest_marker("serial") is None or len(cpus) < 2:
        yield
        return
    import fcntl
    folder = _run_folder(item.config)
    others = [int(f.read_text()) for f in (folder / "kvtune-workers").iterdir()
              if f.name != os.environ["PYTEST_XDIST_WORKER"]]
    param = os.sched_param(0)
    with open(folder / "kvtune-serial.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        since = _ticks_since_boot()
        if _may_leave_sched_idle():
            _each_thread(others, lambda tid: os.sched_setscheduler(tid, os.SCHED_IDLE, param))
            restore = lambda tid: os.sched_setscheduler(tid, os.SCHED_OTHER, param)  # noqa: E731
        else:
            _each_thread(others, lambda tid: os.sched_setaffinity(tid, cpus[:-1]))
            os.sched_setaffinity(0, cpus[-1:])  # this thread: what the test starts inherits it
            restore = lambda tid: os.sched_setaffinity(tid, cpus)  # noqa: E731
        try:
            yield
        finally:
            os.sched_setaffinity(0, cpus)
            _each_thread(others, restore, since)  # and what left their trees (a daemon: PostgreSQL, Ray)


def _may_leave_sched_idle() -> bool:
    """Whether this user may move a thread from SCHED_IDLE back to SCHED_OTHER (CAP_SYS_NICE, or an
    RLIMIT_NICE that allows nice 0), tried in a child process of its own."""
    import subprocess
    import sys
    code = ("import os; p = os.sched_param(0); os.sched_setscheduler(0, os.SCHED_IDLE, p); "
            "os.sched_setscheduler(0, os.SCHED_OTHER, p)")
    return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def _ticks_since_boot() -> float:
    with open("/proc/uptime") as f:
        return float(f.read().split()[0]) * os.sysconf("SC_CLK_TCK")


def _each_thread(roots: list[int], apply, since: float | None = None) -> None:
    """`apply(thread id)` to every thread of `roots` and of their descendants, and with `since` (clock
    ticks after boot) of every process started since then; those that exit meanwhile, and those of
    other users, are passed by."""
    parents, todo = {}, list(roots)
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited
        if entry.isdigit():
            parents.setdefault(int(fields[1]), []).append(int(entry))
            if since is not None and int(fields[19]) >= since:
                todo.append(int(entry))
    done = set()
    while todo:
        pid = todo.pop()
        if pid in done:
            continue
        done.add(pid)
        try:
            threads = os.listdir(f"/proc/{pid}/task")  # scheduling is each thread's own
        except OSError:
            threads = []  # exited
        for thread in threads:
            try:
                apply(int(thread))
            except OSError:
                pass  # exited, or not this user's
        todo += parents.get(pid, [])
