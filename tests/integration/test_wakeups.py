"""Wake-ups: a committed enqueue makes idle workers poll at once (LISTEN/NOTIFY on
PostgreSQL, in-process everywhere); a rolled-back one wakes nobody."""

from __future__ import annotations

import gc
import logging
import threading
import time
from typing import Any

import pytest
import sqlalchemy as sa
from helpers import enqueue_committed
from sqlalchemy.orm import Session

import sqla_proletarian as sp
from sqla_proletarian.wakeups import CHANNEL

#: Far longer than any wake-up may take: a job that runs sooner was woken.
SLOW_POLLING = 30.0


class Polls(logging.Handler):
    """Counts the worker's polls (the DEBUG ``polling-for-jobs`` event)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "event", None) == "polling-for-jobs":
            self.count += 1


@pytest.fixture
def polls() -> Any:
    logger = logging.getLogger("sqla_proletarian")
    handler, level = Polls(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def started_worker(engine: sa.Engine, started: threading.Event, **options: Any) -> sp.QueueWorker:
    worker = sp.create_queue_worker(
        engine, lambda job_type, payload: started.set(), polling_interval=SLOW_POLLING, **options
    )
    worker.start()
    return worker


def settle(polls: Polls) -> int:
    """Wait until the worker's first polls are done; the poll count then."""
    deadline = time.monotonic() + 5
    while polls.count == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    return polls.count


def test_a_committed_enqueue_in_the_same_process_wakes_an_idle_worker_at_once(
    engine: sa.Engine, polls: Polls
) -> None:
    """On every backend (with LISTEN off, so only the in-process wake-up can do it)."""
    started = threading.Event()
    worker = started_worker(engine, started, poll_only=True)
    try:
        settle(polls)
        began = time.monotonic()
        enqueue_committed(engine, "now")
        assert started.wait(5), "the worker slept through a committed enqueue"
        assert time.monotonic() - began < 2
    finally:
        worker.stop()


def test_a_rolled_back_enqueue_wakes_nobody(engine: sa.Engine, polls: Polls) -> None:
    started = threading.Event()
    worker = started_worker(engine, started)
    try:
        before = settle(polls)
        with Session(engine) as session:
            sp.enqueue(session, "never", None)
            session.flush()
            session.rollback()
        with engine.connect() as conn:
            sp.enqueue_many(conn, [("never", 1), ("never", 2)])
            conn.rollback()
        time.sleep(0.5)
        assert polls.count == before, "a rollback woke the worker"
        enqueue_committed(engine, "now")
        assert started.wait(5)
    finally:
        worker.stop()


def test_an_enqueue_whose_connection_the_pool_resets_wakes_nobody_at_a_later_commit(
    engine: sa.Engine, polls: Polls
) -> None:
    """A Connection dropped without close() inside its transaction is rolled back by the
    pool, behind SQLAlchemy's rollback event; the next transaction on that DBAPI connection
    (one connection in the pool) commits without waking the worker for the vanished job."""
    started = threading.Event()
    worker = started_worker(engine, started, poll_only=True)
    app = sa.create_engine(engine.url, pool_size=1, max_overflow=0)
    try:
        before = settle(polls)
        dropped = app.connect()
        sp.enqueue(dropped, "never", None)
        del dropped
        gc.collect()  # the pool resets (rolls back) the connection it gets back
        with app.begin() as conn:
            conn.execute(sa.text("SELECT 1"))
        time.sleep(0.5)
        assert polls.count == before, "a commit woke the worker for a rolled-back enqueue"
        enqueue_committed(app, "now")
        assert started.wait(5)
    finally:
        worker.stop()
        app.dispose()


def test_postgresql_workers_are_woken_by_notify_whoever_inserts_the_job(
    engine: sa.Engine, backend: str
) -> None:
    """A row inserted with plain Core (no enqueue(), so no in-process wake-up: as another
    process or language would) reaches the worker through the table's trigger and NOTIFY;
    with poll_only=True it waits for the next poll."""
    if backend != "postgresql":
        pytest.skip("LISTEN/NOTIFY is PostgreSQL's")
    for poll_only in (False, True):
        started = threading.Event()
        worker = started_worker(engine, started, poll_only=poll_only)
        try:
            time.sleep(0.3)  # the listener is listening
            values = {k: v for k, v in sp.Job(job_type="raw", payload=1).__dict__.items()}
            row = {c.name: values[c.name] for c in sp.Job.__table__.c if c.name in values}
            with engine.begin() as conn:
                conn.execute(sa.insert(sp.Job.__table__), row)
            assert started.wait(3) is not poll_only
        finally:
            worker.stop()


def test_postgresql_sends_one_notification_per_transaction_and_queue(
    engine: sa.Engine, backend: str
) -> None:
    if backend != "postgresql" or engine.dialect.driver != "psycopg":
        pytest.skip("LISTEN/NOTIFY is PostgreSQL's; this listens with psycopg 3")
    raw = engine.raw_connection()
    try:
        listener: Any = raw.driver_connection
        listener.autocommit = True
        listener.execute(f"LISTEN {CHANNEL}")
        with Session(engine) as session:
            for n in range(5):
                sp.enqueue(session, "single", n, queue="a")
            session.flush()
            sp.enqueue_many(session, [("bulk", n) for n in range(2500)], queue="a")
            sp.enqueue(session, "other", None, queue="b")
            session.commit()
        notes = list(listener.notifies(timeout=1.0))
    finally:
        raw.invalidate()
    assert sorted(note.payload for note in notes) == ["a", "b"]
