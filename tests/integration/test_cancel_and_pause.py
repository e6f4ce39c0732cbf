"""Cancelling a queued job (archived as cancelled, never run; a running job is not cancelled)
and pausing a queue (its workers stop claiming within a polling interval and go on when it
is resumed), both in the caller's transaction."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from helpers import (
    archived,
    archived_job,
    enqueue_committed,
    jobs,
    run_records,
    running,
    wait_for,
)
from sqlalchemy.orm import Session

import sqla_proletarian as sp


def noop(job_type: str, payload: Any) -> None:
    pass


def test_a_cancelled_job_is_archived_as_cancelled_with_its_run_records_gone(
    engine: sa.Engine,
) -> None:
    """Cancelled through a Session and a Connection: archived as ``cancelled`` with its
    attempts and priority, its leftover run record removed, and it never runs. A cancel
    rolled back leaves the job queued."""
    by_session = enqueue_committed(engine, "a", priority=4)
    by_conn = enqueue_committed(engine, "b")
    kept = enqueue_committed(engine, "c")
    with engine.begin() as conn:
        conn.execute(
            sa.insert(sp.JobRun.__table__).values(
                run_id=uuid.uuid4(), job_id=by_conn, worker_id="died", started_at=sp.utc_now()
            )
        )
    with Session(engine) as session:
        assert sp.cancel_job(session, by_session) is True
        session.commit()
    with engine.begin() as conn:
        assert sp.cancel_job(conn, by_conn) is True
    with engine.connect() as conn:
        assert sp.cancel_job(conn, kept) is True
        conn.rollback()
    assert run_records(engine) == 0
    for job_id, priority in ((by_session, 4), (by_conn, 0)):
        row = archived_job(engine, job_id)
        assert row is not None
        assert (row.status, row.attempts, row.priority, row.error) == (
            "cancelled",
            0,
            priority,
            None,
        )
    ran: list[str] = []
    while sp.process_next_job(engine, lambda job_type, payload: ran.append(job_type)):
        pass
    assert ran == ["c"]


def test_cancelling_a_job_that_is_not_in_the_queue_returns_false(engine: sa.Engine) -> None:
    done = enqueue_committed(engine, "t")
    assert sp.process_next_job(engine, noop)
    with engine.begin() as conn:
        assert sp.cancel_job(conn, done) is False
        assert sp.cancel_job(conn, uuid.uuid4()) is False
        with pytest.raises(sp.InvalidJobError, match="job_id"):
            sp.cancel_job(conn, str(done))  # type: ignore[arg-type]
    with pytest.raises(sp.NotATransactionError, match="Engine"):
        sp.cancel_job(engine, done)  # type: ignore[arg-type]
    row = archived_job(engine, done)
    assert row is not None and row.status == "success"


def test_a_running_job_is_not_cancelled(database: Any) -> None:
    """On the servers the cancel skips the running job's row at once; on SQLite the running
    job holds the write lock, so the cancel waits for the run to end, then finds it gone."""
    engine = database.engine()
    started, release = threading.Event(), threading.Event()

    def handler(job_type: str, payload: Any) -> None:
        started.set()
        release.wait(10)

    job_id = enqueue_committed(engine, "slow")
    with running(sp.create_queue_worker(engine, handler, polling_interval=0.02)):
        assert started.wait(10)
        if database.backend == "sqlite":
            threading.Timer(0.3, release.set).start()
        began = time.monotonic()
        with engine.begin() as conn:
            assert sp.cancel_job(conn, job_id) is False
        took = time.monotonic() - began
        release.set()
        assert wait_for(lambda: archived_job(engine, job_id) is not None)
    if database.backend == "sqlite":
        assert took >= 0.25
    else:
        assert took < 1
    row = archived_job(engine, job_id)
    assert row is not None and row.status == "success"


def test_a_cancel_racing_a_workers_claims_either_cancels_a_job_or_it_runs_never_both(
    database: Any,
) -> None:
    """40 jobs; a worker runs them oldest first while another thread cancels them newest
    first, so the two meet on the same jobs: each job is cancelled (and never ran) exactly
    when cancel_job said True, and ran exactly when it said False; each is archived once."""
    engine = database.engine()
    with engine.begin() as conn:
        ids = sp.enqueue_many(conn, [("job", n) for n in range(40)])
    ran: list[uuid.UUID] = []

    def handler(job: sp.JobContext) -> None:
        ran.append(job.job_id)
        time.sleep(0.002)

    threads = 1 if database.backend == "sqlite" else 2
    answers: dict[uuid.UUID, bool] = {}
    worker = sp.create_queue_worker(
        engine, handler, handler_mode="advanced", worker_threads=threads, polling_interval=0.01
    )
    with running(worker):
        assert wait_for(lambda: bool(ran))
        for job_id in reversed(ids):
            with engine.begin() as conn:
                answers[job_id] = sp.cancel_job(conn, job_id)
            time.sleep(0.002)
        assert wait_for(lambda: len(archived(engine)) == len(ids))
    statuses = {row.job_id: row.status for row in archived(engine)}
    assert len(ran) == len(set(ran))
    for job_id in ids:
        assert answers[job_id] is (job_id not in ran)
        assert statuses[job_id] == ("cancelled" if answers[job_id] else "success")
    assert jobs(engine) == []
    if database.backend != "sqlite":  # SQLite's writers take turns, often all one way
        assert 0 < sum(answers.values()) < len(ids), "the worker and the cancels never met"


def test_a_paused_queue_stops_claiming_within_a_polling_interval_and_goes_on_when_resumed(
    database: Any,
) -> None:
    """A running worker: the job it is running when the pause commits finishes (on SQLite,
    where the running job holds the write lock, the pause commits once it has); then it
    claims nothing for longer than its polling interval (other queues are not paused) and
    keeps running; resumed, it is woken and runs the waiting jobs before its next poll."""
    engine = database.engine()
    interval = 0.5
    started, release = threading.Event(), threading.Event()
    ran: list[str] = []

    def handler(job_type: str, payload: Any) -> None:
        if job_type == "slow":
            started.set()
            release.wait(10)
        ran.append(job_type)

    enqueue_committed(engine, "slow")
    worker = sp.create_queue_worker(engine, handler, polling_interval=interval)
    with running(worker):
        assert started.wait(10)
        if database.backend == "sqlite":
            threading.Timer(0.2, release.set).start()
        with engine.begin() as conn:
            sp.pause_queue(conn, sp.DEFAULT_QUEUE)
        release.set()
        assert wait_for(lambda: ran == ["slow"])
        paused_at = time.monotonic()
        for n in range(3):
            enqueue_committed(engine, f"waiting-{n}")
        enqueue_committed(engine, "elsewhere", queue="other")
        time.sleep(interval * 1.5)
        assert ran == ["slow"]
        assert worker.running
        assert sp.paused_queues(engine) == {sp.DEFAULT_QUEUE}
        assert sp.process_next_job(engine, noop, queue="other")
        assert not sp.process_next_job(engine, noop)
        assert time.monotonic() - paused_at > interval
        time.sleep(interval)  # the worker is in its polling pause again
        resumed_at = time.monotonic()
        with Session(engine) as session:
            sp.resume_queue(session, sp.DEFAULT_QUEUE)
            session.commit()
        assert wait_for(lambda: len(ran) == 4, timeout=5)
        assert time.monotonic() - resumed_at < interval
    assert sorted(ran) == ["slow", "waiting-0", "waiting-1", "waiting-2"]
    assert sp.paused_queues(engine) == set()


def test_pause_and_resume_join_the_callers_transaction_and_repeat_harmlessly(
    engine: sa.Engine,
) -> None:
    with engine.connect() as conn:
        sp.pause_queue(conn, "q")
        assert sp.paused_queues(conn) == {"q"}
        conn.rollback()
    assert sp.paused_queues(engine) == set()
    with Session(engine) as session:
        sp.pause_queue(session, "q")
        sp.pause_queue(session, "q")
        sp.pause_queue(session, "r")
        session.commit()
        assert sp.paused_queues(session) == {"q", "r"}
    with engine.begin() as conn:
        sp.pause_queue(conn, "q")  # paused already, in another transaction
        sp.resume_queue(conn, "r")
        sp.resume_queue(conn, "r")
        sp.resume_queue(conn, "never-paused")
    assert sp.paused_queues(engine) == {"q"}
    with engine.begin() as conn, pytest.raises(sp.InvalidJobError, match="queue"):
        sp.pause_queue(conn, "")
    with pytest.raises(sp.NotATransactionError, match="Engine"):
        sp.pause_queue(engine, "q")  # type: ignore[arg-type]
    with pytest.raises(sp.NotATransactionError):
        sp.paused_queues("q")  # type: ignore[arg-type]


#: Session settings that turn a wait for a row lock into an error within two seconds.
LOCK_TIMEOUT = {
    "postgresql": {"options": "-c lock_timeout=2000"},
    "mariadb": {"init_command": "SET SESSION innodb_lock_wait_timeout = 2"},
}


def test_an_open_repeatable_read_transaction_that_cancelled_a_job_holds_up_no_claim(
    database: Any,
) -> None:
    """The cancel (of a job with a dead worker's run record, and of one not queued) locks no
    gap: on MariaDB a delete of the run records by job id locked the gaps of the small
    run-record table, and every worker's run record waited for the caller's commit."""
    if database.backend == "sqlite":
        pytest.skip("SQLite: a transaction that cancelled a job holds the database's write lock")
    engine = database.engine()
    cancelled, other = enqueue_committed(engine, "cancelled"), enqueue_committed(engine, "other")
    with engine.begin() as conn:
        conn.execute(
            sa.insert(sp.JobRun.__table__).values(
                run_id=uuid.uuid4(), job_id=cancelled, worker_id="died", started_at=sp.utc_now()
            )
        )
    worker_engine = database.engine(connect_args=LOCK_TIMEOUT[database.backend])
    with engine.connect() as app:
        app.execution_options(isolation_level="REPEATABLE READ")
        assert sp.cancel_job(app, cancelled) is True
        assert sp.cancel_job(app, uuid.uuid4()) is False
        ran: list[str] = []
        assert sp.process_next_job(worker_engine, lambda job_type, payload: ran.append(job_type))
        assert ran == ["other"]
        app.commit()
    done = archived_job(engine, other)
    assert done is not None and done.status == "success"
    row = archived_job(engine, cancelled)
    assert row is not None and row.status == "cancelled"
    assert run_records(engine) == 0
