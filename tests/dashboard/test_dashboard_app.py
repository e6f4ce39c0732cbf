"""The dashboard as a WSGI application, driven by a test client on every backend: what each
page shows, the actions (confirmed, each one call of the library), and what keeps them
safe: CSRF tokens, same-origin checks, read-only mode, authorize, escaping, headers."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from dashboard_support import Visitor, archive, csrf_token, holding
from markupsafe import escape

import sqla_proletarian as sp
from sqla_proletarian.dashboard import actions, create_dashboard

HOSTILE = "<script>alert('x')</script>"
needs_job_control = pytest.mark.skipif(
    not actions.job_control(), reason="job control not merged yet"
)


def enqueue(engine: sa.Engine, job_type: str = "work", payload: Any = None, **kw: Any) -> uuid.UUID:
    with engine.begin() as conn:
        return sp.enqueue(conn, job_type, payload, **kw)


def test_overview_shows_each_queues_figures_and_its_json_the_same_with_a_chart(
    engine: sa.Engine,
) -> None:
    """Ready, scheduled, failed in the last hour per queue, in the page and in the JSON the
    page polls, which also has 60 minutes of successes and failures per queue."""
    enqueue(engine, queue="mail")
    enqueue(engine, queue="mail")
    enqueue(engine, queue="billing", process_in=600)
    now = sp.utc_now()
    archive(engine, ("billing", "charge", "failure", now), ("mail", "send", "success", now))
    visitor = Visitor(create_dashboard(engine))

    page = visitor.get("/")

    assert page.status_code == 200
    text = page.get_data(as_text=True)
    assert '<tr data-queue="billing">' in text and '<tr data-queue="mail">' in text
    data = visitor.get("/api/overview").json
    assert data is not None
    queues = {queue["queue"]: queue for queue in data["queues"]}
    assert (queues["mail"]["ready"], queues["mail"]["scheduled"]) == (2, 0)
    assert (queues["billing"]["scheduled"], queues["billing"]["failed_last_hour"]) == (1, 1)
    assert queues["mail"]["paused"] is (False if actions.job_control() else None)
    assert len(data["minutes"]) == 60 and data["minutes"][1] - data["minutes"][0] == 60
    # In the newest minute, or the one before if a minute began since the jobs finished.
    assert sum(queues["billing"]["chart"]["failed"][-2:]) == 1
    assert sum(queues["mail"]["chart"]["succeeded"][-2:]) == 1
    assert sum(queues["mail"]["chart"]["failed"]) == 0
    embedded = text.split('<script type="application/json" id="overview-data">')[1]
    assert json.loads(embedded.split("</script>")[0])["queues"][0]["queue"] == "billing"


def test_overview_shows_each_queues_limits_and_its_ready_jobs_waiting(engine: sa.Engine) -> None:
    """A queue with limits shows them (QueueLimits.describe()) and its ready jobs waiting, in
    the page and in the JSON it polls; a queue without limits shows a dash for both."""
    enqueue(engine, queue="partner-api", concurrency_key="tenant-1")
    enqueue(engine, queue="partner-api", concurrency_key="tenant-2")
    enqueue(engine, queue="mail")
    limits = sp.QueueLimits(max_running_per_key=1, rate_limit=(10, 1.0))
    with engine.begin() as conn:
        sp.set_queue_limits(conn, "partner-api", max_running_per_key=1, rate_limit=(10, 1.0))
    visitor = Visitor(create_dashboard(engine))

    text = visitor.get("/").get_data(as_text=True)

    row = text.split('<tr data-queue="partner-api">')[1].split("</tr>")[0]
    assert f'<td class="limits" data-field="limits_text">{limits.describe()}</td>' in row
    assert '<td class="num" data-field="waiting_text">2</td>' in row
    other = text.split('<tr data-queue="mail">')[1].split("</tr>")[0]
    assert '<td class="limits" data-field="limits_text">—</td>' in other
    assert '<td class="num" data-field="waiting_text">—</td>' in other
    data = visitor.get("/api/overview").json
    assert data is not None
    queues = {queue["queue"]: queue for queue in data["queues"]}
    api = queues["partner-api"]
    assert (api["limits"], api["limits_text"], api["waiting"]) == (
        limits.as_dict(),
        limits.describe(),
        2,
    )
    assert (queues["mail"]["limits"], queues["mail"]["waiting"]) == (None, None)


def test_jobs_pages_list_by_state_and_open_a_jobs_detail(engine: sa.Engine) -> None:
    """The jobs list filters by state, queue and job type and links each job to its page,
    which shows its payload and, for a failure, the archived error."""
    ready = enqueue(engine, "mail", {"to": "ada@example.com"}, queue="mail")
    enqueue(engine, "report", queue="mail")
    [failed] = archive(engine, ("billing", "charge", "failure", sp.utc_now()))
    visitor = Visitor(create_dashboard(engine))

    listed = visitor.get("/jobs?state=ready&queue=mail&job_type=mail").get_data(as_text=True)
    assert f'href="/jobs/{ready}"' in listed and listed.count("<tr data-job-id=") == 1
    detail = visitor.get(f"/jobs/{ready}").get_data(as_text=True)
    assert "ada@example.com" in detail and 'id="job-state">ready<' in detail
    failures = visitor.get("/jobs?state=failed").get_data(as_text=True)
    assert f'href="/jobs/{failed}"' in failures and "RuntimeError: charge" in failures
    page = visitor.get(f"/jobs/{failed}").get_data(as_text=True)
    assert 'id="error">RuntimeError: charge\nTraceback: ...</pre>' in page
    missing = visitor.get(f"/jobs/{uuid.uuid4()}")
    assert missing.status_code == 404 and "no job" in missing.get_data(as_text=True)


def test_a_failed_job_put_back_keeps_its_earlier_failure_on_its_page(engine: sa.Engine) -> None:
    """After retry_failed, the job's page (queued again, then succeeded) still shows the
    earlier failure's error and attempts, escaped."""
    enqueue(engine, "charge")

    def hostile(job_type: str, payload: Any) -> None:
        raise RuntimeError(HOSTILE)

    assert sp.process_next_job(engine, hostile)
    [failed] = sp.failed_jobs(engine)
    assert sp.retry_failed(engine, [failed.job_id]) == 1
    visitor = Visitor(create_dashboard(engine))

    for state in ("ready", "succeeded"):
        page = visitor.get(f"/jobs/{failed.job_id}").get_data(as_text=True)
        assert f'id="job-state">{state}<' in page
        history = page.split('<ol class="history" id="history">')[1].split("</ol>")[0]
        assert "failed" in history and "after 1 attempt" in history
        assert str(escape(f"RuntimeError: {HOSTILE}")) in history and HOSTILE not in page
        assert sp.process_next_job(engine, lambda job_type, payload: None) is (state == "ready")


def test_pages_are_keyset_paginated_and_never_use_offset(engine: sa.Engine) -> None:
    """120 ready jobs come as pages of 50, 50 and 20 through the "Next page" links, each job
    once, and no statement the dashboard runs skips rows with an OFFSET (SQLite's compiler
    writes ``OFFSET 0`` after every LIMIT: that one skips nothing)."""
    with engine.begin() as conn:
        sp.enqueue_many(conn, [("work", {"n": n}) for n in range(120)])
    statements: list[tuple[str, Any]] = []

    def record(conn: Any, cursor: Any, statement: str, parameters: Any, *args: Any) -> None:
        statements.append((statement.upper(), parameters))

    sa.event.listen(engine, "before_cursor_execute", record)
    visitor = Visitor(create_dashboard(engine))
    seen: list[str] = []
    path: str | None = "/jobs?state=ready"
    sizes = []
    while path is not None:
        text = visitor.get(path).get_data(as_text=True)
        rows = [part.split('"')[0] for part in text.split('<tr data-job-id="')[1:]]
        sizes.append(len(rows))
        seen.extend(rows)
        found = text.split('rel="next" id="next-page"')[0].rsplit('href="', 1)
        path = found[1].split('"')[0].replace("&amp;", "&") if "next-page" in text else None
    assert sizes == [50, 50, 20]
    assert len(set(seen)) == 120
    skipping = [
        text
        for text, parameters in statements
        if "OFFSET" in text
        and not (
            engine.dialect.name == "sqlite" and text.endswith("OFFSET ?") and parameters[-1] == 0
        )
    ]
    assert statements and not skipping


def test_hostile_job_types_and_payloads_are_shown_as_text(engine: sa.Engine) -> None:
    """A job type, queue and payload holding markup come out escaped on every page, and the
    JSON the overview embeds cannot close its script element."""
    job_id = enqueue(engine, HOSTILE, {"html": HOSTILE, HOSTILE: [HOSTILE]}, queue=HOSTILE)
    visitor = Visitor(create_dashboard(engine))

    for path in ("/", f"/jobs?state=ready&queue={HOSTILE}", f"/jobs/{job_id}"):
        text = visitor.get(path).get_data(as_text=True)
        assert "<script>alert" not in text, path
        assert "&lt;script&gt;alert(" in text, path


def test_every_response_carries_the_security_headers(engine: sa.Engine) -> None:
    """A script-src of its own files only (no inline script), nosniff, no framing, on pages,
    JSON, static files and errors alike; the CSRF cookie is HttpOnly and SameSite=Strict."""
    visitor = Visitor(create_dashboard(engine))
    first = visitor.get("/")
    assert "HttpOnly; SameSite=Strict" in first.headers["Set-Cookie"]
    for path in ("/", "/api/overview", "/static/dashboard.js", "/nowhere"):
        response = visitor.get(path)
        policy = response.headers["Content-Security-Policy"]
        assert "script-src 'self';" in policy and "unsafe-inline" not in policy, path
        assert response.headers["X-Content-Type-Options"] == "nosniff", path
        assert response.headers["X-Frame-Options"] == "DENY", path
    assert (
        visitor.get("/static/uPlot.iife.min.js")
        .headers["Content-Type"]
        .startswith("text/javascript")
    )
    assert visitor.get("/static/../app.py").status_code == 404


def test_retrying_one_failure_asks_first_then_puts_it_back_in_the_queue(
    engine: sa.Engine,
) -> None:
    """The first POST only shows what would happen; the confirmed one calls retry_failed
    and comes back to the list with a notice, the job gone from the failures."""
    [failed, other] = archive(
        engine,
        ("default", "charge", "failure", sp.utc_now()),
        ("default", "charge", "failure", sp.utc_now()),
    )
    visitor = Visitor(create_dashboard(engine))
    visitor.get("/jobs?state=failed")

    asked = visitor.post("/actions/retry", {"job_id": str(failed), "next": "/jobs?state=failed"})
    assert asked.status_code == 200 and str(failed) in visitor.page
    assert len(sp.list_jobs(engine, "failed").jobs) == 2  # nothing happened yet

    back = visitor.act("retry", {"job_id": str(failed)}, next="/jobs?state=failed")

    assert "1 failed job(s) put back in the queue." in back.get_data(as_text=True)
    assert [job.job_id for job in sp.list_jobs(engine, "failed").jobs] == [other]
    assert [job.job_id for job in sp.list_jobs(engine, "ready").jobs] == [failed]
    assert str(failed) not in visitor.get("/jobs?state=failed").get_data(as_text=True)


def test_retrying_a_selection_and_every_failure_of_a_type(engine: sa.Engine) -> None:
    """Ticked failures go back together; "every failed job of type X" leaves other types."""
    now = sp.utc_now()
    a, b, c, d = archive(
        engine,
        ("default", "charge", "failure", now),
        ("default", "charge", "failure", now),
        ("default", "mail", "failure", now),
        ("default", "mail", "failure", now),
    )
    visitor = Visitor(create_dashboard(engine))
    visitor.get("/jobs?state=failed")
    visitor.act("retry", [("job_id", str(a)), ("job_id", str(c))])
    assert {job.job_id for job in sp.list_jobs(engine, "failed").jobs} == {b, d}

    visitor.get("/jobs?state=failed&job_type=mail")
    assert "Retry every failed job of type mail" in visitor.page
    done = visitor.act("retry", {"all": "yes", "job_type": "mail"})
    assert "1 failed job(s) put back" in done.get_data(as_text=True)
    assert [job.job_id for job in sp.list_jobs(engine, "failed").jobs] == [b]


def test_pruning_the_archive_deletes_what_finished_before_the_given_days(
    engine: sa.Engine,
) -> None:
    """The prune form's days and status reach prune_archive; bad days are refused."""
    now = sp.utc_now()
    old_ok, old_bad, new_ok = archive(
        engine,
        ("default", "t", "success", now - timedelta(days=40)),
        ("default", "t", "failure", now - timedelta(days=40)),
        ("default", "t", "success", now),
    )
    visitor = Visitor(create_dashboard(engine))
    visitor.get("/")
    done = visitor.act("prune", {"older_than_days": "30", "status": "success"})
    assert "1 archived job(s) deleted." in done.get_data(as_text=True)
    assert sp.get_job(engine, old_ok) is None
    assert sp.get_job(engine, old_bad) is not None and sp.get_job(engine, new_ok) is not None
    refused = visitor.post("/actions/prune", {"older_than_days": "-1"})
    assert refused.status_code == 400 and "give a number of days" in visitor.page


def test_posts_without_a_valid_token_or_from_another_site_are_refused(
    engine: sa.Engine,
) -> None:
    """No cookie, a wrong token, a token of another dashboard's secret, or an Origin or
    Referer of another host: 403, and nothing is retried."""
    [failed] = archive(engine, ("default", "charge", "failure", sp.utc_now()))
    app = create_dashboard(engine)
    confirmed = {"job_id": str(failed), "confirm": "yes"}
    visitor = Visitor(app)
    visitor.get("/")
    token = csrf_token(visitor.page)
    stranger = Visitor(app)  # never got the cookie
    assert stranger.post("/actions/retry", confirmed, token=token).status_code == 403
    assert visitor.post("/actions/retry", confirmed, token="0" * 64).status_code == 403
    other = Visitor(create_dashboard(engine))
    other.get("/")
    other.client.set_cookie(
        "sp_dashboard_csrf", visitor.client.get_cookie("sp_dashboard_csrf").value
    )
    assert other.post("/actions/retry", confirmed, token=token).status_code == 403
    for header in ("Origin", "Referer"):
        evil = visitor.post(
            "/actions/retry", confirmed, token=token, headers={header: "https://evil.example"}
        )
        assert evil.status_code == 403 and "another site" in visitor.page
    assert [job.job_id for job in sp.list_jobs(engine, "failed").jobs] == [failed]
    same_site = visitor.post(
        "/actions/retry", confirmed, token=token, headers={"Origin": "http://localhost"}
    )
    assert same_site.status_code == 303
    assert sp.list_jobs(engine, "failed").jobs == ()


def test_read_only_hides_every_action_and_refuses_every_post(engine: sa.Engine) -> None:
    """No form posts anywhere on any page, and a POST with a valid token is a 403."""
    [failed] = archive(engine, ("default", "charge", "failure", sp.utc_now()))
    enqueue(engine)
    visitor = Visitor(create_dashboard(engine, read_only=True))
    for path in ("/", "/jobs?state=failed", "/jobs?state=ready", f"/jobs/{failed}"):
        text = visitor.get(path).get_data(as_text=True)
        assert 'method="post"' not in text, path
    assert "read-only" in visitor.page
    token = csrf_token('name="csrf_token" value="' + "0" * 64 + '"')
    for action in ("retry", "prune", "cancel", "pause", "resume"):
        refused = visitor.post(f"/actions/{action}", {"job_id": str(failed)}, token=token)
        assert refused.status_code == 403 and "read-only" in visitor.page
    assert len(sp.list_jobs(engine, "failed").jobs) == 1


def test_authorize_sees_the_environ_and_false_is_a_403_everywhere(engine: sa.Engine) -> None:
    """Pages, JSON, static files and actions all ask ``authorize`` first."""
    asked: list[str] = []

    def authorize(environ: dict[str, Any]) -> bool:
        asked.append(environ["PATH_INFO"])
        return environ.get("HTTP_X_ADMIN") == "yes"

    app = create_dashboard(engine, authorize=authorize)
    outsider, admin = Visitor(app), Visitor(app, HTTP_X_ADMIN="yes")
    for path in ("/", "/api/overview", "/jobs", "/static/dashboard.js"):
        refused = outsider.get(path)
        assert refused.status_code == 403, path
        assert admin.get(path).status_code == 200, path
    assert "may not see this dashboard" in outsider.get("/").get_data(as_text=True)
    assert outsider.post("/actions/prune", {}, token="x").status_code == 403
    assert "/api/overview" in asked


def test_links_and_forms_start_with_the_mount_point(engine: sa.Engine) -> None:
    """Under SCRIPT_NAME /admin/queue every link, script, form and redirect points inside it."""
    [failed] = archive(engine, ("default", "charge", "failure", sp.utc_now()))
    visitor = Visitor(create_dashboard(engine), SCRIPT_NAME="/admin/queue")
    first = visitor.get("/")
    assert "; Path=/admin/queue; HttpOnly" in first.headers["Set-Cookie"]
    text = first.get_data(as_text=True)
    assert 'src="/admin/queue/static/dashboard.js"' in text
    assert 'data-source="/admin/queue/api/overview"' in text
    assert 'action="/admin/queue/actions/prune"' in text
    assert 'href="/admin/queue/jobs?state=failed"' in text
    visitor.get("/jobs?state=failed")
    assert f'href="/admin/queue/jobs/{failed}"' in visitor.page
    done = visitor.post("/actions/retry", {"job_id": str(failed), "confirm": "yes"})
    assert done.headers["Location"].startswith("/admin/queue/?done=retried")


def test_bad_requests_get_a_page_that_says_what_is_wrong(engine: sa.Engine) -> None:
    """An unknown state or cursor is a 400 with the library's message; an unknown page a
    404; a GET of an action a 405; an action that does not exist a 404; a redirect never
    leaves the dashboard."""
    [failed] = archive(engine, ("default", "charge", "failure", sp.utc_now()))
    visitor = Visitor(create_dashboard(engine))
    bad_state = visitor.get("/jobs?state=done")
    assert bad_state.status_code == 400 and "give one of ready" in visitor.page
    assert visitor.get("/jobs?after=nonsense").status_code == 400
    assert "not a cursor of this list" in visitor.page
    assert visitor.get("/elsewhere").status_code == 404
    assert visitor.get("/actions/retry").status_code == 405
    visitor.get("/")
    token = csrf_token(visitor.page)
    assert visitor.post("/actions/explode", {}, token=token).status_code == 404
    assert visitor.post("/actions/retry", {"job_id": "not-an-id"}, token=token).status_code == 400
    assert visitor.post("/actions/retry", {}, token=token).status_code == 400
    away = visitor.post(
        "/actions/retry",
        {"job_id": str(failed), "confirm": "yes", "next": "//evil.example/"},
        token=token,
    )
    assert away.headers["Location"].startswith("/?done=retried")


def test_a_database_without_the_tables_gets_a_500_that_says_so(empty_database: Any) -> None:
    """The error page names the missing tables; the log has the traceback."""
    visitor = Visitor(create_dashboard(empty_database.engine()))
    response = visitor.get("/")
    assert response.status_code == 500
    assert "the job tables are missing" in visitor.page


def test_create_dashboard_refuses_what_it_cannot_use(engine: sa.Engine) -> None:
    with pytest.raises(sp.ConfigurationError, match="needs a sqlalchemy Engine"):
        create_dashboard(engine.connect())  # type: ignore[arg-type]
    with pytest.raises(sp.ConfigurationError, match="authorize"):
        create_dashboard(engine, authorize=True)  # type: ignore[arg-type]
    with pytest.raises(sp.ConfigurationError, match="16 random bytes"):
        create_dashboard(engine, secret=b"short")
    with pytest.raises(sp.ConfigurationError, match="refresh_seconds=0"):
        create_dashboard(engine, refresh_seconds=0)


@pytest.mark.skipif(actions.job_control(), reason="the library has job control")
def test_without_job_control_there_is_no_cancel_or_pause(engine: sa.Engine) -> None:
    """No such buttons, "—" for paused, and their POSTs are 404s."""
    job_id = enqueue(engine)
    visitor = Visitor(create_dashboard(engine))
    assert "/actions/pause" not in visitor.get("/").get_data(as_text=True)
    token = csrf_token(visitor.page)
    assert "/actions/cancel" not in visitor.get("/jobs?state=ready").get_data(as_text=True)
    cancel = {"job_id": str(job_id), "confirm": "yes"}
    assert visitor.post("/actions/cancel", cancel, token=token).status_code == 404
    assert visitor.post("/actions/pause", {"queue": "default"}, token=token).status_code == 404
    assert [job.job_id for job in sp.list_jobs(engine, "ready").jobs] == [job_id]


@needs_job_control
def test_cancelling_a_queued_job_and_pausing_a_queue(engine: sa.Engine) -> None:
    """Cancel takes the job out of the queue (archived as cancelled); pause and resume
    show in the overview's paused column."""
    job_id = enqueue(engine)
    visitor = Visitor(create_dashboard(engine))
    visitor.get("/jobs?state=ready")
    done = visitor.act("cancel", {"job_id": str(job_id)}, next="/jobs?state=ready")
    assert f"Job {job_id} cancelled." in done.get_data(as_text=True)
    assert [job.job_id for job in sp.list_jobs(engine, "cancelled").jobs] == [job_id]
    enqueue(engine)
    visitor.get("/")
    visitor.act("pause", {"queue": "default"})
    assert visitor.get("/api/overview").json["queues"][0]["paused"] is True  # type: ignore[index]
    visitor.get("/")
    visitor.act("resume", {"queue": "default"})
    assert visitor.get("/api/overview").json["queues"][0]["paused"] is False  # type: ignore[index]


def test_a_running_job_shows_as_running(engine: sa.Engine) -> None:
    """The overview counts it and the running list shows it."""
    job_id = enqueue(engine, "block")
    visitor = Visitor(create_dashboard(engine))
    with holding(engine):
        assert visitor.get("/api/overview").json["queues"][0]["running"] == 1  # type: ignore[index]
        assert str(job_id) in visitor.get("/jobs?state=running").get_data(as_text=True)


def _render(template: str) -> None:
    """The test's own helper, where the handler's failure is raised."""
    raise ValueError(f"cannot render {template}")


def render(job_type: str, payload: Any) -> None:
    _render(payload["template"])


def test_a_failures_page_shows_its_whole_traceback_escaped(engine: sa.Engine) -> None:
    """The job's page shows the archived traceback in its <pre>, this file's frames and the
    innermost included, with markup in the message escaped; the failures list shows its
    first line (the exception's type and message)."""
    job_id = enqueue(engine, "render", {"template": HOSTILE})
    assert sp.process_next_job(engine, render)
    detail = sp.get_job(engine, job_id)
    assert detail is not None and detail.error is not None
    visitor = Visitor(create_dashboard(engine))

    page = visitor.get(f"/jobs/{job_id}").get_data(as_text=True)
    listed = visitor.get("/jobs?state=failed").get_data(as_text=True)

    shown = page.split('<pre class="error" id="error">')[1].split("</pre>")[0]
    assert "<script>" not in shown and f"cannot render {escape(HOSTILE)}" in shown
    assert shown == str(escape(detail.error))
    assert f"File &#34;{__file__}&#34;" in shown and "in _render" in shown and "in render" in shown
    assert f"ValueError: cannot render {escape(HOSTILE)}</td>" in listed
