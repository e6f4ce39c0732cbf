"""Shared by the dashboard's tests: archive rows written as a worker writes them, a job held
by a live worker, and the dashboard served by a real server thread."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa

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
            "error": f"RuntimeError: {job_type}\nTraceback: line 1"
            if status == "failure"
            else None,
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
