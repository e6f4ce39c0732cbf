"""The dashboard's pages and actions: each view reads through the library's public
functions, or makes one call of its API, and renders a template.

Every action is confirmed: a POST without ``confirm=yes`` shows what it would do and a
button that sends the same fields again with it. Done, the browser is sent back where it
came from (``next``) with a notice of what happened.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from http import HTTPStatus
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

import sqla_proletarian as sp
from sqla_proletarian.dashboard import actions
from sqla_proletarian.dashboard.payloads import render_payload
from sqla_proletarian.dashboard.web import (
    HTTPError,
    Request,
    Response,
    json_response,
    redirect,
    static_file,
)

if TYPE_CHECKING:
    from sqla_proletarian.dashboard.app import Dashboard

#: Minutes of the overview's charts.
CHART_MINUTES = 60
#: Jobs per page of the jobs list.
PAGE_SIZE = 50
#: The most neighbours a job's page lists on each side of its graph.
GRAPH_NODES = 50
#: Job ids a confirmation lists before it says how many more.
LISTED_IDS = 20
#: The query fields of a notice, left out of the ``next`` of the page that shows it.
NOTICE_FIELDS = ("done", "count", "subject")

#: What each action did, as the notice says it ({count}, {subject} filled in).
NOTICES = {
    "retried": "{count} failed job(s) put back in the queue.",
    "cancelled": "Job {subject} cancelled.",
    "cancel-requested": "Job {subject} runs under a lease: its worker was asked to stop it "
    "and archives it as cancelled within a heartbeat.",
    "not-cancelled": "Job {subject} was no longer queued: nothing was cancelled.",
    "paused": "Queue {subject} paused: its workers claim none of its jobs until resumed.",
    "resumed": "Queue {subject} resumed.",
    "pruned": "{count} archived job(s) deleted.",
}


# --- pages -------------------------------------------------------------------------------


def overview(dash: Dashboard, request: Request) -> Response:
    data = overview_data(dash)
    return dash.render(
        request,
        "overview.html",
        data=data,
        refresh_ms=int(dash.refresh_seconds * 1000),
        replica_lag=data.get("replica_lag"),
    )


def overview_json(dash: Dashboard, request: Request) -> Response:
    return json_response(overview_data(dash))


def overview_data(dash: Dashboard) -> dict[str, Any]:
    """Per queue: its counts, whether it is paused, its limits and the ready jobs waiting
    under them, and what it archived minute by minute; read from a replica, how far it
    lags (``replica_lag``)."""
    now = sp.utc_now()
    reads = dash.read_engine
    statuses = sp.queue_status(reads, clock=lambda: now)
    finished = sp.finished_per_minute(reads, minutes=CHART_MINUTES, clock=lambda: now)
    paused = actions.paused(reads)
    lag = dash.replica_lag()
    first = now.replace(second=0, microsecond=0) - timedelta(minutes=CHART_MINUTES - 1)
    minutes = [first + timedelta(minutes=index) for index in range(CHART_MINUTES)]
    charts: dict[str, dict[str, list[int]]] = {}
    for row in finished:
        chart = charts.setdefault(row.queue, _empty_chart())
        index = round((row.minute - first).total_seconds() / 60)
        chart["succeeded"][index] = row.succeeded
        chart["failed"][index] = row.failed
    known = {status.queue: status for status in statuses}
    queues = []
    for name in sorted(set(known) | set(paused or ())):
        status = known.get(name) or sp.QueueStatus(name, 0, 0, 0, None, 0, 0)
        age = status.oldest_ready_age_s
        queues.append(
            {
                **asdict(status),
                "oldest_ready_age_s": round(age, 3) if age is not None else None,
                "oldest_ready_age": age_text(age),
                "limits": status.limits.as_dict() if status.limits else None,
                "limits_text": status.limits.describe() if status.limits else "—",
                "waiting_text": "—" if status.waiting is None else str(status.waiting),
                "paused": None if paused is None else name in paused,
                "chart": charts.get(name, _empty_chart()),
            }
        )
    return {
        "generated_at": now.isoformat(),
        "updated": now.strftime("%H:%M:%S UTC"),
        "minutes": [int(minute.timestamp()) for minute in minutes],
        "queues": queues,
        **({"replica_lag": lag} if lag is not None else {}),
    }


def jobs(dash: Dashboard, request: Request) -> Response:
    state = request.arg("state") or "ready"
    queue, job_type, after = request.arg("queue"), request.arg("job_type"), request.arg("after")
    page = sp.list_jobs(
        dash.read_engine, state, queue=queue, job_type=job_type, after=after, limit=PAGE_SIZE
    )
    first = request.url("/jobs", state=state, queue=queue, job_type=job_type)
    later = (
        request.url("/jobs", state=state, queue=queue, job_type=job_type, after=page.next_cursor)
        if page.next_cursor
        else None
    )
    return dash.render(
        request,
        "jobs.html",
        page=page,
        states=sp.JOB_STATES,
        state=state,
        queue=queue,
        job_type=job_type,
        first_url=first if after else None,
        next_url=later,
    )


def job(dash: Dashboard, request: Request, job_id: str) -> Response:
    found = sp.get_job(dash.read_engine, job_id)
    if found is None:
        raise HTTPError(
            HTTPStatus.NOT_FOUND,
            f"there is no job {job_id} in the queue or the archive (pruned, or never enqueued)",
        )
    return dash.render(
        request,
        "job.html",
        job=found,
        payload=render_payload(found.payload),
        graph=_graph(dash, found),
    )


def _graph(dash: Dashboard, job: sp.JobDetail) -> dict[str, Any]:
    """A job's neighbours in its graph, each with its own state (``get_job``), at most
    ``GRAPH_NODES`` a side (and how many more there are)."""
    graph: dict[str, Any] = {}
    for side in ("depends_on", "dependents"):
        ids = getattr(job, side)
        graph[side] = [
            {"job_id": job_id, "job": sp.get_job(dash.read_engine, job_id)}
            for job_id in ids[:GRAPH_NODES]
        ]
        graph[f"{side}_more"] = max(0, len(ids) - GRAPH_NODES)
    return graph


def static(dash: Dashboard, request: Request, name: str) -> Response:
    return static_file(name)


# --- actions -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """An action read from its form: what the confirmation says, and how to do it."""

    verb: str
    summary: str
    items: tuple[str, ...]
    #: Does it: returns the notice's code, count and subject.
    perform: Callable[[], tuple[str, int, str | None]]


def action(dash: Dashboard, request: Request, name: str) -> Response:
    planners = {
        "retry": _plan_retry,
        "prune": _plan_prune,
        "cancel": _plan_cancel,
        "pause": _plan_pause,
        "resume": _plan_resume,
    }
    planner = planners.get(name)
    if planner is None or (name in ("cancel", "pause", "resume") and not dash.job_control):
        raise HTTPError(HTTPStatus.NOT_FOUND, f"this dashboard has no {name!r} action")
    plan = planner(dash, request)
    back = _next(request)
    if request.field("confirm") != "yes":
        fields = [
            (key, value)
            for key, values in request.form.items()
            if key not in ("confirm", "csrf_token")
            for value in values
        ]
        return dash.render(
            request,
            "confirm.html",
            plan=plan,
            fields=fields,
            back=request.root + back,
            action_url=request.url(request.path),
        )
    done, count, subject = plan.perform()
    query = urlencode({"done": done, "count": count, "subject": subject or ""})
    return redirect(request.root + back + ("&" if "?" in back else "?") + query)


def _plan_retry(dash: Dashboard, request: Request) -> Plan:
    queue, job_type = request.field("queue"), request.field("job_type")
    if request.field("all") == "yes":
        scope = " and ".join(
            part
            for part in (
                f"of job type {job_type!r}" if job_type else "",
                f"in queue {queue!r}" if queue else "",
            )
            if part
        )
        summary = f"Put every failed job {scope or 'in the archive'} back in the queue?"
        return Plan(
            "Retry them",
            summary,
            (),
            lambda: (
                "retried",
                actions.retry(dash.engine, None, queue=queue, job_type=job_type),
                None,
            ),
        )
    ids = [_job_id(value) for value in request.fields("job_id")]
    if not ids:
        raise HTTPError(HTTPStatus.BAD_REQUEST, "no job was selected: tick the jobs to retry")
    shown = tuple(str(job_id) for job_id in ids[:LISTED_IDS])
    more = (f"and {len(ids) - LISTED_IDS} more",) if len(ids) > LISTED_IDS else ()
    return Plan(
        "Retry",
        f"Put {len(ids)} failed job(s) back in the queue, due now, with attempts from zero?",
        shown + more,
        lambda: ("retried", actions.retry(dash.engine, ids), None),
    )


def _plan_prune(dash: Dashboard, request: Request) -> Plan:
    text = request.field("older_than_days") or ""
    try:
        days = float(text)
    except ValueError:
        days = math.nan
    if not math.isfinite(days) or days < 0 or days > 36500:
        raise HTTPError(
            HTTPStatus.BAD_REQUEST,
            f"older than {text!r} days: give a number of days from 0 to 36500, e.g. 30",
        )
    status = request.field("status")
    if status not in (None, "success", "failure"):
        raise HTTPError(HTTPStatus.BAD_REQUEST, "status: give success, failure, or nothing")
    which = {None: "archived jobs", "success": "succeeded jobs", "failure": "failed jobs"}[status]
    return Plan(
        "Delete them",
        f"Delete the {which} that finished more than {days:g} days ago? This cannot be undone.",
        (),
        lambda: (
            "pruned",
            actions.prune(dash.engine, timedelta(days=days), status),
            None,
        ),
    )


def _plan_cancel(dash: Dashboard, request: Request) -> Plan:
    job_id = _job_id(request.field("job_id") or "")

    def perform() -> tuple[str, int, str]:
        done = actions.cancel(dash.engine, job_id)
        # A job under a live lease stays queued, running, until its worker stops it. Read
        # where the cancel wrote: a replica may not have it yet.
        still = sp.get_job(dash.engine, job_id) if done else None
        requested = still is not None and still.state == "running"
        notice = "cancel-requested" if requested else "cancelled" if done else "not-cancelled"
        return notice, int(done), str(job_id)

    return Plan("Cancel the job", f"Cancel job {job_id}? It will not run.", (), perform)


def _plan_pause(dash: Dashboard, request: Request) -> Plan:
    queue = _queue(request)

    def perform() -> tuple[str, int, str]:
        actions.pause(dash.engine, queue)
        return "paused", 0, queue

    summary = f"Pause queue {queue!r}? Its workers stop claiming its jobs; running jobs finish."
    return Plan("Pause", summary, (), perform)


def _plan_resume(dash: Dashboard, request: Request) -> Plan:
    queue = _queue(request)

    def perform() -> tuple[str, int, str]:
        actions.resume(dash.engine, queue)
        return "resumed", 0, queue

    return Plan("Resume", f"Resume queue {queue!r}? Its workers claim its jobs again.", (), perform)


def _job_id(value: str) -> uuid.UUID:
    try:
        return uuid.UUID(value)
    except ValueError:
        raise HTTPError(HTTPStatus.BAD_REQUEST, f"{value!r} is not a job id") from None


def _queue(request: Request) -> str:
    queue = request.field("queue")
    if queue is None:
        raise HTTPError(HTTPStatus.BAD_REQUEST, "no queue was given")
    return queue


def _next(request: Request) -> str:
    """Where to go after the action: a path of this dashboard (never another site)."""
    back = request.field("next") or "/"
    if not back.startswith("/") or back.startswith("//") or any(c in back for c in "\\\r\n"):
        return "/"
    return back


def here(request: Request) -> str:
    """This page's path and query, less a notice's fields: the ``next`` of its forms."""
    query = [
        (key, value)
        for key, values in request.query.items()
        if key not in NOTICE_FIELDS
        for value in values
    ]
    return request.path + (f"?{urlencode(query)}" if query else "")


def notice(request: Request) -> str | None:
    """The sentence that tells what the action before this page did."""
    template = NOTICES.get(request.arg("done") or "")
    if template is None:
        return None
    count = request.arg("count") or "0"
    return template.format(count=count if count.isdigit() else "?", subject=request.arg("subject"))


# --- figures -------------------------------------------------------------------------------


def age_text(seconds: float | None) -> str:
    """An age as 12.3s, 5m 3s, 2h 5m or 3d 4h; a dash for none."""
    if seconds is None:
        return "—"
    if seconds < 60:
        return f"{seconds:.1f}s"
    whole = int(seconds)
    for unit, size, smaller, small_size in (("d", 86400, "h", 3600), ("h", 3600, "m", 60)):
        if whole >= size:
            return f"{whole // size}{unit} {whole % size // small_size}{smaller}"
    return f"{whole // 60}m {whole % 60}s"


def _empty_chart() -> dict[str, list[int]]:
    return {"succeeded": [0] * CHART_MINUTES, "failed": [0] * CHART_MINUTES}
