"""An idle worker costs about nothing: of its idle threads one polls for all of them, and on
PostgreSQL, where LISTEN/NOTIFY wakes it for every committed job, it sleeps until the next
job is due (or a long safety poll), so jobs scheduled for later and retries still start on
time, and stop() ends the sleep at once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from helpers import enqueue_committed, events, running, wait_for
from sqlalchemy.ext.asyncio import create_async_engine

import sqla_proletarian as sp
from sqla_proletarian import statements
from sqla_proletarian.wakeups import Listener

#: How long an idle worker's statements are counted.
WINDOW = 1.5


class Statements:
    """Counts the statements sent through an engine's connections, and the worker threads
    (or asyncio tasks) that sent them."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.count = 0
        self.senders: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, *args: Any) -> None:
        try:
            task = asyncio.current_task()
        except RuntimeError:
            task = None
        sender = task.get_name() if task is not None else threading.current_thread().name
        with self._lock:
            self.count += 1
            self.senders.add(sender)

    def settle(self, units: int) -> None:
        """Wait until ``units`` worker threads or tasks have each sent their first statements
        (their connections opened, their first polls done)."""

        def started() -> bool:
            return len([s for s in self.senders if s.startswith("proletarian[")]) >= units

        assert wait_for(started), self.senders
        threading.Event().wait(0.3)

    def over(self, seconds: float) -> int:
        """The statements sent over the next ``seconds`` (a measurement window): on a loaded
        machine this thread may wake late, and the count is then scaled to ``seconds``."""
        before, began = self.count, time.monotonic()
        threading.Event().wait(seconds)
        return scaled(self.count - before, seconds, time.monotonic() - began)

    def quiet(self, timeout: float = 5.0) -> bool:
        """Wait until half a second passes without a statement; False after ``timeout``."""
        return wait_for(lambda: self.over(0.5) == 0, timeout=timeout, interval=0)


def scaled(sent: int, seconds: float, elapsed: float) -> int:
    """``sent`` statements counted over ``elapsed`` seconds, as over ``seconds``."""
    return round(sent * seconds / elapsed) if elapsed > seconds else sent


@contextmanager
def counted(engine: sa.Engine) -> Iterator[Statements]:
    statements = Statements(engine)
    sa.event.listen(engine, "before_cursor_execute", statements)
    try:
        yield statements
    finally:
        sa.event.remove(engine, "before_cursor_execute", statements)


def idle_statements(engine: sa.Engine, threads: int, **options: Any) -> int:
    """Statements an idle worker of ``threads`` threads sends over ``WINDOW`` seconds, once
    its first polls are done."""
    with counted(engine) as statements:
        worker = sp.create_queue_worker(
            engine, lambda job_type, payload: None, worker_threads=threads, **options
        )
        with running(worker):
            statements.settle(threads)
            return statements.over(WINDOW)


def elsewhere(database: Any) -> sa.Engine:
    """On PostgreSQL, an engine on the database as another process's would be: its URL
    differs, so its commits wake this process's workers only through NOTIFY."""
    if database.backend != "postgresql":
        return database.engine()  # type: ignore[no-any-return]
    url = database.url.update_query_dict({"application_name": "elsewhere"})
    return sa.create_engine(url, poolclass=sa.pool.NullPool)


def require_listen(engine: sa.Engine) -> None:
    if not Listener.supported(engine):
        pytest.skip("LISTEN/NOTIFY wake-ups: PostgreSQL through psycopg or psycopg2")


def test_an_idle_worker_of_four_threads_polls_as_one(database: Any) -> None:
    """Four idle threads cost what one does: one polls, the others wait (not 4x the polls)."""
    one = idle_statements(database.engine(), 1, poll_only=True)
    four = idle_statements(database.engine(), 4, poll_only=True)
    assert one > 0
    assert four <= one * 1.5 + 3, (one, four)


def test_with_listen_an_idle_worker_sleeps_and_a_job_enqueued_elsewhere_starts_at_once(
    database: Any, backend: str
) -> None:
    """On PostgreSQL an idle worker of four threads sends no statement for seconds on end (the
    long safety poll), yet a job committed through another engine starts at once."""
    if backend != "postgresql":
        pytest.skip("LISTEN/NOTIFY is PostgreSQL's")
    engine = database.engine()
    require_listen(engine)
    started = threading.Event()
    worker = sp.create_queue_worker(
        engine, lambda job_type, payload: started.set(), worker_threads=4
    )
    with counted(engine) as statements, running(worker):
        assert statements.quiet(), "the idle worker kept polling"
        assert statements.over(WINDOW) == 0  # nor the owner keeper
        enqueue_committed(elsewhere(database), "work")
        assert started.wait(5), "the idle worker slept through a committed job"


def test_with_listen_a_notified_job_is_claimed_with_no_read_of_the_queues_first(
    database: Any, backend: str
) -> None:
    """A NOTIFY announces a job: the thread it wakes polls at once, without first reading the
    ends of its queues (a transaction of its own, before the job's), as an idle worker's
    timed polls do. Between the enqueue's commit and the handler's start the thread that
    runs it sends the claim's own statements only."""
    if backend != "postgresql":
        pytest.skip("LISTEN/NOTIFY is PostgreSQL's")
    engine = database.engine()
    require_listen(engine)
    ends_read = str(statements.queue_ends(("default",))[0].compile(dialect=engine.dialect))
    sent: list[tuple[float, str, str]] = []
    starts: list[tuple[float, str]] = []

    def note(conn: Any, cursor: Any, text: str, *args: Any) -> None:
        sent.append((time.monotonic(), threading.current_thread().name, text))

    def handler(job_type: str, payload: Any) -> None:
        starts.append((time.monotonic(), threading.current_thread().name))

    worker = sp.create_queue_worker(engine, handler, worker_threads=4)
    other = elsewhere(database)
    sa.event.listen(engine, "before_cursor_execute", note)
    try:
        with running(worker):
            for n in range(3):

                def quiet() -> bool:
                    return bool(sent) and time.monotonic() - sent[-1][0] > 0.5

                assert wait_for(quiet), "the idle worker kept polling"
                began = time.monotonic()
                enqueue_committed(other, "work")
                assert wait_for(lambda n=n: len(starts) > n), "the notified job did not start"
                started, runner = starts[n]
                claim = [text for at, by, text in sent if began <= at <= started and by == runner]
                assert claim, "no statement claimed the job"
                if any(ends_read in text for text in claim):
                    pytest.fail(
                        "the queues' ends were read before the job's claim:\n"
                        + "\n".join(" ".join(text.split())[:100] for text in claim)
                    )
    finally:
        sa.event.remove(engine, "before_cursor_execute", note)


def test_with_listen_a_job_scheduled_ahead_starts_on_time_though_the_worker_sleeps(
    database: Any, backend: str
) -> None:
    """A job due a second after its enqueue starts within a few tenths of a second of its
    due time, with a handful of statements in between, not a poll every polling interval."""
    if backend != "postgresql":
        pytest.skip("LISTEN/NOTIFY is PostgreSQL's")
    engine = database.engine()
    require_listen(engine)
    starts: list[float] = []
    worker = sp.create_queue_worker(
        engine, lambda job_type, payload: starts.append(time.time()), worker_threads=4
    )
    with counted(engine) as statements, running(worker):
        assert statements.quiet(), "the idle worker kept polling"
        before = statements.count
        due = sp.utc_now() + timedelta(seconds=1)
        enqueue_committed(elsewhere(database), "later", process_at=due)
        assert wait_for(lambda: bool(starts), timeout=5)
        late = starts[0] - due.timestamp()
        assert 0 <= late < 0.4, late
        assert statements.count - before <= 50, statements.count - before


def test_with_listen_a_retry_starts_on_time_though_the_worker_sleeps(
    database: Any, backend: str
) -> None:
    """A failed job retried a second later runs again on time: no notification announces a
    retry, and the sleeping worker wakes for its due time."""
    if backend != "postgresql":
        pytest.skip("LISTEN/NOTIFY is PostgreSQL's")
    engine = database.engine()
    require_listen(engine)
    starts: list[float] = []

    def handler(job_type: str, payload: Any) -> None:
        starts.append(time.time())
        if len(starts) == 1:
            raise RuntimeError("first run fails")

    worker = sp.create_queue_worker(
        engine,
        handler,
        worker_threads=4,
        retry_strategy=lambda job, exc: sp.RetryStrategy(retries=1, delays=[1.0]),
    )
    with counted(engine) as statements, running(worker):
        assert statements.quiet(), "the idle worker kept polling"
        enqueue_committed(elsewhere(database), "flaky")
        assert wait_for(lambda: len(starts) == 2, timeout=5)
    late = starts[1] - starts[0] - 1.0
    assert 0 <= late < 0.4, late


def test_with_listen_stop_ends_the_long_sleep_at_once(database: Any, backend: str) -> None:
    """stop() of a worker sleeping in its long safety poll returns at once."""
    if backend != "postgresql":
        pytest.skip("LISTEN/NOTIFY is PostgreSQL's")
    engine = database.engine()
    require_listen(engine)
    worker = sp.create_queue_worker(engine, lambda job_type, payload: None, worker_threads=4)
    with counted(engine) as statements:
        worker.start()
        try:
            assert statements.quiet(), "the idle worker kept polling"
        finally:
            began = time.monotonic()
            worker.stop()
    assert time.monotonic() - began < 1.0


def test_with_listen_periodic_occurrences_are_enqueued_on_time_though_the_worker_sleeps(
    database: Any, backend: str
) -> None:
    """Each occurrence of a periodic job is enqueued and run well within its period of its
    time (a second at most, on a loaded machine) while the idle worker otherwise sleeps (its
    safety poll comes every 10 s)."""
    if backend != "postgresql":
        pytest.skip("LISTEN/NOTIFY is PostgreSQL's")
    engine = database.engine()
    require_listen(engine)
    lateness: list[float] = []

    def handler(job: sp.JobContext) -> None:
        lateness.append((sp.utc_now() - job.process_at).total_seconds())

    worker = sp.create_queue_worker(
        engine,
        handler,
        handler_mode="advanced",
        worker_threads=4,
        periodic_jobs=[sp.PeriodicJob("tick", every=timedelta(seconds=2))],
    )
    with running(worker):
        assert wait_for(lambda: len(lateness) >= 2, timeout=10)
    assert all(0 <= late < 1.0 for late in lateness), lateness


# --- the asyncio worker -------------------------------------------------------------------

ASYNC_DRIVER = {"sqlite": "aiosqlite", "postgresql": "asyncpg", "mariadb": "aiomysql"}


def async_idle_statements(
    database: Any, concurrency: int, quiet: bool = False, **options: Any
) -> tuple[int, bool]:
    """Statements an idle asyncio worker of ``concurrency`` tasks sends over ``WINDOW``
    seconds once its first polls are done (``quiet``: once half a second passed without
    one), and whether a job enqueued through another engine then started within 5 s."""
    prefix = {"sqlite": "sqlite", "postgresql": "postgresql", "mariadb": "mysql"}[database.backend]
    url = database.url.set(drivername=f"{prefix}+{ASYNC_DRIVER[database.backend]}")

    async def main() -> tuple[int, bool]:
        engine = create_async_engine(url)
        started = asyncio.Event()

        async def handler(job_type: str, payload: Any) -> None:
            started.set()

        try:
            with counted(engine.sync_engine) as statements:
                worker = sp.create_async_queue_worker(
                    engine, handler, concurrency=concurrency, **options
                )
                async with worker:
                    await asyncio.to_thread(statements.settle, concurrency)
                    if quiet:
                        assert await asyncio.to_thread(statements.quiet), "it kept polling"
                    idle = await asyncio.to_thread(statements.over, WINDOW)
                    await asyncio.to_thread(enqueue_committed, database.engine(), "work")
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(started.wait(), 5)
                    return idle, started.is_set()
        finally:
            await engine.dispose()

    return asyncio.run(main())


def test_an_idle_asyncio_worker_of_four_tasks_polls_as_one(database: Any) -> None:
    """Four idle tasks of the asyncio worker cost what one does: one polls, the others wait."""
    one, _ = async_idle_statements(database, 1, poll_only=True)
    four, started = async_idle_statements(database, 4, poll_only=True)
    assert started
    assert one > 0
    assert four <= one * 1.5 + 3, (one, four)


def test_with_listen_an_idle_asyncio_worker_sleeps_and_a_job_enqueued_elsewhere_starts(
    database: Any, backend: str
) -> None:
    """On PostgreSQL (asyncpg) an idle asyncio worker of four tasks sends no statement for
    seconds on end, yet a job committed through another engine starts at once."""
    if backend != "postgresql":
        pytest.skip("LISTEN/NOTIFY is PostgreSQL's")
    idle, started = async_idle_statements(database, 4, quiet=True)
    assert idle == 0
    assert started, "the idle worker slept through a committed job"


# --- the run-record owner -----------------------------------------------------------------


def kill_owner_session(engine: sa.Engine, backend: str) -> None:
    """End the server session that holds the running job's run-record owner lock (as a
    failover or an administrator would), leaving the worker and its other sessions alone."""
    with engine.connect() as conn:
        owner = conn.execute(sa.select(sp.JobRun.owner)).scalar_one()
        if backend == "postgresql":
            holder = conn.exec_driver_sql(
                "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted"
                " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            ).scalar_one()
            conn.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": holder})
        else:
            holder = conn.execute(sa.text("SELECT IS_USED_LOCK(:owner)"), {"owner": owner})
            conn.exec_driver_sql(f"KILL {int(holder.scalar_one())}")
        conn.commit()


def test_while_a_job_runs_the_idle_cheap_owner_is_still_checked_and_taken_back(
    database: Any, backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    """An idle worker does not check its run-record owner (it vouches for nothing), but while
    a job runs it does, every second: a killed owner session is taken back at once, long
    before the records could count as a dead worker's."""
    if backend == "sqlite":
        pytest.skip("SQLite's owner is the process: no session to end")
    caplog.set_level(logging.INFO, logger="sqla_proletarian")
    engine = database.engine()
    started, release = threading.Event(), threading.Event()

    def handler(job_type: str, payload: Any) -> None:
        started.set()
        release.wait(20)

    worker = sp.create_queue_worker(engine, handler, worker_threads=2)
    with running(worker):
        enqueue_committed(engine, "long")
        try:
            assert started.wait(10)
            kill_owner_session(database.engine(poolclass=sa.pool.NullPool), backend)
            assert wait_for(lambda: bool(events(caplog.records, "run-owner-taken-back")), 5)
        finally:
            release.set()
        assert wait_for(lambda: worker.summary()["succeeded"] == 1)
    assert events(caplog.records, "run-owner-lost")
