"""Small tools shared by the integration conformance suite: a controllable clock, enqueue
shortcuts, reading the job tables back, and waiting for the database with a deadline."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

import sqla_proletarian as sp

#: A leap day after 2038 with every microsecond digit set: a MySQL TIMESTAMP could hold
#: neither the year nor the microseconds.
T0 = datetime(2040, 2, 29, 12, 34, 56, 654321, tzinfo=UTC)


class FakeClock:
    """A clock for the worker and enqueue: returns a fixed aware time until moved.

    ``calls`` counts how often it was read (the worker reads it on every poll).
    """

    def __init__(self, start: datetime = T0) -> None:
        self._now = start
        self._lock = threading.Lock()
        self.calls = 0

    def __call__(self) -> datetime:
        with self._lock:
            self.calls += 1
            return self._now

    @property
    def now(self) -> datetime:
        return self._now

    def set(self, when: datetime) -> None:
        with self._lock:
            self._now = when

    def advance(self, seconds: float) -> datetime:
        with self._lock:
            self._now += timedelta(seconds=seconds)
            return self._now


def enqueue_committed(
    engine: sa.Engine, job_type: str, payload: Any = None, **kw: Any
) -> uuid.UUID:
    """Enqueue one job in its own committed Session transaction."""
    with Session(engine) as session:
        job_id = sp.enqueue(session, job_type, payload, **kw)
        session.commit()
    return job_id


def jobs(engine: sa.Engine) -> list[sp.Job]:
    """Every row of the job table, in poll order."""
    with Session(engine) as session:
        return list(
            session.scalars(
                sa.select(sp.Job).order_by(sp.Job.process_at, sp.Job.__table__.c.seq)
            ).all()
        )


def archived(engine: sa.Engine) -> list[sp.ArchivedJob]:
    """Every row of the archive."""
    with Session(engine) as session:
        return list(session.scalars(sa.select(sp.ArchivedJob)).all())


def archived_job(engine: sa.Engine, job_id: uuid.UUID) -> sp.ArchivedJob | None:
    with Session(engine) as session:
        return session.get(sp.ArchivedJob, job_id)


def job_row(engine: sa.Engine, job_id: uuid.UUID) -> sp.Job | None:
    with Session(engine) as session:
        return session.scalars(sa.select(sp.Job).where(sp.Job.job_id == job_id)).one_or_none()


def count(engine: sa.Engine, table: Any) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one())


def run_records(engine: sa.Engine) -> int:
    """Rows in the crash ledger (runs without a recorded outcome)."""
    return count(engine, sp.JobRun)


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0, interval: float = 0.02) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` seconds have passed."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


@contextmanager
def running(worker: sp.QueueWorker) -> Iterator[sp.QueueWorker]:
    """Start a worker and make sure it is stopped, whatever the test did."""
    worker.start()
    try:
        yield worker
    finally:
        worker.stop()


def events(records: list[Any], name: str) -> list[Any]:
    """The log records of one event name."""
    return [r for r in records if getattr(r, "event", None) == name]


def aware_utc(value: datetime) -> bool:
    return value.tzinfo is not None and value.utcoffset() == timedelta(0)
