"""asyncio on every backend and async driver (aiosqlite, asyncpg, psycopg async, aiomysql):
enqueue through an AsyncSession or AsyncConnection joins its transaction, and the asyncio
worker runs jobs with the threaded worker's outcomes (retries, failures, the job's session,
graceful stop, wake-ups)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import sqlalchemy as sa
from helpers import (
    FakeClock,
    archived,
    archived_job,
    count,
    enqueue_committed,
    jobs,
    run_records,
)
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import sqla_proletarian as sp
from sqla_proletarian.handlers import SessionOnFirstUse
from sqla_proletarian.models import PeriodicSchedule

if TYPE_CHECKING:
    from conftest import Database

#: The async driver of each backend, and the drivername prefix of its URLs.
DEFAULT_DRIVER = {"sqlite": "aiosqlite", "postgresql": "asyncpg", "mariadb": "aiomysql"}
PREFIX = {"sqlite": "sqlite", "postgresql": "postgresql", "mariadb": "mysql"}
_SELECTED = os.environ.get("SP_TEST_BACKENDS", "sqlite,postgresql,mariadb").split(",")
_PAIRS = [
    (backend, driver)
    for backend, driver in (
        ("sqlite", "aiosqlite"),
        ("postgresql", "asyncpg"),
        ("postgresql", "psycopg"),
        ("mariadb", "aiomysql"),
    )
    if backend in _SELECTED
]
#: Runs a test once per async driver of each backend (psycopg's async side, too).
EVERY_DRIVER = pytest.mark.parametrize(
    ("empty_database", "async_driver"),
    _PAIRS,
    indirect=["empty_database"],
    ids=[f"{backend}-{driver}" for backend, driver in _PAIRS],
)
#: Far longer than a wake-up may take: a job that starts sooner was woken.
SLOW_POLLING = 10.0


class Base(DeclarativeBase):
    pass


class Note(Base):
    """What handlers write through ``job.session``."""

    __tablename__ = "aio_notes"
    id: Mapped[int] = mapped_column(primary_key=True)
    text: Mapped[str] = mapped_column(sa.String(100))


@pytest.fixture
def async_driver(database: Database) -> str:
    """The backend's default async driver (tests marked EVERY_DRIVER get each in turn)."""
    return DEFAULT_DRIVER[database.backend]


@pytest.fixture
def async_url(database: Database, async_driver: str) -> URL:
    """The test database's URL through the async driver."""
    return database.url.set(drivername=f"{PREFIX[database.backend]}+{async_driver}")


@pytest.fixture
def sync_engine(database: Database) -> sa.Engine:
    """A sync engine on the same database, for reading results back (from a thread)."""
    engine = database.engine()
    Base.metadata.create_all(engine)
    return engine


@contextlib.asynccontextmanager
async def async_engine(url: URL, **kwargs: Any) -> AsyncIterator[AsyncEngine]:
    engine = create_async_engine(url, **kwargs)
    try:
        yield engine
    finally:
        await engine.dispose()


async def eventually(check: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Run a sync check in a thread (the loop keeps running) until it holds or time is up."""
    deadline = time.monotonic() + timeout
    while True:
        if await asyncio.to_thread(check):
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.02)


def notes(engine: sa.Engine) -> list[str]:
    with Session(engine) as session:
        return sorted(session.scalars(sa.select(Note.text)))


# --- enqueue -------------------------------------------------------------------------------


@EVERY_DRIVER
def test_enqueue_on_an_async_session_commits_with_it_and_rolls_back_with_it(
    async_url: URL, sync_engine: sa.Engine
) -> None:
    """sp.enqueue(async_session) is a sync call that joins the unit of work (flushed at the
    commit); await sp.enqueue_async(async_session) does the same. A rollback leaves nothing."""

    async def main() -> tuple[uuid.UUID, uuid.UUID, uuid.UUID, int]:
        async with async_engine(async_url) as engine, AsyncSession(engine) as session:
            session.add(Note(text="kept"))
            kept = sp.enqueue(session, "welcome", {"n": 1}, queue="mail")
            also = await sp.enqueue_async(session, "welcome", {"n": 2}, queue="mail")
            pending = len(session.new)
            await session.commit()
            session.add(Note(text="dropped"))
            dropped = await sp.enqueue_async(session, "welcome", {"n": 3}, queue="mail")
            await session.flush()  # written, then rolled back
            await session.rollback()
        return kept, also, dropped, pending

    kept, also, dropped, pending = asyncio.run(main())
    assert pending == 3, "the jobs joined the unit of work, not the database, until the flush"
    assert {(j.job_id, j.queue, j.job_type) for j in jobs(sync_engine)} == {
        (kept, "mail", "welcome"),
        (also, "mail", "welcome"),
    }
    assert dropped not in {j.job_id for j in jobs(sync_engine)}
    assert notes(sync_engine) == ["kept"]


@EVERY_DRIVER
def test_enqueue_async_and_enqueue_many_async_insert_in_an_async_connections_transaction(
    async_url: URL, sync_engine: sa.Engine
) -> None:
    async def main() -> tuple[list[uuid.UUID], list[uuid.UUID]]:
        async with async_engine(async_url) as engine:
            async with engine.begin() as conn:
                one = await sp.enqueue_async(conn, "index", {"doc": 1})
                many = await sp.enqueue_many_async(conn, [("index", {"doc": n}) for n in (2, 3)])
                # Inserted at once, in the connection's transaction.
                seen = await conn.scalar(sa.select(sa.func.count()).select_from(sp.Job))
                assert seen == 3
            async with engine.connect() as conn:
                gone = await sp.enqueue_many_async(conn, [("index", None)] * 2)
                await sp.enqueue_async(conn, "index", None)
                await conn.rollback()
            async with AsyncSession(engine) as session:
                via_session = await sp.enqueue_many_async(session, [("index", {"doc": 4})])
                await session.commit()
        return [one, *many, *via_session], gone

    kept, gone = asyncio.run(main())
    assert len(gone) == 2
    assert [j.job_id for j in jobs(sync_engine)] == kept, "committed ones, in order; no other"


def test_async_enqueue_refuses_engines_and_what_it_cannot_do_without_awaiting(
    tmp_path: Path,
) -> None:
    """An AsyncEngine has no transaction to join (refused like an Engine); sp.enqueue cannot
    write through an AsyncConnection, nor sp.enqueue_many through an AsyncSession, without
    awaiting; enqueue_async takes no sync Session. A bad job adds nothing to the session."""

    async def main() -> None:
        async with async_engine(
            URL.create("sqlite+aiosqlite", database=str(tmp_path / "x.db"))
        ) as engine:
            for call in (
                lambda: sp.enqueue(engine, "t"),  # type: ignore[arg-type]
                lambda: sp.enqueue_many(engine, [("t", None)]),  # type: ignore[arg-type]
            ):
                with pytest.raises(sp.NotATransactionError, match=r"AsyncEngine.*enqueue"):
                    call()
            for coroutine in (
                sp.enqueue_async(engine, "t"),  # type: ignore[arg-type]
                sp.enqueue_many_async(engine, []),  # type: ignore[arg-type]
            ):
                with pytest.raises(sp.NotATransactionError, match=r"engine\.begin\(\)"):
                    await coroutine
            async with engine.connect() as conn:
                with pytest.raises(sp.NotATransactionError, match="enqueue_async"):
                    sp.enqueue(conn, "t")  # type: ignore[arg-type]
            async with AsyncSession(engine) as session:
                with pytest.raises(sp.NotATransactionError, match="enqueue_many_async"):
                    sp.enqueue_many(session, [("t", None)])  # type: ignore[arg-type]
                with pytest.raises(sp.PayloadSerializationError):
                    await sp.enqueue_async(session, "t", {"bad": {1, 2}})
                with pytest.raises(sp.InvalidJobError):
                    await sp.enqueue_many_async(session, [("t", None), ("", None)])
                assert not session.new, "nothing was added"
            with (
                Session() as sync_session,
                pytest.raises(sp.NotATransactionError, match=r"sp\.enqueue\("),
            ):
                await sp.enqueue_async(sync_session, "t")  # type: ignore[arg-type]

    asyncio.run(main())


# --- the worker ----------------------------------------------------------------------------


def to_async(database: Database, driver: str | None = None) -> URL:
    driver = driver or DEFAULT_DRIVER[database.backend]
    return database.url.set(drivername=f"{PREFIX[database.backend]}+{driver}")


def test_create_async_queue_worker_refuses_thread_options_unknown_options_and_sync_engines(
    tmp_path: Path,
) -> None:
    """worker_threads and install_signal_handlers are refused naming what to do instead; the
    other options are checked as for the threaded worker; an Engine is refused, and the
    threaded worker refuses an AsyncEngine."""
    engine = create_async_engine(URL.create("sqlite+aiosqlite", database=str(tmp_path / "x.db")))

    async def handler(job_type: str, payload: Any) -> None:
        return None

    refusals: dict[str, dict[str, Any]] = {
        "concurrency=N": {"worker_threads": 2},
        "lifespan.*add_signal_handler": {"install_signal_handlers": True},
        "concurrency is 0": {"concurrency": 0},
        "polling_interval is 0": {"polling_interval": 0},
        "handler_mode": {"handler_mode": "fancy"},
    }
    for message, options in refusals.items():
        with pytest.raises(sp.ConfigurationError, match=message):
            sp.create_async_queue_worker(engine, handler, **options)
    with pytest.raises(TypeError, match=r"^create_async_queue_worker\(\) got an unexpected"):
        sp.create_async_queue_worker(engine, handler, colour="red")  # type: ignore[call-arg]
    with pytest.raises(sp.ConfigurationError, match="AsyncEngine, not Engine"):
        sp.create_async_queue_worker(engine.sync_engine, handler)  # type: ignore[arg-type]
    with pytest.raises(sp.ConfigurationError, match="needs a sqlalchemy Engine"):
        sp.create_queue_worker(engine, handler)  # type: ignore[arg-type]
    worker = sp.create_async_queue_worker(engine, handler, concurrency=4, queue="mail")
    assert isinstance(worker, sp.AsyncQueueWorker)
    assert (worker.concurrency, worker.worker_id, worker.running) == (4, "proletarian[mail]", False)
    asyncio.run(engine.dispose())


@EVERY_DRIVER
def test_async_worker_runs_jobs_in_concurrent_tasks_and_no_job_twice(
    async_url: URL, sync_engine: sa.Engine, backend: str
) -> None:
    with Session(sync_engine) as session:
        ids = sp.enqueue_many(session, [("t", n) for n in range(30)])
        session.commit()
    runs: list[uuid.UUID] = []
    live, peak = 0, 0

    async def handler(job: sp.AsyncJobContext) -> None:
        nonlocal live, peak
        live += 1
        peak = max(peak, live)
        await asyncio.sleep(0.01)
        runs.append(job.job_id)
        live -= 1

    async def main() -> sp.AsyncQueueWorker:
        async with async_engine(async_url) as engine:
            worker = sp.create_async_queue_worker(
                engine,
                handler,
                concurrency=3,
                handler_mode="advanced",
                polling_interval=0.05,
            )
            async with worker:
                assert worker.running
                assert await eventually(lambda: count(sync_engine, sp.ArchivedJob) == 30, 30)
            assert not worker.running and worker.exception is None
        return worker

    worker = asyncio.run(main())
    assert sorted(runs) == sorted(ids), "each job ran exactly once"
    assert {a.status for a in archived(sync_engine)} == {"success"}
    assert jobs(sync_engine) == [] and run_records(sync_engine) == 0
    assert worker.summary() == {"succeeded": 30, "retried": 0, "failed": 0}
    assert worker.summary_text() == "30 succeeded, 0 retried, 0 failed"
    # SQLite runs one job at a time per file; the servers ran the tasks' jobs side by side.
    assert peak == 1 if backend == "sqlite" else peak >= 2, peak


def test_a_failing_async_handler_is_retried_then_archived_as_failure_for_the_failed_job_handler(
    async_url: URL, sync_engine: sa.Engine
) -> None:
    """The retry strategy and the failed-job handler may be async too; both see the
    AsyncJobContext the handler saw."""
    job_id = enqueue_committed(sync_engine, "charge", {"card": "4242"})
    attempts: list[int] = []
    failures: list[tuple[uuid.UUID, int, str]] = []

    async def handler(job: sp.AsyncJobContext) -> None:
        attempts.append(job.attempts)
        await asyncio.sleep(0)
        raise ValueError("card declined")

    async def retry_strategy(job: sp.AsyncJobContext, exc: Exception) -> sp.RetryStrategy:
        assert isinstance(job, sp.AsyncJobContext) and isinstance(exc, ValueError)
        await asyncio.sleep(0)
        return sp.RetryStrategy(retries=2, delays=[0])

    async def failed_job_handler(job: sp.AsyncJobContext, exc: Exception) -> None:
        await asyncio.sleep(0)
        failures.append((job.job_id, job.attempts, repr(exc)))

    async def main() -> sp.AsyncQueueWorker:
        async with async_engine(async_url) as engine:
            worker = sp.create_async_queue_worker(
                engine,
                handler,
                handler_mode="advanced",
                polling_interval=0.05,
                retry_strategy=retry_strategy,
                failed_job_handler=failed_job_handler,
            )
            async with worker:
                assert await eventually(lambda: bool(failures))
        return worker

    worker = asyncio.run(main())
    assert attempts == [1, 2, 3]
    assert failures == [(job_id, 3, "ValueError('card declined')")]
    done = archived_job(sync_engine, job_id)
    assert done is not None and (done.status, done.attempts) == ("failure", 3)
    assert done.error is not None and "ValueError: card declined" in done.error
    assert worker.summary() == {"succeeded": 0, "retried": 2, "failed": 1}


def test_job_handlers_dispatch_to_async_and_plain_functions_in_default_mode(
    async_url: URL, sync_engine: sa.Engine
) -> None:
    """An async def is awaited, a plain function called; an async generator's body never runs
    and its job fails saying so, and so does a handler that raises a CancelledError of its
    own (the worker's task goes on)."""
    handlers = sp.JobHandlers()
    calls: list[tuple[str, Any]] = []

    @handlers.register("async")
    async def run_async(job_type: str, payload: Any) -> None:
        await asyncio.sleep(0)
        calls.append((job_type, payload))

    @handlers.register("plain")
    def run_plain(job_type: str, payload: Any) -> None:
        calls.append((job_type, payload))

    @handlers.register("generator")
    async def run_generator(job_type: str, payload: Any) -> AsyncIterator[None]:
        calls.append((job_type, payload))
        yield

    @handlers.register("cancelled")
    async def run_cancelled(job_type: str, payload: Any) -> None:
        waiting = asyncio.get_running_loop().create_future()
        waiting.cancel()
        await waiting

    cancelled = enqueue_committed(sync_engine, "cancelled", 0)
    ids = [enqueue_committed(sync_engine, t, n) for n, t in enumerate(("async", "plain"))]
    generator = enqueue_committed(sync_engine, "generator", 2)

    async def main() -> None:
        async with (
            async_engine(async_url) as engine,
            sp.create_async_queue_worker(engine, handlers, polling_interval=0.05),
        ):
            assert await eventually(lambda: count(sync_engine, sp.ArchivedJob) == 4)

    asyncio.run(main())
    assert calls == [("async", 0), ("plain", 1)]
    failed_alone = archived_job(sync_engine, cancelled)
    assert failed_alone is not None and failed_alone.status == "failure"
    assert "did not cancel the job" in (failed_alone.error or "")
    assert {archived_job(sync_engine, i).status for i in ids} == {"success"}  # type: ignore[union-attr]
    failed = archived_job(sync_engine, generator)
    assert failed is not None and failed.status == "failure" and "generator" in (failed.error or "")


IDIOMS = (
    "add",
    "flush",
    "begin",
    "commit",
    "nested",
    "rollback",
    "execute",
    "bind-execute",
    "connection-execute",
    "bind-driver-sql",
    "bind-nested",
)


async def write_note(session: AsyncSession, idiom: str, text: str) -> None:
    """Write one Note through the job's AsyncSession, the way ``idiom`` says."""
    if idiom == "add":  # the worker flushes it
        session.add(Note(text=text))
    elif idiom == "flush":
        session.add(Note(text=text))
        await session.flush()
    elif idiom == "begin":
        async with session.begin():
            session.add(Note(text=text))
    elif idiom == "commit":
        session.add(Note(text=text))
        await session.commit()
    elif idiom == "nested":
        async with session.begin_nested():
            session.add(Note(text=text))
    elif idiom == "rollback":
        session.add(Note(text=f"undone {text}"))
        await session.flush()
        await session.rollback()
        session.add(Note(text=text))
        await session.commit()
    elif idiom == "execute":
        await session.execute(sa.insert(Note).values(text=text))
    elif idiom == "connection-execute":
        await (await session.connection()).execute(sa.insert(Note).values(text=text))
    else:  # past the session, on the job's connection (``session.bind``)
        bind = session.bind
        assert isinstance(bind, AsyncConnection)
        if idiom == "bind-execute":
            await bind.execute(sa.insert(Note).values(text=text))
        elif idiom == "bind-driver-sql":
            await bind.exec_driver_sql(f"INSERT INTO aio_notes (text) VALUES ('{text}')")
        else:
            async with bind.begin_nested():
                await bind.execute(sa.insert(Note).values(text=text))


@EVERY_DRIVER
def test_advanced_mode_session_writes_commit_with_the_archive_and_roll_back_if_the_handler_raises(
    async_url: URL, sync_engine: sa.Engine
) -> None:
    """Whatever the handler does with job.session (flush, ``async with begin()``, commit,
    begin_nested, rollback, execute, or statements on ``job.session.bind`` past the session),
    its writes commit with the job's success, and none stays when it raises afterwards."""
    handlers = sp.JobHandlers()

    @handlers.default
    async def write(job: sp.AsyncJobContext) -> None:
        assert isinstance(job.session, AsyncSession)
        await write_note(job.session, job.job_type, f"{job.job_type} {job.payload}")
        if job.payload == "raises":
            raise RuntimeError("after writing")

    with Session(sync_engine) as session:
        for idiom in IDIOMS:
            sp.enqueue_many(session, [(idiom, "keeps"), (idiom, "raises")])
        session.commit()

    async def main() -> None:
        async with (
            async_engine(async_url) as engine,
            sp.create_async_queue_worker(
                engine, handlers, handler_mode="advanced", polling_interval=0.05
            ),
        ):
            assert await eventually(
                lambda: count(sync_engine, sp.ArchivedJob) == 2 * len(IDIOMS), 20
            )

    asyncio.run(main())
    assert notes(sync_engine) == sorted(f"{idiom} keeps" for idiom in IDIOMS)
    outcomes = {(a.job_type, a.status) for a in archived(sync_engine)}
    assert outcomes == {(i, s) for i in IDIOMS for s in ("success", "failure")}
    assert jobs(sync_engine) == []


@EVERY_DRIVER
def test_an_advanced_handlers_session_is_made_on_its_first_read_and_is_the_same_after(
    async_url: URL, sync_engine: sa.Engine
) -> None:
    """The AsyncJobContext's session is not made until the handler (or anything it calls)
    reads it: a handler that never does costs no Session; one that does gets one
    AsyncSession, the same at every read, over the job's transaction."""
    seen: dict[str, list[Any]] = {}

    async def handler(job: sp.AsyncJobContext) -> None:
        before = type(object.__getattribute__(job, "session"))
        sessions = [job.session, sp.current_job().session] if job.payload == "reads" else []
        seen[job.payload] = [before, *sessions]
        if sessions:
            await write_note(sessions[0], "flush", "read on first use")

    with Session(sync_engine) as session:
        sp.enqueue_many(session, [("t", "never reads"), ("t", "reads")])
        session.commit()

    async def main() -> None:
        async with (
            async_engine(async_url) as engine,
            sp.create_async_queue_worker(
                engine, handler, handler_mode="advanced", polling_interval=0.05
            ),
        ):
            assert await eventually(lambda: count(sync_engine, sp.ArchivedJob) == 2, 20)

    asyncio.run(main())
    assert seen["never reads"] == [SessionOnFirstUse]
    before, first, again = seen["reads"]
    assert before is SessionOnFirstUse
    assert isinstance(first, AsyncSession) and again is first
    assert notes(sync_engine) == ["read on first use"]
    assert {a.status for a in archived(sync_engine)} == {"success"}


def test_stop_waits_for_a_running_job_then_calls_an_async_on_shutdown_once(
    async_url: URL, sync_engine: sa.Engine
) -> None:
    job_id = enqueue_committed(sync_engine, "slow")

    async def main() -> tuple[float, list[str | None]]:
        started = asyncio.Event()
        shutdowns: list[str | None] = []

        async def handler(job_type: str, payload: Any) -> None:
            started.set()
            await asyncio.sleep(0.5)

        async def on_shutdown() -> None:
            done = await asyncio.to_thread(archived_job, sync_engine, job_id)
            shutdowns.append(done.status if done else None)

        async with async_engine(async_url) as engine:
            worker = sp.create_async_queue_worker(
                engine, handler, polling_interval=0.05, on_shutdown=on_shutdown
            )
            await worker.start()
            await asyncio.wait_for(started.wait(), 10)
            began = time.monotonic()
            await worker.stop()
            waited = time.monotonic() - began
            await worker.stop()  # a second stop is harmless
            assert await worker.wait(0) and not worker.running
            with pytest.raises(sp.ConfigurationError, match="create_async_queue_worker"):
                await worker.start()
        return waited, shutdowns

    waited, shutdowns = asyncio.run(main())
    assert 0.3 < waited < 5, waited
    assert shutdowns == ["success"], "on_shutdown once, after the job was archived"
    done = archived_job(sync_engine, job_id)
    assert done is not None and (done.status, done.attempts) == ("success", 1)


def test_a_handler_that_stops_its_worker_finishes_its_job_and_no_other_starts(
    async_url: URL, sync_engine: sa.Engine
) -> None:
    """stop() from a handler only asks for the stop (awaiting it there would wait forever for
    the handler itself); the job is archived, the next one stays queued."""
    first, second = (enqueue_committed(sync_engine, "t", n) for n in range(2))
    workers: list[sp.AsyncQueueWorker] = []

    async def handler(job_type: str, payload: Any) -> None:
        await workers[0].stop()

    async def main() -> None:
        async with async_engine(async_url) as engine:
            workers.append(sp.create_async_queue_worker(engine, handler, polling_interval=0.05))
            await workers[0].start()
            assert await workers[0].wait(10), "the worker stopped"

    asyncio.run(main())
    done = archived_job(sync_engine, first)
    assert done is not None and done.status == "success"
    assert [job.job_id for job in jobs(sync_engine)] == [second]
    assert workers[0].exception is None and not workers[0].running


def test_stop_past_the_termination_timeout_cancels_the_job_which_runs_again_not_charged(
    async_url: URL, sync_engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """The stuck handler is cancelled: its writes roll back, the job is back in the queue
    with no run record, and its next run is its first with an outcome (attempts 1, so the
    cancelled run counts as no unclean end)."""
    caplog.set_level(logging.INFO, logger="sqla_proletarian")
    job_id = enqueue_committed(sync_engine, "stuck")

    async def main() -> tuple[float, list[int], int, list[int]]:
        started = asyncio.Event()
        runs: list[int] = []

        async def handler(job: sp.AsyncJobContext) -> None:
            runs.append(job.attempts)
            job.session.add(Note(text=f"run {len(runs)}"))
            await job.session.flush()
            if len(runs) == 1:
                started.set()
                await asyncio.sleep(60)

        options: dict[str, Any] = {"handler_mode": "advanced", "polling_interval": 0.05}
        async with async_engine(async_url) as engine:
            worker = sp.create_async_queue_worker(
                engine, handler, await_termination_timeout=0.2, **options
            )
            await worker.start()
            await asyncio.wait_for(started.wait(), 10)
            began = time.monotonic()
            await worker.stop()
            waited = time.monotonic() - began
            assert worker.unfinished == 1, "the stop gave up on the running job"
            queued = [job.attempts for job in await asyncio.to_thread(jobs, sync_engine)]
            records = await asyncio.to_thread(run_records, sync_engine)
            async with sp.create_async_queue_worker(engine, handler, **options):
                assert await eventually(lambda: archived_job(sync_engine, job_id) is not None)
        return waited, queued, records, runs

    waited, queued, records, runs = asyncio.run(main())
    assert 0.15 < waited < 3, waited
    assert (queued, records) == ([0], 0), "back in the queue, untouched, no run record"
    assert runs == [1, 1]
    done = archived_job(sync_engine, job_id)
    assert done is not None and (done.status, done.attempts) == ("success", 1)
    assert notes(sync_engine) == ["run 2"], "the cancelled run's write rolled back"
    [timeout] = [
        r for r in caplog.records if getattr(r, "event", None) == "queue-worker-shutdown-timeout"
    ]
    assert timeout.tasks == "proletarian[default]-0"


def test_a_same_process_enqueue_wakes_an_idle_async_worker_long_before_its_polling_interval(
    async_url: URL, sync_engine: sa.Engine
) -> None:
    """poll_only=True: no LISTEN, so only the in-process wake-up can start the job early;
    wake() from another thread wakes it too."""

    async def main() -> tuple[float, float]:
        started = asyncio.Queue[Any]()

        async def handler(job_type: str, payload: Any) -> None:
            started.put_nowait(payload)

        async with async_engine(async_url) as engine:
            worker = sp.create_async_queue_worker(
                engine, handler, polling_interval=SLOW_POLLING, poll_only=True
            )
            async with worker:
                await asyncio.sleep(0.3)  # the first poll found nothing: the worker idles
                async with AsyncSession(engine) as session:
                    sp.enqueue(session, "t", "enqueued")
                    began = time.monotonic()
                    await session.commit()
                assert await asyncio.wait_for(started.get(), 5) == "enqueued"
                woken = time.monotonic() - began
                await asyncio.sleep(0.1)  # idle again
                await asyncio.to_thread(enqueue_committed, sync_engine, "t", "other engine")
                began = time.monotonic()
                await asyncio.to_thread(worker.wake)
                assert await asyncio.wait_for(started.get(), 5) == "other engine"
                nudged = time.monotonic() - began
        return woken, nudged

    woken, nudged = asyncio.run(main())
    assert woken < 1.0 and nudged < 1.0, (woken, nudged)


_PG_PAIRS = [pair for pair in _PAIRS if pair[0] == "postgresql"]


@pytest.mark.parametrize(
    ("empty_database", "async_driver"),
    _PG_PAIRS,
    indirect=["empty_database"],
    ids=[driver for _, driver in _PG_PAIRS],
)
def test_postgresql_async_workers_listen_through_their_driver_and_wake_on_notify(
    async_url: URL, database: Database
) -> None:
    """asyncpg (add_listener) and psycopg (notifies()): a job committed through psycopg2,
    another driver and so another URL (no in-process wake-up), starts at once by NOTIFY."""
    other_engine = sa.create_engine(database.url.set(drivername="postgresql+psycopg2"))

    async def main() -> float:
        started = asyncio.Event()

        async def handler(job_type: str, payload: Any) -> None:
            started.set()

        async with (
            async_engine(async_url) as engine,
            sp.create_async_queue_worker(engine, handler, polling_interval=SLOW_POLLING),
        ):
            await asyncio.sleep(0.5)  # listening, and idle after the first poll
            await asyncio.to_thread(enqueue_committed, other_engine, "t")
            began = time.monotonic()
            await asyncio.wait_for(started.wait(), 5)
            return time.monotonic() - began

    try:
        assert asyncio.run(main()) < 1.0
    finally:
        other_engine.dispose()


def test_a_polling_error_stops_the_async_worker_by_itself_unless_on_polling_error_goes_on(
    empty_database: Database,
) -> None:
    """No tables: the default stops the worker (exception says why); an async
    on_polling_error that returns False keeps it polling."""
    url = to_async(empty_database)

    async def handler(job_type: str, payload: Any) -> None:
        return None

    async def main() -> None:
        errors: list[Exception] = []

        async def keep_polling(exc: Exception) -> bool:
            errors.append(exc)
            return False

        async with async_engine(url) as engine:
            worker = sp.create_async_queue_worker(engine, handler, polling_interval=0.05)
            await worker.start()
            assert await worker.wait(10), "the worker stopped by itself"
            assert not worker.running and isinstance(worker.exception, sa.exc.DBAPIError)
            tolerant = sp.create_async_queue_worker(
                engine, handler, polling_interval=0.05, on_polling_error=keep_polling
            )
            async with tolerant:
                for _ in range(200):
                    if len(errors) >= 2:
                        break
                    await asyncio.sleep(0.02)
                assert tolerant.running and len(errors) >= 2
            assert tolerant.exception is None

    asyncio.run(main())


def test_the_package_works_without_greenlet_until_its_asyncio_names_are_used() -> None:
    """SQLAlchemy 2.1 installs no greenlet by default: the threaded library must not need it,
    and the asyncio names say what to install."""
    program = """
import sys
sys.modules["greenlet"] = None  # as if it were not installed
import sqlalchemy as sa
from sqlalchemy.orm import Session
import sqla_proletarian as sp
engine = sa.create_engine("sqlite://")
sp.metadata.create_all(engine)
with Session(engine) as session:
    sp.enqueue(session, "t")
    session.commit()
assert sp.process_next_job(engine, lambda job_type, payload: None)
try:
    sp.create_async_queue_worker
except ImportError as exc:
    print(exc)
"""
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "greenlet" in done.stdout


# --- job control ---------------------------------------------------------------------------


def test_the_async_worker_enqueues_its_periodic_jobs_once_per_occurrence(
    async_url: URL, sync_engine: sa.Engine
) -> None:
    """``periodic_jobs`` works in the asyncio worker as in the threaded one: with a fake
    clock, each occurrence is enqueued once (three tasks tick it) and then run."""
    start = datetime(2040, 2, 29, 12, 0, 0, tzinfo=UTC)
    clock = FakeClock(start)
    ran: list[Any] = []

    async def handler(job_type: str, payload: Any) -> None:
        ran.append(payload)

    async def main() -> None:
        async with async_engine(async_url) as engine:
            worker = sp.create_async_queue_worker(
                engine,
                handler,
                concurrency=3,
                clock=clock,
                polling_interval=0.01,
                periodic_jobs=[sp.PeriodicJob("tick", every=timedelta(minutes=1), payload=1)],
            )
            async with worker:
                # The first look records the schedule; its next occurrence is 12:01.
                assert await eventually(lambda: count(sync_engine, PeriodicSchedule) == 1)
                # An idle watcher under LISTEN sleeps until the next occurrence by the clock
                # (up to 10 s): a clock that jumps ahead wakes it, as time passing would.
                clock.set(start + timedelta(minutes=1, seconds=1))
                worker.wake()
                assert await eventually(lambda: len(ran) == 1)
                clock.set(start + timedelta(minutes=2, seconds=1))
                worker.wake()
                assert await eventually(lambda: len(ran) == 2)
                await asyncio.sleep(0.1)

    asyncio.run(main())
    assert ran == [1, 1]
    assert sorted(job.process_at for job in archived(sync_engine)) == [
        start + timedelta(minutes=1),
        start + timedelta(minutes=2),
    ]


def test_unique_keys_and_priorities_through_enqueue_async(
    async_url: URL, sync_engine: sa.Engine
) -> None:
    """``await sp.enqueue_async(..., unique_key=...)`` returns the holder's id for a second
    job with the key; the sync ``sp.enqueue(async_session, unique_key=...)`` cannot insert at
    once and says to await; the async worker runs the higher priority first."""

    async def main() -> tuple[uuid.UUID, uuid.UUID, uuid.UUID]:
        async with async_engine(async_url) as engine:
            async with AsyncSession(engine) as session:
                # Enqueued first and due first, but of a lower priority.
                low = await sp.enqueue_async(session, "low", None, priority=-5)
                first = await sp.enqueue_async(session, "sync", {"n": 1}, unique_key="k")
                second = await sp.enqueue_async(session, "sync", {"n": 2}, unique_key="k")
                with pytest.raises(sp.NotATransactionError, match="enqueue_async"):
                    sp.enqueue(session, "sync", {"n": 3}, unique_key="other")
                await session.commit()
            order: list[str] = []

            async def handler(job_type: str, payload: Any) -> None:
                order.append(job_type)

            async with sp.create_async_queue_worker(engine, handler, polling_interval=0.01):
                assert await eventually(lambda: len(order) == 2)
            assert order == ["sync", "low"]
            return first, second, low

    first, second, low = asyncio.run(main())
    assert first == second and low != first
    assert {job.job_id for job in archived(sync_engine)} == {first, low}


def test_a_job_whose_session_the_server_ends_mid_handler_is_charged_and_never_overlapped(
    database: Database, async_url: URL, sync_engine: sa.Engine
) -> None:
    """The asyncio worker as the threaded one: the server ends the job's session while its
    handler runs (each run), the worker's owner session lives on, so each loss counts as an
    unclean end; the worker's other task leaves the job alone meanwhile; after
    max_unclean_ends runs the job is archived as failed instead of looping."""
    if database.backend == "sqlite":
        pytest.skip("SQLite has no server sessions to end")
    job_id = enqueue_committed(sync_engine, "killed")
    admin = sa.create_engine(database.url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    postgresql = database.backend == "postgresql"

    def kill(pid: int) -> None:
        with admin.connect() as conn:
            conn.exec_driver_sql(
                f"SELECT pg_terminate_backend({pid})" if postgresql else f"KILL {pid}"
            )

    async def main() -> tuple[list[int], int]:
        runs: list[int] = []
        most = running = 0

        async def handler(job: sp.AsyncJobContext) -> None:
            nonlocal most, running
            running += 1
            most = max(most, running)
            try:
                runs.append(job.attempts)
                query = "SELECT pg_backend_pid()" if postgresql else "SELECT CONNECTION_ID()"
                pid = (await job.session.execute(sa.text(query))).scalar()
                await asyncio.to_thread(kill, int(pid or 0))
                await asyncio.sleep(0.5)  # the other task polls meanwhile
            finally:
                running -= 1

        options: dict[str, Any] = {"handler_mode": "advanced", "polling_interval": 0.02}
        async with (
            async_engine(async_url) as engine,
            sp.create_async_queue_worker(
                engine, handler, concurrency=2, max_unclean_ends=2, **options
            ),
        ):
            assert await eventually(
                lambda: archived_job(sync_engine, job_id) is not None, timeout=30
            )
        return runs, most

    try:
        runs, most = asyncio.run(main())
    finally:
        admin.dispose()
    row = archived_job(sync_engine, job_id)
    assert row is not None and (row.status, row.attempts) == ("failure", 2)
    assert row.error is not None and "lost its database session while running" in row.error
    assert runs == [1, 1] and most == 1
    assert run_records(sync_engine) == 0
