"""A real browser on a real `kvtune ui`: each page opens in headless Chromium, shows its title and no error,
and reads like the report: no raw None or nan, no unrounded float, every table's columns within the page.

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
from test_ui import DEVICE, PAGES, PRESET, RAW_MISSING, TIGHT_STUDY, UNROUNDED

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
# Each shown table (a glide grid: drawn on a canvas, its cells read out by an accessibility table that holds
# only the rows and columns in view): its headers and rows in view, and how wide its content is against its
# viewport (wider: columns past the right edge, behind a sideways scroll). A table in a closed expander or a
# tab not shown has no width, and is left out.
TABLES_JS = """
return [...document.querySelectorAll('[data-testid="stDataFrame"]')]
  .filter(g => g.getBoundingClientRect().width > 0)
  .map(g => {
    const scroller = g.querySelector('.dvn-scroller');
    return {headers: [...g.querySelectorAll('th[role="columnheader"]')].map(h => h.textContent),
            rows: [...g.querySelectorAll('tbody tr')].map(r => [...r.querySelectorAll('td')].map(c => c.textContent)),
            content: scroller ? scroller.scrollWidth : 0, viewport: scroller ? scroller.clientWidth : 0};
  });
"""
# Per page as it first opens, the tables whose headers must all be in view: the figures with their units.
HEADERS = {
    "runs.py": [("latency", "clients p95", "server p95", "server p99"), ("per request", "p50 (tokens)", "mean (tokens)")],
    "search.py": [("result", "goodput (req/s)", "throughput (req/s)", "TTFT p95 (ms)", "TPOT p95 (ms)", "note"),
                  ("config", "block_size", "kv_cache_dtype"),
                  ("config", "stage", "goodput (req/s)", "TTFT p95 (ms)", "TPOT p95 (ms)", "meets SLOs")],
    "diagnoses.py": [("metric", "window", "value", "threshold")],
    "planner.py": [("auto (bfloat16)", "fp8")],
    "live.py": [],
}


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
        titles = texts(driver, "h1")
        running = driver.find_elements(By.CSS_SELECTOR, '[data-testid="stStatusWidget"]')
        if title in titles and not running and not charts_loading(driver):
            since = since or time.monotonic()
            if time.monotonic() - since >= SETTLE_S:
                return
        else:
            since = None
        time.sleep(0.25)
    raise AssertionError(f"page {title!r} did not render within {PAGE_TIMEOUT_S} s; h1: {titles}")


def texts(driver, css: str) -> list[str]:
    """The text of every element `css` selects, read in one script: a rerun that replaces them between a
    find and a read (a stale element) cannot come between."""
    return driver.execute_script("return [...document.querySelectorAll(arguments[0])].map(e => e.innerText.trim())",
                                 css)


def wait_idle(driver, timeout_s: float = 5) -> None:
    """Until Streamlit shows no script running (or `timeout_s` passes: a click is then tried anyway)."""
    from selenium.webdriver.common.by import By

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and driver.find_elements(By.CSS_SELECTOR, '[data-testid="stStatusWidget"]'):
        time.sleep(0.1)


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


def readable(driver) -> list[dict]:
    """The page's tables (TABLES_JS), once its text and theirs are checked: no raw None or nan, no float
    nobody rounded, no table wider than its viewport."""
    from selenium.webdriver.common.by import By

    tables = driver.execute_script(TABLES_JS)
    cells = [cell for t in tables for cell in [*t["headers"], *(c for row in t["rows"] for c in row)]]
    words = "\n".join([driver.find_element(By.TAG_NAME, "body").text, *cells])
    assert not RAW_MISSING.search(words), RAW_MISSING.search(words)
    assert not UNROUNDED.search(words), UNROUNDED.search(words)
    for t in tables:
        assert t["content"] <= t["viewport"] + 1, f"columns past the right edge of {t['headers']}: {t}"
    return tables


def table_with(tables: list[dict], *headers: str) -> dict:
    """The table showing these headers: each in view (TABLES_JS reads out only those), none cut off."""
    found = [t for t in tables if set(headers) <= set(t["headers"])]
    assert found, f"no table shows {headers}: {[t['headers'] for t in tables]}"
    return found[0]


def choose(driver, label: str, option: str, title: str) -> None:
    """Pick the option that reads `option` in the select box labelled `label`, and wait for the rerun."""
    from selenium.webdriver.common.by import By

    box = driver.find_element(By.CSS_SELECTOR, f'[data-testid="stSelectbox"] input[aria-label="{label}"]')
    box.click()
    deadline = time.monotonic() + 10
    while not (found := [o for o in driver.find_elements(By.CSS_SELECTOR, '[role="option"]') if option in o.text]):
        assert time.monotonic() < deadline, f"no option {option!r} in {label!r}"
        time.sleep(0.2)
    found[0].click()
    deadline = time.monotonic() + 30
    while option not in (box.get_attribute("value") or ""):
        assert time.monotonic() < deadline, f"{label!r} did not take {option!r}"
        time.sleep(0.2)
    time.sleep(SETTLE_S)  # the rerun starts a moment after the value changes
    wait_for_page(driver, title)


def expand(driver, text: str, title: str) -> None:
    from selenium.webdriver.common.by import By

    summary = next(s for s in driver.find_elements(By.CSS_SELECTOR, '[data-testid="stExpander"] summary')
                   if text in s.text)
    summary.click()
    time.sleep(SETTLE_S)
    wait_for_page(driver, title)


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
    assert texts(browser, "h1") == [PAGES[page]]
    body = browser.find_element(By.TAG_NAME, "body").text
    assert "Traceback" not in body
    if page in ("runs.py", "search.py", "planner.py"):
        assert chart_images(browser) and all(i.size["height"] > 100 for i in chart_images(browser))
    tables = readable(browser)
    for headers in HEADERS[page]:
        table_with(tables, *headers)


def test_search_pages_read_like_the_report_in_chromium(ui, ui_database, browser, tmp_path):
    """A study with failed trials and a default that failed: every failed trial's whole reason is on the
    page, its figures missing (never None), the default reads failed; a study with a stage 2 fits its live
    columns in view."""
    import optuna
    from selenium.webdriver.common.by import By

    browser.get(f"{ui}/search")
    wait_for_page(browser, "Search")
    choose(browser, "Study", TIGHT_STUDY, "Search")
    browser.save_screenshot(str(tmp_path / "search-tight.png"))
    tables = readable(browser)
    trials = table_with(tables, "trial", "result", "goodput (req/s)", "TTFT p95 (ms)", "note")
    failed = [row for row in trials["rows"] if row[trials["headers"].index("result")].startswith("⚠")]
    assert failed and all(row[trials["headers"].index("goodput (req/s)")] == "" for row in failed)  # no figure
    body = " ".join(browser.find_element(By.TAG_NAME, "body").text.split())
    study = optuna.load_study(study_name=TIGHT_STUDY, storage=ui_database.db)
    reasons = [t.user_attrs["fail_reason"] for t in study.trials if t.state == optuna.trial.TrialState.FAIL]
    assert reasons
    for reason in reasons:  # whole, wrapped in view: not what a cell's width leaves
        assert " ".join(reason.replace("`", "").split()) in body
    figures = table_with(tables, "config", "stage", "goodput (req/s)", "TTFT p95 (ms)", "TPOT p95 (ms)", "meets SLOs")
    default = next(row for row in figures["rows"] if row[0] == "the default")
    assert default[figures["headers"].index("meets SLOs")] == "failed"

    choose(browser, "Study", "staged", "Search")
    browser.save_screenshot(str(tmp_path / "search-staged.png"))
    tables = readable(browser)
    figures = table_with(tables, "config", "stage", "goodput (req/s)", "TTFT p95 (ms)", "TPOT p95 (ms)",
                         "meets SLOs", "goodput, 95 % interval (req/s)", "runs (ok/all)")
    assert {row[1] for row in figures["rows"]} == {"sim", "live"}
    tests = table_with(tables, "config", "flags changed", "p (one-sided)", "beats the default")  # in view, whole
    assert tests["rows"] and {row[3] for row in tests["rows"]} <= {"yes", "no"}


def test_runs_and_diagnoses_read_like_the_report_in_chromium(ui, ui_database, browser, tmp_path):
    """Every run in one table that fits the page; a URL's run named for the server, not 'on unknown'; a
    diagnosis that found nothing shows no faults, without a hint to store it."""
    from selenium.webdriver.common.by import By

    browser.get(ui)
    wait_for_page(browser, "Runs")
    run = browser.find_element(By.CSS_SELECTOR, '[data-testid="stSelectbox"] input[aria-label="Run"]')
    assert "running server" in run.get_attribute("value") and "unknown" not in run.get_attribute("value")
    expand(browser, "All", "Runs")
    browser.save_screenshot(str(tmp_path / "runs-all.png"))
    tables = readable(browser)
    table_with(tables, "run", "name", "status", "throughput (req/s)", "TTFT p95 (ms)", "KV usage peak (%)",
               "preemptions")

    browser.get(f"{ui}/diagnoses")
    wait_for_page(browser, "Diagnoses")
    choose(browser, "Run", "sim default", "Diagnoses")
    readable(browser)
    assert browser.find_elements(By.CSS_SELECTOR, '[data-testid="stAlertContentSuccess"]')
    assert "kvtune diagnose --run" not in browser.find_element(By.TAG_NAME, "body").text


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
        for attempt in range(6):  # a click that lands while a rerun replaces the page is lost: click again
            wait_idle(browser)  # between the fragment's timed reruns
            if "Stop" in texts(browser, "button"):
                click(browser, "Stop")
            try:
                wait_for_text(browser, r"Stopped watching \S+/metrics: \d+ scrapes", timeout_s=4)
                break
            except AssertionError:
                if attempt == 5:
                    raise
        wait_for_page(browser, "Live")
        shot = tmp_path / "live-watching.png"
        browser.save_screenshot(str(shot))
        print(f"screenshot: {shot}")
        assert chart_images(browser)
        assert not browser.find_elements(By.CSS_SELECTOR, '[data-testid="stException"], '
                                                          '[data-testid="stAlertContentError"]')
        table_with(readable(browser), "latency", "server p50", "server p95", "server p99")
    finally:
        server.stop()
