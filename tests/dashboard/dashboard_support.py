"""Shared by the dashboard's tests: archive rows written as a worker writes them, a job held
by a live worker, and the dashboard served by a real server thread."""

from __future__ import annotations

import re
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from werkzeug.datastructures import MultiDict
from werkzeug.test import Client, TestResponse

import sqla_proletarian as sp
from sqla_proletarian import statements
from sqla_proletarian.dashboard.server import create_server, server_url
from sqla_proletarian.dashboard.web import WSGIApp


def archive(engine: sa.Engine, *rows: tuple[str, str, str, datetime]) -> list[uuid.UUID]:
    """Archived jobs, each ``(queue, job_type, status, finished_at)``; a failure's error is
    ``RuntimeError: <job type>``."""
    values = [
        {
            "job_id": uuid.uuid4(),
            "queue": queue,
            "job_type": job_type,
            "payload": '{"n": 1}',
            "attempts": 1,
            "enqueued_at": finished_at - timedelta(seconds=1),
            "process_at": finished_at - timedelta(seconds=1),
            "status": status,
            "finished_at": finished_at,
            "error": f"RuntimeError: {job_type}\nTraceback: ..." if status == "failure" else None,
        }
        for queue, job_type, status, finished_at in rows
    ]
    with engine.begin() as conn:
        conn.execute(sa.insert(statements.ARCHIVE), values)
    return [value["job_id"] for value in values]


@contextmanager
def holding(engine: sa.Engine, job_type: str = "block") -> Iterator[sp.QueueWorker]:
    """A worker whose handler holds every ``job_type`` job until the block ends (they are
    running, by a live worker); other jobs succeed."""
    release, started = threading.Event(), threading.Event()

    def handler(kind: str, payload: Any) -> None:
        if kind == job_type:
            started.set()
            assert release.wait(30)

    worker = sp.create_queue_worker(engine, handler, max_unclean_ends=10)
    worker.start()
    try:
        assert started.wait(10), "the worker never started the job"
        yield worker
    finally:
        release.set()
        worker.stop()


@contextmanager
def serving(app: WSGIApp) -> Iterator[str]:
    """``app`` served on 127.0.0.1 (a free port) by a thread; yields its URL."""
    server = create_server(app, "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, name="dashboard", daemon=True)
    thread.start()
    try:
        yield server_url(server)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


#: A form's CSRF token in a page.
_TOKEN = re.compile(r'name="csrf_token" value="([0-9a-f]{64})"')


def csrf_token(page: str) -> str:
    """The CSRF token of the first form in a page."""
    found = _TOKEN.search(page)
    assert found is not None, "the page has no form with a CSRF token"
    return found.group(1)


class Visitor:
    """A WSGI test client that keeps its cookies, as a browser does, and sends forms with
    the token of the page it last read."""

    def __init__(self, app: WSGIApp, **environ: Any) -> None:
        self.client = Client(app)
        self.environ = environ
        self.page = ""

    def get(self, path: str, **kw: Any) -> TestResponse:
        response = self.client.get(path, environ_overrides=self.environ, **kw)
        if response.mimetype == "text/html":
            self.page = response.get_data(as_text=True)
        return response

    def post(self, path: str, data: Any, *, token: str | None = None, **kw: Any) -> TestResponse:
        fields = list(data.items()) if isinstance(data, dict) else list(data)
        fields.append(("csrf_token", token if token is not None else csrf_token(self.page)))
        response = self.client.post(
            path, data=MultiDict(fields), environ_overrides=self.environ, **kw
        )
        if response.mimetype == "text/html":
            self.page = response.get_data(as_text=True)
        return response

    def act(self, action: str, data: Any, *, next: str = "/") -> TestResponse:
        """Send an action from the current page, confirm it, and follow to where it ends."""
        fields = [*(data.items() if isinstance(data, dict) else data), ("next", next)]
        asked = self.post(f"/actions/{action}", fields)
        assert asked.status_code == 200, asked.get_data(as_text=True)
        assert 'id="confirm"' in self.page
        done = self.post(f"/actions/{action}", [*fields, ("confirm", "yes")])
        assert done.status_code == 303, done.get_data(as_text=True)
        return self.get(done.headers["Location"].removeprefix(self.environ.get("SCRIPT_NAME", "")))


#: The lease owner that ``lease`` writes, as a lease-mode worker names itself.
LEASE_OWNER = "worker-1@host:4242/Thread-1"


def lease(engine: sa.Engine, job_id: uuid.UUID, *, expires_in: float, now: datetime) -> None:
    """Put a queued job under a lease as a lease-mode worker's claim writes it: the run
    counted in ``attempts``, ``due_at`` its own due time and ``process_at`` the lease's
    expiry, ``expires_in`` seconds after ``now`` (before it, for an expired lease)."""
    job = statements.JOB
    with engine.begin() as conn:
        due_at = conn.scalar(sa.select(job.c.process_at).where(job.c.job_id == job_id))
        conn.execute(
            sa.update(job)
            .where(job.c.job_id == job_id)
            .values(
                lease_token=uuid.uuid4(),
                lease_owner=LEASE_OWNER,
                heartbeat_at=now,
                due_at=due_at,
                process_at=now + timedelta(seconds=expires_in),
                attempts=job.c.attempts + 1,
            )
        )
