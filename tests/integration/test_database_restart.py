"""A queue worker survives a restart of its database server: its threads ride out the lost
connections with the transient-error backoff, reconnect, and every job, enqueued before or
after the restart, ends archived as a success exactly once."""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

import sqla_proletarian as sp
from sqla_proletarian import statements

SEEN_METADATA = sa.MetaData()
SEEN = sa.Table("seen", SEEN_METADATA, sa.Column("job_id", sa.Uuid(), primary_key=True))


def wait_until(
    condition: Callable[[], bool], what: str, worker: sp.QueueWorker, timeout: float = 60.0
) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if not worker.running:
            pytest.fail(f"the worker stopped while waiting until {what}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting until {what}")
        time.sleep(0.1)


def enqueue_jobs(engine: sa.Engine, count: int) -> set[uuid.UUID]:
    with Session(engine) as session:
        ids = {sp.enqueue(session, "work", {"n": n}) for n in range(count)}
        session.commit()
    return ids


def archived_count(engine: sa.Engine) -> int:
    try:
        with engine.connect() as conn:
            query = sa.select(sa.func.count()).select_from(statements.ARCHIVE)
            return int(conn.execute(query).scalar_one())
    except sa.exc.DBAPIError:
        return -1  # the server is still coming back


def test_a_worker_survives_a_database_restart_and_finishes_every_job_once(
    database: Any, caplog: pytest.LogCaptureFixture
) -> None:
    if database.backend == "sqlite":
        pytest.skip("SQLite has no server to restart")
    caplog.set_level(logging.WARNING, logger="sqla_proletarian")
    engine = database.engine()  # no pool_pre_ping: the worker must cope with stale connections
    check = database.engine(poolclass=sa.pool.NullPool)
    SEEN_METADATA.create_all(engine)
    before = enqueue_jobs(engine, 40)

    def handler(job: sp.JobContext) -> None:
        job.session.execute(sa.insert(SEEN).values(job_id=job.job_id))
        time.sleep(0.02)

    worker = sp.create_queue_worker(
        engine,
        handler,
        handler_mode="advanced",
        worker_threads=2,
        polling_interval=0.05,
        worker_id="restart-test",
    )
    with worker:
        wait_until(lambda: archived_count(check) >= 5, "the worker is under way", worker)
        restart = subprocess.run(
            [os.environ["SP_TESTDB_SCRIPT"], "restart", database.backend],
            capture_output=True,
            text=True,
            timeout=90,
        )
        assert restart.returncode == 0, restart.stderr
        after = enqueue_jobs(check, 40)
        wait_until(lambda: archived_count(check) == 80, "every job is archived", worker)
        threads = [t for t in threading.enumerate() if t.name.startswith("restart-test-")]
        assert worker.running
        assert sorted(t.name for t in threads if t.is_alive()) == [
            "restart-test-0",
            "restart-test-1",
        ]

    with check.connect() as conn:
        archived = conn.execute(
            sa.select(statements.ARCHIVE.c.job_id, statements.ARCHIVE.c.status)
        ).all()
        seen = set(conn.execute(sa.select(SEEN.c.job_id)).scalars())
        queued = conn.execute(sa.select(sa.func.count()).select_from(statements.JOB)).scalar()
    assert sorted(row.job_id for row in archived) == sorted(before | after)
    assert {row.status for row in archived} == {"success"}
    assert seen == before | after
    assert queued == 0
    names = [getattr(record, "event", None) for record in caplog.records]
    assert "transient-polling-error" in names, "the restart never reached the worker"
    assert "polling-error" not in names
    assert "job-worker-error" not in names
