"""SQLite's claims beside other runners and the application's writers: a job is claimed again
after its run record only on the poll's terms, idle polls leave the write lock alone, and a
draining worker takes turns with the application's writes."""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import pytest
import sqlalchemy as sa
from helpers import (
    FakeClock,
    enqueue_committed,
    events,
    job_row,
    run_records,
    wait_for,
)
from sqlalchemy.orm import Session

import sqla_proletarian as sp

if TYPE_CHECKING:
    from conftest import Database

HOUR = timedelta(hours=1)


@pytest.fixture(autouse=True)
def sqlite_only(backend: str) -> None:
    if backend != "sqlite":
        pytest.skip("SQLite's claims take its one write lock; servers lock rows")


def _fails(job_type: str, payload: Any) -> None:
    raise RuntimeError("fails, to be retried in an hour")


def _in_an_hour(job: sp.JobContext, exc: Exception) -> sp.RetryStrategy:
    return sp.RetryStrategy(1, delays=[HOUR])


@pytest.mark.parametrize("meanwhile", ["retried for an hour later", "queue paused"])
def test_a_job_taken_meanwhile_is_claimed_again_after_its_run_record_only_on_poll_terms(
    database: Database, meanwhile: str
) -> None:
    """Between the commit of a claim's run record and its re-claim, another runner of the
    process runs the job and schedules its retry an hour later, or the queue is paused: the
    first runner then leaves the job alone instead of running it early or while paused."""
    first, other = database.engine(), database.engine()
    job_id = enqueue_committed(first, "flaky")
    runs: list[str] = []

    def handler(job_type: str, payload: Any) -> None:
        runs.append(job_type)
        _fails(job_type, payload)

    took_turn: list[bool] = []

    @sa.event.listens_for(first, "begin")
    def between_record_and_reclaim(conn: sa.Connection) -> None:
        if took_turn or run_records(other) == 0:
            return
        if meanwhile == "queue paused":
            with Session(other) as session:
                sp.pause_queue(session, sp.DEFAULT_QUEUE)
                session.commit()
            took_turn.append(True)
        else:
            # A runner without the crash ledger (a tracked one leaves the job alone while
            # its run record's owner, this process, lives).
            took_turn.append(
                sp.process_next_job(
                    other, handler, retry_strategy=_in_an_hour, max_unclean_ends=None
                )
            )

    claimed = sp.process_next_job(first, handler, retry_strategy=_in_an_hour)

    assert took_turn == [True]
    if meanwhile == "queue paused":
        assert runs == [], "the job of the paused queue ran"
    else:
        assert runs == ["flaky"], "the retry scheduled an hour later ran at once"
    row = job_row(first, job_id)
    assert row is not None
    assert row.attempts == len(runs)
    if runs:
        assert row.process_at > sp.utc_now() + HOUR / 2
    assert claimed is False
    assert run_records(first) == 0


def test_idle_workers_poll_a_sqlite_file_without_waiting_for_its_write_lock(
    database: Database, caplog: pytest.LogCaptureFixture
) -> None:
    """While the application holds a write transaction open, idle worker threads go on
    polling (a read), and none waits for the write lock or fails: only a due job takes it."""
    app = database.engine()
    # A poll that waited for the lock would fail after 0.2 s, and be logged.
    worker_engine = database.engine(connect_args={"timeout": 0.2})
    clock = FakeClock()
    caplog.set_level(logging.WARNING, logger="sqla_proletarian")
    with app.connect() as conn:
        sp.enqueue(conn, "elsewhere", None, queue="other")
        worker = sp.create_queue_worker(
            worker_engine, _fails, worker_threads=3, polling_interval=0.01, clock=clock
        )
        with worker:
            assert wait_for(lambda: clock.calls >= 30 or bool(caplog.records))
        conn.commit()
    assert not [r.getMessage() for r in caplog.records]
    assert worker.summary() == {"succeeded": 0, "retried": 0, "failed": 0}


def test_the_apps_writes_beside_a_draining_sqlite_worker_never_wait_out_the_busy_timeout(
    database: Database, caplog: pytest.LogCaptureFixture
) -> None:
    """While three worker threads drain a queue of short jobs, the application enqueues on an
    engine of its own, a small transaction every 50 ms: each write gets the write lock
    within a generous bound far below SQLite's 5 s busy timeout (back-to-back claims kept it
    waiting for the whole drain, then made it fail with "database is locked")."""
    jobs = 70
    worker_engine, app = database.engine(), database.engine()
    with Session(worker_engine) as session:
        sp.enqueue_many(session, [("work", n) for n in range(jobs)])
        session.commit()
    caplog.set_level(logging.WARNING, logger="sqla_proletarian")
    waits: list[float] = []
    errors: list[BaseException] = []
    drained = threading.Event()

    def app_writes() -> None:
        while not drained.is_set():
            start = time.monotonic()
            try:
                with Session(app) as session:
                    sp.enqueue(session, "elsewhere", None, queue="other")
                    session.commit()
            except BaseException as exc:
                errors.append(exc)
                return
            waits.append(time.monotonic() - start)
            drained.wait(0.05)

    writer = threading.Thread(target=app_writes, name="app-writer")
    worker = sp.create_queue_worker(
        worker_engine, lambda job_type, payload: time.sleep(0.03), worker_threads=3
    )
    try:
        with worker:
            assert wait_for(lambda: worker.summary()["succeeded"] >= 1)
            writer.start()
            assert wait_for(lambda: worker.summary()["succeeded"] >= jobs, timeout=60)
    finally:
        drained.set()
        if writer.is_alive():
            writer.join()
    assert not errors, errors
    assert worker.summary() == {"succeeded": jobs, "retried": 0, "failed": 0}
    assert waits and max(waits) < 1.5, f"the slowest of {len(waits)} writes: {max(waits):.2f} s"
    assert not events(caplog.records, "transient-polling-error")


@pytest.mark.parametrize("mode", ["transaction", "lease"])
def test_a_commit_refused_while_a_reader_holds_the_file_leaves_no_write_lock_behind(
    database: Database, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A reader holds the file's shared lock past the busy timeout while a job ends: SQLite
    refuses the completion's COMMIT and keeps its transaction (and write lock) open. The
    worker rolls that back before the connection returns to its pool, so once the reader is
    gone the job and the ones after it run: no connection keeps the write lock, and none is
    taken for the application's."""
    engine = database.engine(connect_args={"timeout": 0.2})
    first = enqueue_committed(engine, "first")
    handler_ran, lock_held = threading.Event(), threading.Event()
    runs: list[str] = []

    def handler(job_type: str, payload: Any) -> None:
        runs.append(job_type)
        if job_type == "first" and not handler_ran.is_set():
            handler_ran.set()
            assert lock_held.wait(10)

    reader = sqlite3.connect(database.url.database or "", isolation_level=None)
    worker = sp.create_queue_worker(
        engine,
        handler,
        polling_interval=0.05,
        lease_seconds=2 if mode == "lease" else None,  # a lease given up expires soon
    )
    caplog.set_level(logging.INFO, logger="sqla_proletarian")
    try:
        with worker:
            assert handler_ran.wait(10)
            reader.execute("BEGIN")
            reader.execute("SELECT count(*) FROM proletarian_job").fetchall()
            lock_held.set()
            time.sleep(1.0)  # five busy timeouts: the job's COMMIT is refused
            reader.execute("COMMIT")
            later = [enqueue_committed(engine, "later", {"n": n}) for n in range(3)]
            assert wait_for(lambda: worker.summary()["succeeded"] == 4, timeout=20)
    finally:
        reader.close()
    assert job_row(engine, first) is None
    assert all(job_row(engine, job_id) is None for job_id in later)
    assert runs.count("later") == 3
    assert not [r for r in caplog.records if "shared with the application" in r.getMessage()]
