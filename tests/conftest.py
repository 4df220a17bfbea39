import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def ui_database(tmp_path_factory):
    """The UI tests' database (tests/test_ui.py's seed_database: sim runs, a live run on a real engine,
    a real search, a staged study), seeded once for test_ui.py and test_ui_browser.py. Both only read
    it; a test that writes works on a copy."""
    from serverproc import ServerProcess
    from test_ui import DEVICE, PRESET, seed_database

    server = ServerProcess("--executor", "sim", "--preset", PRESET, "--device", DEVICE)
    try:
        return seed_database(tmp_path_factory.mktemp("ui"), server.url)
    finally:
        server.stop()
