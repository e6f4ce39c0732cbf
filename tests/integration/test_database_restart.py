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
from sqla_proletarian.worker import DEFAULT_RECONNECT_GRACE

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


def restart_server(backend: str) -> None:
    restart = subprocess.run(
        [os.environ["SP_TESTDB_SCRIPT"], "restart", backend],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert restart.returncode == 0, restart.stderr


def test_long_jobs_across_server_restarts_never_run_twice_at_once_and_are_never_charged(
    database: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Two long jobs run while the server restarts twice, with idle threads of a second
    worker polling all along: the restarts end the running jobs' sessions (and their row
    locks) but not their handlers, so no other thread may start them meanwhile, and with
    max_unclean_ends=1 one charged run would archive a job as crashed. Each job's first run
    ends without an outcome (its transaction died), then it runs again, alone, and succeeds
    at its first counted attempt."""
    if database.backend == "sqlite":
        pytest.skip("SQLite has no server to restart")
    caplog.set_level(logging.INFO, logger="sqla_proletarian")
    engine = database.engine()
    check = database.engine(poolclass=sa.pool.NullPool)
    ids = enqueue_jobs(engine, 2)
    release = threading.Event()
    lock = threading.Lock()
    running: dict[uuid.UUID, int] = dict.fromkeys(ids, 0)
    starts: list[uuid.UUID] = []
    overlaps: list[uuid.UUID] = []

    def handler(job: sp.JobContext) -> None:
        with lock:
            starts.append(job.job_id)
            running[job.job_id] += 1
            if running[job.job_id] > 1:
                overlaps.append(job.job_id)
        try:
            release.wait(60)
        finally:
            with lock:
                running[job.job_id] -= 1

    options: dict[str, Any] = {
        "handler_mode": "advanced",
        "worker_threads": 2,
        "polling_interval": 0.05,
        "max_unclean_ends": 1,
    }
    first = sp.create_queue_worker(engine, handler, worker_id="long-a", **options)
    second = sp.create_queue_worker(engine, handler, worker_id="long-b", **options)
    with first, second:
        wait_until(lambda: len(starts) == 2, "both jobs run", first)
        for _ in range(2):
            restart_server(database.backend)
            # Longer than the reconnect grace: every idle thread has polled the jobs by now.
            time.sleep(DEFAULT_RECONNECT_GRACE + 2)
            assert len(starts) == 2, "a job started again while its first run went on"
        release.set()
        wait_until(lambda: archived_count(check) == 2, "both jobs are archived", first)
    with check.connect() as conn:
        rows = conn.execute(
            sa.select(
                statements.ARCHIVE.c.job_id,
                statements.ARCHIVE.c.status,
                statements.ARCHIVE.c.attempts,
            )
        ).all()
        records = conn.execute(sa.select(sa.func.count()).select_from(sp.JobRun)).scalar()
    assert sorted((row.job_id, row.status, row.attempts) for row in rows) == sorted(
        (job_id, "success", 1) for job_id in ids
    )
    assert overlaps == []
    assert sorted(starts) == sorted([*ids, *ids])
    names = [getattr(record, "event", None) for record in caplog.records]
    assert "job-crashed" not in names and "job-interrupted" not in names
    assert names.count("job-connection-lost") == 2
    assert "run-owner-taken-back" in names
    assert records == 0
