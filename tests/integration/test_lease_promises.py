"""Lease mode's promises where a run ends another way than its heartbeat expects: a cancel
that ``cancel_job`` reported sticks (whatever the handler then does, a timeout, a stop that
gives up, a run still waiting in the worker's queue); a run's lease is renewed until its
completion has locked the job's row (a final flush that waits for a lock); a timed-out
job's callbacks never hold the heartbeat up; and the archive's ``attempts`` counts every
run that started, a lost connection's included, without charging it a retry."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import pytest
import sqlalchemy as sa
from helpers import archived_job, enqueue_committed, events, jobs, running, wait_for
from lease_helpers import Base, Note, job_row, kill_session, notes
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.orm import Session

import sqla_proletarian as sp

#: A heartbeat that never comes while a test looks: a cancel reaches the run only through
#: its outcome's write.
NO_BEAT = {"lease_seconds": 60.0, "heartbeat_interval": 30.0, "polling_interval": 0.02}
#: Leases that expire within a second without their heartbeats.
SHORT_LEASE = {"lease_seconds": 1.0, "heartbeat_interval": 0.2, "polling_interval": 0.02}
ASYNC_DRIVERNAME = {
    "sqlite": "sqlite+aiosqlite",
    "postgresql": "postgresql+psycopg",
    "mariadb": "mysql+aiomysql",
}


@pytest.fixture
def engine(database: Any) -> sa.Engine:
    engine = database.engine()
    Base.metadata.create_all(engine)
    return engine


@contextlib.asynccontextmanager
async def async_engine(database: Any) -> AsyncIterator[AsyncEngine]:
    engine = create_async_engine(database.url.set(drivername=ASYNC_DRIVERNAME[database.backend]))
    try:
        yield engine
    finally:
        await engine.dispose()


async def eventually(check: Any, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(check):
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.02)
    return True


def cancel(engine: sa.Engine, job_id: uuid.UUID) -> bool:
    with engine.begin() as conn:
        return sp.cancel_job(conn, job_id)


def retry_always(job: Any, exc: Exception) -> sp.RetryStrategy:
    return sp.RetryStrategy(retries=3, delays=[0])


def beats_after(engine: sa.Engine, job_id: uuid.UUID, beats: int = 2) -> bool:
    """Wait until the worker's heartbeat renewed ``job_id``'s lease ``beats`` more times: a
    heartbeat that began after this call has read every request committed before it."""
    seen = [job_row(engine, job_id).heartbeat_at]

    def renewed() -> bool:
        now = job_row(engine, job_id).heartbeat_at
        if now != seen[-1]:
            seen.append(now)
        return len(seen) > beats

    return wait_for(renewed, timeout=20)


# --- a committed cancel sticks ---------------------------------------------------------------


@pytest.mark.parametrize("ends", ["raises", "returns"])
def test_a_cancel_committed_while_the_handler_runs_wins_over_what_it_then_does(
    engine: sa.Engine, ends: str
) -> None:
    """cancel_job returns True while the handler runs, and no heartbeat comes before the
    handler ends: whether it then raises (with retries left) or returns after writing, the
    job is archived as cancelled, its writes roll back and it never runs again."""
    job_id = enqueue_committed(engine, "cancel-me")
    started, go = threading.Event(), threading.Event()
    runs: list[int] = []

    def handler(job: sp.JobContext) -> None:
        runs.append(job.attempts)
        started.set()
        assert go.wait(20)
        job.session.add(Note(text=f"run {len(runs)}"))
        job.session.flush()
        if ends == "raises":
            raise RuntimeError("failed after the cancel")

    worker = sp.create_queue_worker(
        engine, handler, handler_mode="advanced", retry_strategy=retry_always, **NO_BEAT
    )
    with running(worker):
        assert started.wait(20)
        assert cancel(engine, job_id) is True
        go.set()
        assert wait_for(lambda: archived_job(engine, job_id) is not None, timeout=20)
    assert runs == [1]
    done = archived_job(engine, job_id)
    assert done is not None and (done.status, done.attempts) == ("cancelled", 1)
    assert jobs(engine) == [] and notes(engine) == []


def test_a_cancel_the_handler_ignores_until_its_timeout_still_ends_the_job_cancelled(
    engine: sa.Engine,
) -> None:
    """The heartbeat sets cancel_requested, the handler ignores it, job_timeout passes: the
    timeout does not retry the job (retries are left); it ends cancelled, run once."""
    job_id = enqueue_committed(engine, "stubborn")
    started, go = threading.Event(), threading.Event()
    runs: list[bool] = []

    def handler(job: sp.JobContext) -> None:
        started.set()
        runs.append(job.cancel_requested.wait(20))
        go.wait(20)  # ignores the request

    worker = sp.create_queue_worker(
        engine,
        handler,
        handler_mode="advanced",
        retry_strategy=retry_always,
        job_timeout=3.0,
        lease_seconds=10.0,
        heartbeat_interval=0.1,
        polling_interval=0.02,
    )
    try:
        with running(worker):
            assert started.wait(20)
            assert cancel(engine, job_id) is True
            assert wait_for(lambda: archived_job(engine, job_id) is not None, timeout=20)
            go.set()
    finally:
        go.set()
    assert runs == [True]
    done = archived_job(engine, job_id)
    assert done is not None and done.status == "cancelled"
    assert jobs(engine) == []


def test_a_stop_that_gives_up_on_a_job_whose_cancel_was_requested_keeps_the_request(
    engine: sa.Engine,
) -> None:
    """A stop gives up on a running job whose cancel its heartbeat has not yet seen: the
    lease is released with the request kept, and the next worker archives the job as
    cancelled without calling its handler; the run that started stays counted."""
    job_id = enqueue_committed(engine, "stuck")
    started, go = threading.Event(), threading.Event()

    def stuck(job: sp.JobContext) -> None:
        started.set()
        go.wait(20)

    worker = sp.create_queue_worker(
        engine, stuck, handler_mode="advanced", await_termination_timeout=0.2, **NO_BEAT
    )
    try:
        worker.start()
        assert started.wait(20)
        assert cancel(engine, job_id) is True
        worker.stop()
        released = job_row(engine, job_id)
        assert released.lease_token is None
        assert released.cancel_requested_at is not None, "the release dropped the request"
        called: list[str] = []
        sp.process_next_job(engine, lambda t, p: called.append(t), **NO_BEAT)
    finally:
        go.set()
    assert called == []
    done = archived_job(engine, job_id)
    assert done is not None and (done.status, done.attempts) == ("cancelled", 1)


def test_a_run_waiting_in_the_workers_queue_whose_cancel_the_heartbeat_saw_never_starts(
    engine: sa.Engine,
) -> None:
    """One thread, two jobs claimed: the second waits in the worker's queue behind the
    first. Its cancel is committed and its heartbeat carries the request: when the thread
    is free, the handler is not called for it, and it is archived as cancelled."""
    first = enqueue_committed(engine, "first")
    second = enqueue_committed(engine, "second")
    go = threading.Event()
    called: list[str] = []

    def handler(job_type: str, payload: Any) -> None:
        called.append(job_type)
        if job_type == "first":
            go.wait(20)

    worker = sp.create_queue_worker(
        engine,
        handler,
        worker_threads=1,
        batch_size=2,
        lease_seconds=10.0,
        heartbeat_interval=0.1,
        polling_interval=0.02,
    )
    try:
        with running(worker):
            assert wait_for(lambda: job_row(engine, second).lease_token is not None, timeout=20)
            # The thread may take the first run from the worker's queue a moment after the
            # second's lease commits (a loaded machine): its handler holds it from then on.
            assert wait_for(lambda: called == ["first"], timeout=20), called
            assert cancel(engine, second) is True
            assert beats_after(engine, first)
            go.set()
            assert wait_for(lambda: archived_job(engine, second) is not None, timeout=20)
            assert wait_for(lambda: archived_job(engine, first) is not None, timeout=20)
    finally:
        go.set()
    assert called == ["first"]
    assert archived_job(engine, second).status == "cancelled"  # type: ignore[union-attr]
    assert archived_job(engine, first).status == "success"  # type: ignore[union-attr]


def test_async_a_cancel_committed_while_the_handler_runs_wins_over_its_raise(
    database: Any, engine: sa.Engine
) -> None:
    """The asyncio worker: the handler raises (retries left) after its cancel was committed,
    with no heartbeat in between: the job ends cancelled, run once."""
    job_id = enqueue_committed(engine, "cancel-me")

    async def main() -> list[str]:
        go = asyncio.Event()
        called: list[str] = []

        async def handler(job_type: str, payload: Any) -> None:
            called.append(job_type)
            await go.wait()
            raise RuntimeError("failed after the cancel")

        async with (
            async_engine(database) as worker_engine,
            sp.create_async_queue_worker(
                worker_engine, handler, retry_strategy=retry_always, **NO_BEAT
            ),
        ):
            assert await eventually(lambda: called == ["cancel-me"])
            assert await asyncio.to_thread(cancel, engine, job_id) is True
            go.set()
            assert await eventually(lambda: archived_job(engine, job_id) is not None)
        return called

    assert asyncio.run(main()) == ["cancel-me"]
    assert archived_job(engine, job_id).status == "cancelled"  # type: ignore[union-attr]
    assert jobs(engine) == []


def test_async_a_queued_run_whose_cancel_the_heartbeat_saw_never_starts(
    database: Any, engine: sa.Engine
) -> None:
    """The asyncio worker: a batch of two, one task; the second job's cancel is committed
    while it waits behind the first, and a heartbeat carries it: it is archived as
    cancelled, its handler never called."""
    if database.backend == "sqlite":
        pytest.skip("SQLite claims one job at a time: no run waits behind another")
    first = enqueue_committed(engine, "first")
    second = enqueue_committed(engine, "second")

    async def main() -> list[str]:
        go = asyncio.Event()
        called: list[str] = []

        async def handler(job_type: str, payload: Any) -> None:
            called.append(job_type)
            await go.wait()

        async with (
            async_engine(database) as worker_engine,
            sp.create_async_queue_worker(
                worker_engine,
                handler,
                concurrency=1,
                batch_size=2,
                lease_seconds=20.0,
                heartbeat_interval=0.3,
                polling_interval=0.02,
            ),
        ):
            assert await eventually(lambda: called == ["first"])
            assert await eventually(lambda: job_row(engine, second).lease_token is not None)
            assert await asyncio.to_thread(cancel, engine, second) is True
            assert await asyncio.to_thread(beats_after, engine, first)
            go.set()
            assert await eventually(lambda: jobs(engine) == [])
        return called

    assert asyncio.run(main()) == ["first"]
    assert archived_job(engine, first).status == "success"  # type: ignore[union-attr]
    assert archived_job(engine, second).status == "cancelled"  # type: ignore[union-attr]


# --- renewals the worker's own work cannot stop ----------------------------------------------


def test_a_final_flush_that_waits_for_a_row_lock_keeps_its_lease_and_runs_once(
    database: Any, engine: sa.Engine
) -> None:
    """The handler reads a row through job.session, changes it and returns; the final flush
    waits for a lock an application transaction holds for longer than the lease. Its lease
    is renewed meanwhile: a second worker on the queue never runs the job, and the change
    commits with the completion."""
    if database.backend == "sqlite":
        pytest.skip("SQLite: the application's write lock would hold the heartbeat up too")
    with Session(engine) as session:
        session.add(Note(id=1, text="before"))
        session.commit()
    job_id = enqueue_committed(engine, "edit")
    runs: list[str] = []

    def handler(job: sp.JobContext) -> None:
        runs.append(threading.current_thread().name.split("-")[0])
        note = job.session.get(Note, 1)
        assert note is not None
        note.text = "edited by the job"

    locker = engine.connect()
    locker.execute(sa.update(Note).where(Note.id == 1).values(text="locked"))
    workers = [
        sp.create_queue_worker(
            database.engine(), handler, handler_mode="advanced", worker_id=name, **SHORT_LEASE
        )
        for name in ("first", "second")
    ]
    try:
        workers[0].start()
        assert wait_for(lambda: runs == ["first"], timeout=20)
        workers[1].start()
        time.sleep(3.0)  # three leases long: without renewals, the second worker runs it
        locker.rollback()
        assert wait_for(lambda: archived_job(engine, job_id) is not None, timeout=20)
    finally:
        locker.close()
        for worker in workers:
            worker.stop()
    assert runs == ["first"]
    done = archived_job(engine, job_id)
    assert done is not None and (done.status, done.attempts) == ("success", 1)
    assert notes(engine) == ["edited by the job"]


#: A job runs this long at most before it is timed out.
TIMEOUT = 4.0
#: How long the timed-out job's failed-job handler takes: longer than a lease.
SLOW_CALLBACK = 3.5


def _slow_callbacks_scenario(
    database: Any, engine: sa.Engine, worker: Any, callback_started: threading.Event
) -> Counter[str]:
    """A job times out, and its failed-job handler takes 3.5 s; a healthy job, started a
    while after the first and shorter than the timeout, runs through that callback for
    longer than its lease; a second worker polls the queue from then on. The handlers'
    runs, by job type (each handler counts through the returned Counter's lock)."""
    enqueue_committed(engine, "times-out")
    assert wait_for(lambda: RAN["times-out"] == 1, timeout=20)
    time.sleep(TIMEOUT - 1.5)
    enqueue_committed(engine, "healthy")
    assert wait_for(lambda: RAN["healthy"] == 1, timeout=20)
    other = sp.create_queue_worker(
        database.engine(), lambda t, p: ran(t), worker_id="other", **SHORT_LEASE
    )
    with running(other):
        assert callback_started.wait(20)
        assert wait_for(lambda: jobs(engine) == [], timeout=20)
    return RAN


RAN: Counter[str] = Counter()
_RAN_LOCK = threading.Lock()


def ran(job_type: str) -> None:
    with _RAN_LOCK:
        RAN[job_type] += 1


@pytest.fixture
def callback_started() -> threading.Event:
    RAN.clear()
    return threading.Event()


def test_a_slow_failed_job_handler_of_a_timed_out_job_never_lets_another_lease_expire(
    database: Any, engine: sa.Engine, callback_started: threading.Event
) -> None:
    """The failed-job handler of a timed-out job takes 3.5 s: the heartbeat renews the
    other running job's lease meanwhile, and no second worker runs it."""
    failed: list[str] = []
    release = threading.Event()

    def handler(job_type: str, payload: Any) -> None:
        ran(job_type)
        if job_type == "healthy":
            callback_started.wait(TIMEOUT - 1)
            time.sleep(1.6)
        else:
            release.wait(20)  # ignores its timeout

    def slow_failed_job_handler(job: sp.JobContext, exc: Exception) -> None:
        callback_started.set()
        time.sleep(SLOW_CALLBACK)
        failed.append(type(exc).__name__)

    worker = sp.create_queue_worker(
        engine,
        handler,
        worker_threads=2,
        job_timeout=TIMEOUT,
        failed_job_handler=slow_failed_job_handler,
        **SHORT_LEASE,
    )
    try:
        with running(worker):
            counts = _slow_callbacks_scenario(database, engine, worker, callback_started)
            assert wait_for(lambda: failed == ["JobTimeoutError"], timeout=20)
            release.set()
    finally:
        release.set()
    assert counts == {"times-out": 1, "healthy": 1}


def test_async_a_slow_failed_job_handler_of_a_timed_out_job_never_lets_another_lease_expire(
    database: Any, engine: sa.Engine, callback_started: threading.Event
) -> None:
    """The asyncio worker: a timed-out job's async failed-job handler takes 3.5 s; the
    keeper task renews the healthy job's lease meanwhile, and no second worker runs it."""

    async def main() -> tuple[Counter[str], list[str]]:
        failed: list[str] = []

        async def handler(job_type: str, payload: Any) -> None:
            ran(job_type)
            if job_type == "healthy":
                await asyncio.to_thread(callback_started.wait, TIMEOUT - 1)
                await asyncio.sleep(1.6)
            else:
                await asyncio.sleep(30)

        async def slow_failed_job_handler(job: Any, exc: Exception) -> None:
            callback_started.set()
            await asyncio.sleep(SLOW_CALLBACK)
            failed.append(type(exc).__name__)

        async with (
            async_engine(database) as worker_engine,
            sp.create_async_queue_worker(
                worker_engine,
                handler,
                concurrency=2,
                job_timeout=TIMEOUT,
                failed_job_handler=slow_failed_job_handler,
                **SHORT_LEASE,
            ) as worker,
        ):
            counts = await asyncio.to_thread(
                _slow_callbacks_scenario, database, engine, worker, callback_started
            )
            assert await eventually(lambda: bool(failed))
        return counts, failed

    counts, failed = asyncio.run(main())
    assert failed == ["JobTimeoutError"]
    assert counts == {"times-out": 1, "healthy": 1}


# --- every run counted -----------------------------------------------------------------------


def test_a_run_whose_connection_was_lost_is_counted_in_attempts_without_taking_a_retry(
    database: Any, engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """The job's session is ended by the server after the handler wrote: nothing of the run
    commits and the job runs again, as attempt 1 again (no retry was charged, no unclean
    end); the archive's attempts counts both runs."""
    if database.backend == "sqlite":
        pytest.skip("SQLite has no server session to end")
    caplog.set_level("INFO", logger="sqla_proletarian")
    job_id = enqueue_committed(engine, "loses-its-connection")
    seen: list[int] = []

    def handler(job: sp.JobContext) -> None:
        seen.append(job.attempts)
        job.session.add(Note(text=f"run {len(seen)}"))
        job.session.flush()
        if len(seen) == 1:
            raw = job.session.connection().connection.dbapi_connection
            kill_session(engine, raw)

    worker = sp.create_queue_worker(
        database.engine(),
        handler,
        handler_mode="advanced",
        retry_strategy=lambda job, exc: sp.RetryStrategy(retries=0),
        **NO_BEAT,
    )
    with running(worker):
        assert wait_for(lambda: archived_job(engine, job_id) is not None, timeout=20)
    assert seen == [1, 1]
    assert len(events(caplog.records, "job-connection-lost")) == 1
    done = archived_job(engine, job_id)
    assert done is not None and (done.status, done.attempts) == ("success", 2)
    assert notes(engine) == ["run 2"]
