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


# `make test` runs the suite on two pytest-xdist workers, a file to a worker (--dist loadfile). The
# files holding the longest tests go first, so that no worker is left alone with one at the end; a
# wrong guess here costs only time.
LONGEST_FIRST = ("test_vllm_real.py", "test_calibrate.py", "test_vllm_sizing.py", "test_fix_validity.py",
                 "test_ray_stage2.py",
                 "test_search.py", "test_live_targets.py", "test_prometheus_real.py",
                 "test_prometheus_alerts_real.py", "test_ui_browser.py", "test_ui.py", "test_server_hostile.py",
                 "test_signals.py", "test_vllm_differential.py")


# The files of `serial` tests go last: while one runs the other worker waits, and at the end it has
# least left to wait with.
SERIAL_LAST = ("test_calibrate_live.py",)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    rank |= {name: len(rank) + 1 + i for i, name in enumerate(SERIAL_LAST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # stable: each file keeps its order


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test marked `serial` times the host (a real-time calibration): under pytest-xdist it takes
    the host alone from its setup to its teardown, the other worker's next test (and the module
    fixtures it would start, a server) waiting until it ends; every other test shares the host. A
    readers-writer lock of two flock()ed files: the turnstile keeps a waiting serial test from being
    passed by the other worker's next tests. Without xdist, tests run one at a time anyway."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    import fcntl
    serial = item.get_closest_marker("serial") is not None
    base = item.config._tmp_path_factory.getbasetemp().parent / "kvtune-tests"  # the run's, both workers'
    with open(f"{base}.turnstile", "a") as turnstile, open(f"{base}.host", "a") as host:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(host, fcntl.LOCK_EX if serial else fcntl.LOCK_SH)
        if not serial:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(host, fcntl.LOCK_UN)
            fcntl.flock(turnstile, fcntl.LOCK_UN)
