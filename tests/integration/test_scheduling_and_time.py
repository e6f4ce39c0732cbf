"""Scheduling (process_at / process_in against the worker's clock), FIFO tie-breaking, and
aware-UTC microsecond times on every backend."""

from __future__ import annotations

import uuid
from datetime import UTC, timedelta, timezone
from typing import Any

import sqlalchemy as sa
from helpers import T0, FakeClock, archived_job, aware_utc, enqueue_committed, job_row
from sqlalchemy.orm import Session

import sqla_proletarian as sp

US = timedelta(microseconds=1)


def _noop(job_type: str, payload: Any) -> None:
    return None


def test_a_job_is_not_run_before_its_process_at(engine: sa.Engine) -> None:
    clock = FakeClock()
    due = T0 + timedelta(seconds=60)
    job_id = enqueue_committed(engine, "later", None, process_at=due, clock=clock)
    clock.set(due - US)
    assert not sp.process_next_job(engine, _noop, clock=clock), "one microsecond early"
    assert job_row(engine, job_id) is not None
    clock.set(due)
    assert sp.process_next_job(engine, _noop, clock=clock), "due exactly at process_at"
    done = archived_job(engine, job_id)
    assert done is not None and done.status == "success"


def test_process_in_schedules_relative_to_the_enqueue_clock(engine: sa.Engine) -> None:
    clock = FakeClock()
    in_seconds = enqueue_committed(engine, "a", None, process_in=30, clock=clock)
    in_delta = enqueue_committed(
        engine, "b", None, process_in=timedelta(minutes=2, microseconds=7), clock=clock
    )
    first, second = job_row(engine, in_seconds), job_row(engine, in_delta)
    assert first is not None and second is not None
    assert first.process_at == T0 + timedelta(seconds=30)
    assert second.process_at == T0 + timedelta(minutes=2, microseconds=7)
    assert first.enqueued_at == second.enqueued_at == T0
    clock.set(T0 + timedelta(seconds=30) - US)
    assert not sp.process_next_job(engine, _noop, clock=clock)
    clock.set(T0 + timedelta(seconds=30))
    assert sp.process_next_job(engine, _noop, clock=clock)
    assert not sp.process_next_job(engine, _noop, clock=clock)


def test_process_at_wins_over_process_in(engine: sa.Engine) -> None:
    clock = FakeClock()
    at = T0 + timedelta(seconds=10)
    job_id = enqueue_committed(engine, "a", None, process_at=at, process_in=3600, clock=clock)
    with Session(engine) as session:
        added = sp.Job(job_type="a", process_at=at, process_in=3600, clock=clock)
        session.add(added)
        session.commit()
        added_id = added.job_id
    for jid in (job_id, added_id):
        row = job_row(engine, jid)
        assert row is not None and row.process_at == at


def test_a_time_in_the_past_means_now(engine: sa.Engine) -> None:
    clock = FakeClock()
    past_at = enqueue_committed(engine, "a", None, process_at=T0 - timedelta(days=400), clock=clock)
    past_in = enqueue_committed(engine, "b", None, process_in=-90, clock=clock)
    for jid in (past_at, past_in):
        row = job_row(engine, jid)
        assert row is not None and row.process_at == T0 == row.enqueued_at
    assert sp.process_next_job(engine, _noop, clock=clock)
    assert sp.process_next_job(engine, _noop, clock=clock)


def test_equal_process_at_values_come_out_in_enqueue_order(engine: sa.Engine) -> None:
    """Twenty jobs due at the same instant run in the order they were enqueued (random ids)."""
    clock = FakeClock()
    with Session(engine) as session:
        ids = [sp.enqueue(session, "fifo", n, clock=clock) for n in range(10)]
        session.commit()
    with engine.begin() as conn:
        ids += [sp.enqueue(conn, "fifo", n, clock=clock) for n in range(10, 15)]
    for n in range(15, 20):
        ids.append(enqueue_committed(engine, "fifo", n, clock=clock))
    order: list[uuid.UUID] = []
    while sp.process_next_job(
        engine, lambda job: order.append(job.job_id), handler_mode="advanced", clock=clock
    ):
        pass
    assert order == ids


def test_rows_rewritten_in_place_still_come_out_in_enqueue_order(
    engine: sa.Engine, backend: str
) -> None:
    """Updating a row can move it in storage (PostgreSQL writes a new row version at the end
    of the table), so storage order is not enqueue order: the poll's tie-breaker is.

    On PostgreSQL the database's index scans are turned off, so the poll's own ORDER BY,
    not the index's order, has to put equal times in enqueue order.
    """
    if backend == "postgresql":
        with engine.connect() as conn:
            name = conn.exec_driver_sql("SELECT current_database()").scalar_one()
            for setting in ("enable_indexscan", "enable_indexonlyscan", "enable_bitmapscan"):
                conn.exec_driver_sql(f'ALTER DATABASE "{name}" SET {setting} = off')
            conn.commit()
        engine.dispose()  # new connections take the settings
    clock = FakeClock()
    with Session(engine) as session:
        ids = [sp.enqueue(session, "fifo", n, clock=clock) for n in range(20)]
        session.commit()
    job = sp.Job.__table__
    with engine.begin() as conn:
        conn.execute(
            sa.update(job).where(job.c.job_id.in_(ids[:10])).values(attempts=job.c.attempts)
        )
    order: list[uuid.UUID] = []
    while sp.process_next_job(
        engine, lambda job: order.append(job.job_id), handler_mode="advanced", clock=clock
    ):
        pass
    assert order == ids


def test_a_retried_job_keeps_its_place_among_equal_times(engine: sa.Engine) -> None:
    """A job retried to time X runs before a job enqueued later for the same X."""
    clock = FakeClock()
    first = enqueue_committed(engine, "flaky", None, clock=clock)
    retry_at = T0 + timedelta(seconds=5)
    later = enqueue_committed(engine, "plain", None, process_at=retry_at, clock=clock)

    def handler(job: sp.JobContext) -> None:
        if job.job_type == "flaky" and job.attempts == 1:
            raise RuntimeError("once")

    options: dict[str, Any] = {
        "handler_mode": "advanced",
        "clock": clock,
        "retry_strategy": lambda job, exc: sp.RetryStrategy(1, [5]),
    }
    assert sp.process_next_job(engine, handler, **options)
    row = job_row(engine, first)
    assert row is not None and row.process_at == retry_at
    clock.set(retry_at)
    order: list[uuid.UUID] = []

    def recording(job: sp.JobContext) -> None:
        order.append(job.job_id)
        handler(job)

    while sp.process_next_job(engine, recording, **options):
        pass
    assert order == [first, later]


def test_times_are_aware_utc_with_microseconds_after_a_round_trip(engine: sa.Engine) -> None:
    """Enqueue, claim and archive times survive every backend to the exact microsecond."""
    kolkata = timezone(timedelta(hours=5, minutes=30))
    clock = FakeClock(T0.astimezone(kolkata))
    due = (T0 + timedelta(seconds=1, microseconds=1)).astimezone(timezone(-timedelta(hours=7)))
    job_id = enqueue_committed(engine, "t", None, process_at=due, clock=clock)
    row = job_row(engine, job_id)
    assert row is not None
    assert row.enqueued_at == T0 and aware_utc(row.enqueued_at)
    assert row.process_at == due and aware_utc(row.process_at)
    assert row.process_at.microsecond == 654322

    seen: list[sp.JobContext] = []
    finish = T0 + timedelta(seconds=2, microseconds=345678)
    clock.set(finish)
    assert sp.process_next_job(engine, seen.append, handler_mode="advanced", clock=clock)
    [job] = seen
    assert (job.enqueued_at, job.process_at) == (T0, due)
    assert aware_utc(job.enqueued_at) and aware_utc(job.process_at)
    assert job.enqueued_at.tzinfo == UTC
    done = archived_job(engine, job_id)
    assert done is not None
    assert (done.enqueued_at, done.process_at, done.finished_at) == (T0, due, finish)
    assert all(aware_utc(t) for t in (done.enqueued_at, done.process_at, done.finished_at))
    assert done.finished_at.microsecond == finish.microsecond
