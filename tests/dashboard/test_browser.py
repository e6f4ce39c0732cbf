"""The dashboard as a person uses it: real headless Chromium (selenium, Debian's chromedriver)
on the dashboard served by a real server thread from a real database, on every backend.

One browser for the whole module. Each test saves screenshots in the run's temporary
``screenshots/`` folder; with ``SP_UPDATE_SCREENSHOT=1`` the overview test also writes
``docs/images/dashboard.png``. Without Chromium (``bash scripts/browser.sh`` installs it)
the tests are skipped, and fail under ``CI``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from math import cos, sin
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from dashboard_support import archive, lease, serving

import sqla_proletarian as sp
from sqla_proletarian import statements
from sqla_proletarian.dashboard import actions, create_dashboard

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.common.exceptions import TimeoutException, WebDriverException  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402
from selenium.webdriver.support import expected_conditions  # noqa: E402
from selenium.webdriver.support.wait import WebDriverWait  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("SP_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("SP_CHROMEDRIVER", "/usr/bin/chromedriver")
OPTIONS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--window-size=1280,800",
)
HOSTILE = "<img src=x onerror=alert(1)><script>alert(2)</script>"
#: Seconds between the overview's polls in these tests.
REFRESH = 0.3
needs_job_control = pytest.mark.skipif(
    not actions.job_control(), reason="job control not merged yet"
)


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    """Headless Chromium through Debian's chromedriver (selenium downloads nothing)."""
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not os.access(path, os.X_OK)]
    if missing:
        message = f"{' and '.join(missing)} not found: run `bash scripts/browser.sh` (as root)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    profile = tempfile.mkdtemp(prefix="sp-chromium-")
    options = webdriver.ChromeOptions()
    for option in (*OPTIONS, f"--user-data-dir={profile}"):
        options.add_argument(option)
    options.binary_location = CHROMIUM
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.implicitly_wait(0)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("screenshots")


@pytest.fixture
def page(browser: WebDriver, screenshots: Path, request: pytest.FixtureRequest) -> Iterator[Page]:
    """The module's browser, fresh for this test (no cookies, the console read empty)."""
    browser.delete_all_cookies()
    browser.get("about:blank")
    browser.get_log("browser")
    helper = Page(browser, screenshots / request.node.name.replace("/", "_"))
    yield helper
    problems = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert not problems, f"the browser console has errors: {problems}"


class Page:
    """What a test does in the browser: open, read, click, wait, take screenshots."""

    def __init__(self, driver: WebDriver, shots: Path) -> None:
        self.driver = driver
        self.shots = shots
        self.base = ""
        self._taken = 0

    def open(self, path: str) -> None:
        self.driver.get(self.base + path)

    def texts(self, css: str) -> list[str]:
        """The rendered text of every element ``css`` selects, read in one script (no
        element reference goes stale while the page's own script redraws)."""
        found: list[str] = self.driver.execute_script(
            "return Array.from(document.querySelectorAll(arguments[0]), e => e.innerText);", css
        )
        return found

    def text(self, css: str) -> str:
        found = self.texts(css)
        assert found, f"nothing matches {css}"
        return found[0]

    def click(self, css: str) -> None:
        self.driver.find_element(By.CSS_SELECTOR, css).click()

    def follow(self, css: str) -> None:
        """Click a link or a submit button, and wait for the next page: the old page's
        window has a mark that the new one lacks. (Waiting for the old element to go stale
        trips over Chromium's "Node with given id does not belong to the document".)"""
        mark = f"page-{self._taken}-{time.monotonic_ns()}"
        self.driver.execute_script("window.spPageMark = arguments[0];", mark)
        self.click(css)
        self.wait_for(lambda _: self._loaded_other_than(mark), what=f"{css} to load a page")

    def _loaded_other_than(self, mark: str) -> bool:
        try:
            state = self.driver.execute_script(
                "return [window.spPageMark || null, document.readyState];"
            )
        except WebDriverException:
            return False  # between the pages
        return bool(state[0] != mark and state[1] == "complete")

    def wait_for(self, condition: Any, timeout: float = 10, what: str = "") -> Any:
        return WebDriverWait(self.driver, timeout, poll_frequency=0.05).until(condition, what)

    def wait_text(self, css: str, text: str, timeout: float = 10) -> None:
        self.wait_for(lambda _: text in self.texts(css), timeout, f"{css} to read {text!r}")

    def no_alert(self, seconds: float = 0.5) -> None:
        with pytest.raises(TimeoutException):
            WebDriverWait(self.driver, seconds).until(expected_conditions.alert_is_present())

    def screenshot(self, name: str) -> Path:
        self.shots.mkdir(parents=True, exist_ok=True)
        self._taken += 1
        path = self.shots / f"{self._taken:02d}-{name}.png"
        # Chromium can fail a capture that races the page's own redraw ("Node with given
        # id does not belong to the document"): try again, a few times.
        for attempt in range(5):
            try:
                assert self.driver.save_screenshot(str(path)), f"no screenshot {path}"
                return path
            except WebDriverException:
                if attempt == 4:
                    raise
                time.sleep(0.1)
        return path


def serve(page: Page, engine: sa.Engine, **options: Any) -> Any:
    """The dashboard of ``engine`` served for the test; the page's base URL set to it."""
    context = serving(create_dashboard(engine, refresh_seconds=REFRESH, **options))
    page.base = context.__enter__().rstrip("/")
    return context


@pytest.fixture
def dashboard(page: Page, engine: sa.Engine) -> Iterator[Page]:
    context = serve(page, engine, title="Acme · queues")
    try:
        yield page
    finally:
        page.driver.get("about:blank")  # no poll in flight when the server stops
        context.__exit__(None, None, None)


def fill_like_a_day_at_work(engine: sa.Engine) -> None:
    """A few queues with ready and scheduled jobs, one with limits, and an hour of successes
    and failures."""
    now = sp.utc_now()
    with engine.begin() as conn:
        sp.set_queue_limits(conn, "billing", max_running=2, rate_limit=(10, 1.0))
        sp.enqueue_many(
            conn,
            [("send-welcome-email", {"user": n}) for n in range(12)],
            queue="mail",
            clock=lambda: now - timedelta(seconds=95),
        )
        sp.enqueue_many(conn, [("charge-card", {"invoice": n}) for n in range(3)], queue="billing")
        sp.enqueue_many(
            conn, [("sync-to-crm", {"id": n}) for n in range(7)], queue="crm", process_in=900
        )
    rows = []
    for minute in range(60):
        when = now - timedelta(minutes=minute, seconds=5)
        rows += [("mail", "send-welcome-email", "success", when)] * round(6 + 4 * sin(minute / 7))
        rows += [("billing", "charge-card", "success", when)] * round(3 + 2 * cos(minute / 9))
        if minute % 9 == 2:
            rows.append(("billing", "charge-card", "failure", when))
        rows += [("crm", "sync-to-crm", "success", when)] * (minute // 20)
    archive(engine, *rows)


# --- the tests -------------------------------------------------------------------------------


def test_the_overview_shows_each_queues_figures_and_updates_them_without_reloading(
    dashboard: Page, engine: sa.Engine
) -> None:
    """The figures of each queue are in its row, with a chart; a job enqueued meanwhile and
    a queue that appears show up on the next poll, in the same page."""
    fill_like_a_day_at_work(engine)
    dashboard.open("/")
    assert dashboard.texts("#queues tbody tr th") == ["billing", "crm", "mail"]
    assert dashboard.text('tr[data-queue="mail"] [data-field="ready"]') == "12"
    assert dashboard.text('tr[data-queue="crm"] [data-field="scheduled"]') == "7"
    assert dashboard.text('tr[data-queue="billing"] [data-field="failed_last_hour"]') == "7"
    assert dashboard.text('tr[data-queue="mail"] [data-field="oldest_ready_age"]').endswith("s")
    billing = 'tr[data-queue="billing"] [data-field="limits_text"]'
    assert dashboard.text(billing).split() == ["max_running=2", "rate_limit=10/1s"]
    dashboard.wait_for(
        lambda driver: len(driver.find_elements(By.CSS_SELECTOR, "#queues .chart canvas")) == 3,
        what="a chart per queue",
    )
    shot = dashboard.screenshot("overview")
    if os.environ.get("SP_UPDATE_SCREENSHOT") and engine.dialect.name == "sqlite":
        target = ROOT / "docs" / "images" / "dashboard.png"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, target)
    dashboard.driver.execute_script("window.notReloaded = true;")

    with engine.begin() as conn:
        sp.enqueue(conn, "send-welcome-email", queue="mail")
        sp.enqueue(conn, "resize-image", queue="images")

    dashboard.wait_text('tr[data-queue="mail"] [data-field="ready"]', "13")
    dashboard.wait_text('tr[data-queue="images"] [data-field="ready"]', "1")
    assert dashboard.texts("#queues tbody tr th") == ["billing", "crm", "images", "mail"]
    assert dashboard.driver.execute_script("return window.notReloaded === true;")
    link = dashboard.driver.find_element(By.CSS_SELECTOR, 'tr[data-queue="images"] th a')
    assert str(link.get_attribute("href")).endswith("/jobs?state=ready&queue=images")
    dashboard.screenshot("overview-updated")


def test_limits_set_while_the_overview_is_open_show_in_the_queues_row_and_fit_the_window(
    dashboard: Page, engine: sa.Engine
) -> None:
    """Limits set meanwhile show in the queue's row on the next poll, with its ready jobs
    waiting; all four fit a 1280 px window without sideways scrolling; cleared, the row
    shows dashes again."""
    with engine.begin() as conn:
        sp.enqueue_many(conn, [("call-partner", {"n": n}) for n in range(4)], queue="partner-api")
    dashboard.driver.set_window_size(1280, 800)
    dashboard.open("/")
    limits_cell = 'tr[data-queue="partner-api"] [data-field="limits_text"]'
    waiting_cell = 'tr[data-queue="partner-api"] [data-field="waiting_text"]'
    assert (dashboard.text(limits_cell), dashboard.text(waiting_cell)) == ("—", "—")

    limits = sp.QueueLimits(10, 2, (10, 1.0), (1, 60.0))
    with engine.begin() as conn:
        sp.set_queue_limits(conn, "partner-api", max_running=10, max_running_per_key=2,
                            rate_limit=(10, 1.0), rate_limit_per_key=(1, 60.0))  # fmt: skip
    dashboard.wait_text(limits_cell, limits.describe())
    assert dashboard.text(waiting_cell) == "4"
    dashboard.screenshot("overview-limits")
    width, page_width = dashboard.driver.execute_script(
        "return [document.documentElement.clientWidth, document.documentElement.scrollWidth];"
    )
    assert page_width <= width <= 1280

    with engine.begin() as conn:
        sp.clear_queue_limits(conn, "partner-api")
    dashboard.wait_text(limits_cell, "—")
    assert dashboard.text(waiting_cell) == "—"


def test_a_failed_job_is_opened_retried_and_leaves_the_failed_list(
    dashboard: Page, engine: sa.Engine
) -> None:
    """From the failed list to the job's page (its error shown), Retry, the confirmation,
    and back: a notice, and the job is queued again, no longer failed."""
    [failed, other] = archive(
        engine,
        ("billing", "charge-card", "failure", sp.utc_now()),
        ("billing", "charge-card", "failure", sp.utc_now() - timedelta(minutes=1)),
    )
    dashboard.open("/")
    dashboard.follow('a[href$="/jobs?state=failed"]')
    assert len(dashboard.texts("#jobs tbody tr")) == 2
    dashboard.follow(f'a[href$="/jobs/{failed}"]')
    assert dashboard.text("#job-state") == "failed"
    assert dashboard.text("#error").startswith("RuntimeError: charge-card")
    dashboard.screenshot("failed-job")

    dashboard.follow(".job-actions button")
    assert "Put 1 failed job(s) back in the queue" in dashboard.text("#summary")
    dashboard.screenshot("confirm-retry")
    dashboard.follow("#confirm")

    dashboard.wait_for(expected_conditions.presence_of_element_located((By.ID, "notice")))
    assert dashboard.text("#notice") == "1 failed job(s) put back in the queue."
    dashboard.open("/jobs?state=failed")
    listed = dashboard.driver.execute_script(
        "return Array.from(document.querySelectorAll('#jobs tbody tr'), r => r.dataset.jobId);"
    )
    assert listed == [str(other)]
    assert [job.job_id for job in sp.list_jobs(engine, "ready").jobs] == [failed]


def test_a_selection_of_failures_is_retried_from_the_list(
    dashboard: Page, engine: sa.Engine
) -> None:
    """Tick two of three failures, Retry selected, confirm: those two are queued."""
    ids = archive(engine, *[("mail", "send", "failure", sp.utc_now()) for _ in range(3)])
    dashboard.open("/jobs?state=failed")
    for job_id in ids[:2]:
        dashboard.click(f'input[type=checkbox][value="{job_id}"]')
    dashboard.follow("#retry-selected button")
    assert "Put 2 failed job(s)" in dashboard.text("#summary")
    dashboard.follow("#confirm")
    dashboard.wait_text("#notice", "2 failed job(s) put back in the queue.")
    assert {job.job_id for job in sp.list_jobs(engine, "ready").jobs} == set(ids[:2])


def test_a_hostile_job_is_shown_as_text_and_runs_no_script(
    dashboard: Page, engine: sa.Engine
) -> None:
    """Markup in a queue name, job type and payload is shown as the text it is, on the
    overview (also when the script redraws it) and on the job's page; no alert opens."""
    with engine.begin() as conn:
        job_id = sp.enqueue(conn, HOSTILE, {"comment": HOSTILE, "n": 1}, queue=HOSTILE)
    dashboard.open("/")
    dashboard.no_alert()
    row = f'tr[data-queue="{HOSTILE.replace(chr(34), chr(92) + chr(34))}"]'
    assert dashboard.text(f"{row} th") == HOSTILE
    with engine.begin() as conn:
        sp.enqueue(conn, "again", queue=HOSTILE)
    dashboard.wait_text(f'{row} [data-field="ready"]', "2")  # redrawn by the script
    assert dashboard.text(f"{row} th") == HOSTILE
    dashboard.no_alert()
    dashboard.open(f"/jobs/{job_id}")
    dashboard.no_alert()
    assert dashboard.text("#job-type") == HOSTILE
    assert f'"comment": "{HOSTILE}"' in dashboard.text("#payload")
    assert not dashboard.driver.find_elements(By.CSS_SELECTOR, "#payload img, #payload script")
    dashboard.screenshot("hostile-job")


def test_a_long_payload_is_folded_until_clicked(dashboard: Page, engine: sa.Engine) -> None:
    """A long string shows its start and its size; a click unfolds the whole value."""
    long_text = "lorem ipsum " * 40
    with engine.begin() as conn:
        job_id = sp.enqueue(conn, "report", {"body": long_text, "pages": list(range(30))})
    dashboard.open(f"/jobs/{job_id}")
    dashboard.screenshot("payload-folded")
    text, pages = dashboard.driver.find_elements(By.CSS_SELECTOR, "#payload details")
    whole = text.find_element(By.CSS_SELECTOR, "summary + .string")
    items = pages.find_elements(By.CSS_SELECTOR, ".literal")
    assert text.get_attribute("open") is None and pages.get_attribute("open") is None
    assert not whole.is_displayed() and not any(item.is_displayed() for item in items)
    assert text.find_element(By.CSS_SELECTOR, ".preview").text.startswith('"lorem ipsum')
    assert "(480 characters)" in dashboard.text("#payload")
    assert pages.find_element(By.TAG_NAME, "summary").text == "[ 30 items ]"
    text.find_element(By.TAG_NAME, "summary").click()
    assert whole.is_displayed() and whole.text == f'"{long_text}"'
    pages.find_element(By.TAG_NAME, "summary").click()
    assert [item.text for item in items if item.is_displayed()] == [str(n) for n in range(30)]
    dashboard.screenshot("payload-unfolded")


@needs_job_control
def test_pausing_a_queue_stops_a_worker_claiming_from_it_until_resumed(
    dashboard: Page, engine: sa.Engine
) -> None:
    """Pause the queue from the overview (confirmed): a running worker leaves a job
    enqueued then alone; Resume, and the worker runs it."""
    ran: list[uuid.UUID] = []
    ran_one = threading.Event()

    def handler(job: sp.JobContext) -> None:
        ran.append(job.job_id)
        ran_one.set()

    with engine.begin() as conn:
        sp.enqueue(conn, "work")
    worker = sp.create_queue_worker(engine, handler, handler_mode="advanced", polling_interval=0.05)
    worker.start()
    try:
        assert ran_one.wait(10)
        dashboard.open("/")
        dashboard.follow('tr[data-queue="default"] .pause button')
        dashboard.follow("#confirm")
        dashboard.wait_text('tr[data-queue="default"] [data-field="paused"]', "paused")
        with engine.begin() as conn:
            waiting = sp.enqueue(conn, "work")
        time.sleep(1.0)
        assert waiting not in ran
        dashboard.wait_text('tr[data-queue="default"] [data-field="ready"]', "1")
        dashboard.screenshot("paused")
        dashboard.follow('tr[data-queue="default"] .resume button')
        dashboard.follow("#confirm")
        dashboard.wait_for(lambda driver: waiting in ran, what="the job to run once resumed")
    finally:
        worker.stop()


#: A lease owner as long as real ones get: a worker of several queues in a pod of a
#: Kubernetes deployment, with its process and thread.
LONG_OWNER = (
    "proletarian[critical,default,bulk,reports,exports]@checkout-worker-7f9c8d6b5-x2x9q"
    ".prod.eu-west-1.internal:4242/Thread-3"
)


@needs_job_control
def test_the_running_jobs_cancel_button_is_in_view_in_a_1280_pixel_window(
    dashboard: Page, engine: sa.Engine
) -> None:
    """The running list of lease-mode jobs (owner, lease expiry, heartbeat) in a 1280 px
    window: the page does not scroll sideways, and each Cancel button lies inside the
    window, whatever the lease owner's length."""
    now = sp.utc_now()
    with engine.begin() as conn:
        ids = [sp.enqueue(conn, "generate-quarterly-report", {"n": n}) for n in range(3)]
    for job_id in ids:
        lease(engine, job_id, expires_in=600, now=now)
    with engine.begin() as conn:
        conn.execute(sa.update(statements.JOB).values(lease_owner=LONG_OWNER))
    dashboard.driver.set_window_size(1280, 800)
    dashboard.open("/jobs?state=running")
    dashboard.wait_for(
        lambda _: len(dashboard.texts("#jobs tbody button")) == len(ids),
        what="a Cancel button for each running job",
    )
    owners = ["".join(text.split()) for text in dashboard.texts("#jobs .lease-owner")]
    assert owners == [LONG_OWNER] * len(ids)
    geometry = dashboard.driver.execute_script(
        """
        const buttons = Array.from(document.querySelectorAll('#jobs tbody button'));
        return {
          width: document.documentElement.clientWidth,
          pageWidth: document.documentElement.scrollWidth,
          buttons: buttons.map(b => {
            const box = b.getBoundingClientRect();
            const x = box.left + box.width / 2, y = box.top + box.height / 2;
            const hit = document.elementFromPoint(x, y);
            return {left: box.left, right: box.right, onTop: b.contains(hit)};
          }),
        };
        """
    )
    dashboard.screenshot("running-leases")
    assert geometry["width"] <= 1280
    assert geometry["pageWidth"] <= geometry["width"], geometry
    assert len(geometry["buttons"]) == len(ids), geometry
    for button in geometry["buttons"]:
        assert button["left"] >= 0 and button["right"] <= geometry["width"], geometry
        assert button["onTop"], geometry  # not covered by another cell


def test_a_jobs_page_shows_its_progress_and_its_graph_with_links_to_each_neighbour(
    dashboard: Page, engine: sa.Engine
) -> None:
    """A job that reported progress shows a bar and its message; a waiting job's page lists
    what it depends on and what depends on it, each with its state, and a click on one
    opens that job's page, whose graph leads back."""
    with engine.begin() as conn:
        fetch = sp.enqueue(conn, "fetch", {"url": "https://example.org"})
        build = sp.enqueue(conn, "build", None, depends_on=[fetch])
        publish = sp.enqueue(conn, "publish", None, depends_on=[build])

    def handler(job_type: str, payload: Any) -> None:
        sp.current_job().set_progress(0.4, "2 of 5 pages")

    assert sp.process_next_job(engine, handler)  # fetch: build is due now, publish waits
    dashboard.open(f"/jobs/{publish}")
    assert dashboard.text("#job-state") == "waiting"
    assert dashboard.texts("#graph-depends_on li") == [f"{build} build ready"]
    assert dashboard.text("#graph-dependents p") == "no job"
    dashboard.screenshot("waiting-job-graph")
    dashboard.follow(f'#graph-depends_on a[href$="/jobs/{build}"]')
    assert dashboard.text("#job-type") == "build"
    assert dashboard.texts("#graph-depends_on li") == [f"{fetch} fetch succeeded"]
    assert dashboard.texts("#graph-dependents li") == [f"{publish} publish waiting"]
    dashboard.follow(f'#graph-depends_on a[href$="/jobs/{fetch}"]')
    assert dashboard.text("#job-progress-message") == "2 of 5 pages"
    bar = dashboard.driver.find_element(By.CSS_SELECTOR, "#job-progress progress")
    assert (bar.get_attribute("value"), bar.get_attribute("max")) == ("0.4", "1")
    assert "40%" in dashboard.text("#job-progress")
    dashboard.screenshot("job-progress")
    dashboard.open("/jobs?state=waiting")
    assert str(publish) in dashboard.text("main")
