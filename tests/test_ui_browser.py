"""A real browser on a real `kvtune ui`: each page opens in headless Chromium, shows its title and no error.

Debian's chromium and chromium-driver (`make setup` installs them), driven by
Selenium. Skipped, with the reason, only when they cannot be installed.
Screenshots land in the test's tmp_path (printed; `pytest -s` shows where).
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import httpx
import pytest
from serverproc import ServerProcess, free_port
from test_ui import DEVICE, PAGES, PRESET

pytestmark = pytest.mark.slow

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
# The flags this machine's closed network needs: no background connections, no sandbox as root.
CHROME_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", "--window-size=1440,2000")
URL_PATHS = {"runs.py": "", "search.py": "search", "diagnoses.py": "diagnoses", "planner.py": "planner",
             "live.py": "live"}
PAGE_TIMEOUT_S = 60
SETTLE_S = 1.0
CHART = '[data-testid="stImage"] img'


def chromium_missing() -> str | None:
    """None when Chromium and its driver are there (installed now if need be), else why not."""
    if os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER):
        return None
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        return "Chromium is not installed and apt-get (as root) is not available to install it"
    install = ["apt-get", "install", "-y", "--no-install-recommends", "chromium", "chromium-driver"]
    tail = ""
    for command in (install, ["apt-get", "update"], install):
        done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=900)
        tail = (done.stdout + done.stderr)[-500:]
        if os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER):
            return None
    return f"cannot install Debian's chromium and chromium-driver: {tail}"


def ui_command(db: str, port: int) -> list[str]:
    """`python -m kvtune ui` once kvtune's CLI has the command; until then the module on its own."""
    from kvtune.cli import build_parser
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    module = ["kvtune", "ui"] if "ui" in sub.choices else ["kvtune.cli.ui"]
    return [sys.executable, "-m", *module, "--db", db, "--port", str(port)]


@pytest.fixture(scope="module")
def browser():
    reason = chromium_missing()
    if reason:
        print(f"skipping the browser test: {reason}")
        pytest.skip(reason)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="kvtune-chromium-")
    for flag in (*CHROME_FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def ui(tmp_path_factory, ui_database):
    folder = tmp_path_factory.mktemp("ui_browser")
    seeded = ui_database  # tests/conftest.py: the database test_ui.py reads too
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(folder / "ui.log", "w+") as log:
        proc = subprocess.Popen(ui_command(seeded.db, port), stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))
        try:
            _wait_healthy(proc, url, log)
            log.seek(0)
            assert log.readline().strip() == f"kvtune ui: {url} (database {seeded.db})"
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def _wait_healthy(proc, url: str, log) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"kvtune ui exited with {proc.returncode}:\n{log.read()}")
        try:
            if httpx.get(url + "/_stcore/health", timeout=1.0).text == "ok":
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("kvtune ui did not answer /_stcore/health within 60 s")


def wait_for_page(driver, title: str) -> None:
    """Until, for SETTLE_S on end, the page's h1 reads its title, Streamlit shows no script running and the
    browser has loaded every chart's image (fetched after the script ends). Streamlit shows a run a moment
    after it starts, and the title is the script's first element: one look could catch a run's first part."""
    from selenium.webdriver.common.by import By

    deadline, since = time.monotonic() + PAGE_TIMEOUT_S, None
    while time.monotonic() < deadline:
        titles = [h.text.strip() for h in driver.find_elements(By.CSS_SELECTOR, "h1")]
        running = driver.find_elements(By.CSS_SELECTOR, '[data-testid="stStatusWidget"]')
        if title in titles and not running and not charts_loading(driver):
            since = since or time.monotonic()
            if time.monotonic() - since >= SETTLE_S:
                return
        else:
            since = None
        time.sleep(0.25)
    raise AssertionError(f"page {title!r} did not render within {PAGE_TIMEOUT_S} s; h1: {titles}")


def wait_for_text(driver, pattern: str, timeout_s: float = 30) -> None:
    """Until the page's text matches `pattern`: a click's rerun starts a moment after the click returns."""
    from selenium.webdriver.common.by import By

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        body = driver.find_element(By.TAG_NAME, "body").text
        if re.search(pattern, body):
            return
        time.sleep(0.25)
    raise AssertionError(f"no {pattern!r} on the page within {timeout_s} s:\n{body}")


def click(driver, label: str, timeout_s: float = 10) -> None:
    """Click the button reading `label`; the live view's reruns can replace it between finding and clicking."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            next(b for b in driver.find_elements(By.CSS_SELECTOR, "button") if b.text.strip() == label).click()
            return
        except StaleElementReferenceException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.25)


def chart_images(driver) -> list:
    """The charts' <img> elements: the UI shows each matplotlib figure as a PNG image."""
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, CHART)


def charts_loading(driver) -> bool:
    return bool(driver.execute_script(
        "return [...document.querySelectorAll(arguments[0])].some(i => !i.complete || !i.naturalWidth)", CHART))


@pytest.mark.parametrize("page", list(PAGES))
def test_page_renders_in_chromium(page, ui, browser, tmp_path):
    from selenium.webdriver.common.by import By

    browser.get(f"{ui}/{URL_PATHS[page]}")
    wait_for_page(browser, PAGES[page])
    shot = tmp_path / f"{page.removesuffix('.py')}.png"
    browser.save_screenshot(str(shot))
    print(f"screenshot: {shot}")
    assert shot.stat().st_size > 10_000
    errors = browser.find_elements(By.CSS_SELECTOR, '[data-testid="stException"], '
                                                    '[data-testid="stAlertContentError"]')
    assert not errors, [e.text for e in errors]
    assert [h.text.strip() for h in browser.find_elements(By.CSS_SELECTOR, "h1")] == [PAGES[page]]
    body = browser.find_element(By.TAG_NAME, "body").text
    assert "Traceback" not in body
    if page in ("runs.py", "search.py", "planner.py"):
        assert chart_images(browser) and all(i.size["height"] > 100 for i in chart_images(browser))


def test_live_page_updates_in_chromium(ui, browser, tmp_path):
    """The Live page's fragment reruns on its own in a real browser: the scrape count grows, no click needed."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    server = ServerProcess("--executor", "sim", "--preset", PRESET, "--device", DEVICE)
    try:
        browser.get(f"{ui}/live")
        wait_for_page(browser, "Live")
        field = browser.find_element(By.CSS_SELECTOR, 'input[aria-label="Server URL"]')
        field.send_keys(server.url, Keys.ENTER)
        time.sleep(1.0)  # the rerun that commits the text
        click(browser, "Start")
        deadline, scrapes = time.monotonic() + 30, 0
        while time.monotonic() < deadline and scrapes < 3:
            time.sleep(0.5)
            body = browser.find_element(By.TAG_NAME, "body").text
            found = re.search(r"Watching \S+/metrics: (\d+) scrapes", body)
            scrapes = int(found.group(1)) if found else 0
        assert scrapes >= 3, body
        # Stop first: every rerun redraws the chart, and a screenshot mid-redraw shows it blank.
        click(browser, "Stop")
        wait_for_text(browser, r"Stopped watching \S+/metrics: \d+ scrapes")
        wait_for_page(browser, "Live")
        shot = tmp_path / "live-watching.png"
        browser.save_screenshot(str(shot))
        print(f"screenshot: {shot}")
        assert chart_images(browser)
        assert not browser.find_elements(By.CSS_SELECTOR, '[data-testid="stException"], '
                                                          '[data-testid="stAlertContentError"]')
    finally:
        server.stop()
