"""Lease mode in the asyncio worker (aiosqlite, psycopg's async side, aiomysql): handlers run
with no transaction or connection of the worker's, their AsyncSession writes commit with the
completion, cancel_job cancels the handler's task, and a stop past its timeout releases
the lease for another worker at once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import sqlalchemy as sa
from helpers import archived, archived_job, count, enqueue_committed, events, jobs
from lease_helpers import Base, Note, held_by_others, job_row, notes
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import Session

import sqla_proletarian as sp

#: The async driver of each backend's URL.
ASYNC_DRIVERNAME = {
    "sqlite": "sqlite+aiosqlite",
    "postgresql": "postgresql+psycopg",
    "mariadb": "mysql+aiomysql",
}
LONG_LEASE = {"lease_seconds": 60.0, "polling_interval": 0.02}


@pytest.fixture
def engine(database: Any) -> sa.Engine:
    """A sync engine on the test's database (with the notes table), for setting up and
    reading back from a thread."""
    engine = database.engine()
    Base.metadata.create_all(engine)
    return engine


@pytest.fixture
def async_url(database: Any) -> URL:
    return database.url.set(drivername=ASYNC_DRIVERNAME[database.backend])


@contextlib.asynccontextmanager
async def async_engine(url: URL) -> AsyncIterator[AsyncEngine]:
    engine = create_async_engine(url)
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


def test_leased_async_handlers_run_with_no_transaction_row_lock_or_connection_checked_out(
    database: Any, engine: sa.Engine, async_url: URL
) -> None:
    """Four tasks run four long jobs: no session of the worker is in a transaction, the
    jobs' rows can be locked at once, and the worker's pool has no connection checked out."""
    job_ids = [enqueue_committed(engine, "long", n) for n in range(4)]

    async def main() -> tuple[list[str], int]:
        started: list[uuid.UUID] = []
        release = asyncio.Event()

        async def handler(job: sp.AsyncJobContext) -> None:
            started.append(job.job_id)
            await asyncio.wait_for(release.wait(), 10)

        async with async_engine(async_url) as worker_engine:
            worker = sp.create_async_queue_worker(
                worker_engine, handler, handler_mode="advanced", concurrency=4, **LONG_LEASE
            )
            async with worker:
                try:
                    assert await eventually(lambda: len(started) == 4), started
                    held = await asyncio.to_thread(
                        held_by_others, database.backend, engine, job_ids
                    )
                    checked_out = worker_engine.sync_engine.pool.checkedout()
                finally:
                    release.set()
                assert await eventually(lambda: count(engine, sp.ArchivedJob) == 4)
        return held, checked_out

    held, checked_out = asyncio.run(main())
    assert held == []
    assert checked_out == 0
    assert {row.status for row in archived(engine)} == {"success"}


#: Each way an async handler writes through ``job.session``.
IDIOMS = ("add", "add-commit", "flush", "execute", "nested", "connection-execute", "get")
SEEDED = {"keeps": 1001, "raises": 1002}


async def write_note(session: AsyncSession, idiom: str, payload: str) -> None:
    text = f"{idiom} {payload}"
    if idiom == "add":
        session.add(Note(text=text))
    elif idiom == "add-commit":
        session.add(Note(text=text))
        await session.commit()
    elif idiom == "flush":
        session.add(Note(text=text))
        await session.flush()
    elif idiom == "execute":
        await session.execute(sa.insert(Note).values(text=text))
    elif idiom == "nested":
        async with session.begin_nested():
            session.add(Note(text=text))
    elif idiom == "connection-execute":
        await (await session.connection()).execute(sa.insert(Note).values(text=text))
    else:
        note = await session.get(Note, SEEDED[payload])
        assert note is not None
        note.text = text


def test_async_job_session_writes_in_every_idiom_commit_with_the_completion_or_not_at_all(
    engine: sa.Engine, async_url: URL
) -> None:
    with Session(engine) as session:
        session.add_all([Note(id=i, text="seed") for i in SEEDED.values()])
        for idiom in IDIOMS:
            sp.enqueue_many(session, [(idiom, "keeps"), (idiom, "raises")])
        session.commit()

    leased: list[bool] = []

    async def handler(job: sp.AsyncJobContext) -> None:
        assert isinstance(job.session, AsyncSession)
        row = await asyncio.to_thread(job_row, engine, job.job_id)
        leased.append(row.lease_token is not None)
        await write_note(job.session, job.job_type, job.payload)
        if job.payload == "raises":
            raise RuntimeError("after writing")

    async def main() -> None:
        async with (
            async_engine(async_url) as worker_engine,
            sp.create_async_queue_worker(
                worker_engine, handler, handler_mode="advanced", **LONG_LEASE
            ),
        ):
            assert await eventually(lambda: count(engine, sp.ArchivedJob) == 2 * len(IDIOMS))

    asyncio.run(main())
    assert leased == [True] * 2 * len(IDIOMS), "each job ran under a lease"
    assert notes(engine) == sorted([*(f"{idiom} keeps" for idiom in IDIOMS), "seed"])
    outcomes = {(a.job_type, a.status) for a in archived(engine)}
    assert outcomes == {(i, s) for i in IDIOMS for s in ("success", "failure")}
    assert jobs(engine) == []


def test_cancel_job_on_a_running_async_leased_job_cancels_its_task_and_rolls_back(
    database: Any, engine: sa.Engine, async_url: URL, caplog: pytest.LogCaptureFixture
) -> None:
    """cancel_job returns True; the handler's task is cancelled (its cancel_requested set),
    the job is archived as cancelled and its session's writes (on the servers, made before
    it waited: on SQLite they would hold the write lock) roll back. The worker logs the
    cancel, not a lost lease."""
    caplog.set_level(logging.INFO, logger="sqla_proletarian")
    job_id = enqueue_committed(engine, "cancel-me")

    async def main() -> list[str]:
        started = asyncio.Event()
        seen: list[str] = []

        async def handler(job: sp.AsyncJobContext) -> None:
            if database.backend != "sqlite":
                job.session.add(Note(text="before the cancel"))
                await job.session.flush()
            started.set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                seen.append(f"cancelled, cancel_requested={job.cancel_requested.is_set()}")
                raise
            seen.append("slept on")

        def cancel() -> bool:
            with engine.begin() as conn:
                return sp.cancel_job(conn, job_id)

        async with (
            async_engine(async_url) as worker_engine,
            sp.create_async_queue_worker(
                worker_engine,
                handler,
                handler_mode="advanced",
                lease_seconds=2.0,
                heartbeat_interval=0.1,
                polling_interval=0.02,
            ),
        ):
            await asyncio.wait_for(started.wait(), 10)
            assert await asyncio.to_thread(cancel) is True
            assert await eventually(lambda: archived_job(engine, job_id) is not None)
            assert await eventually(lambda: bool(seen))
        return seen

    seen = asyncio.run(main())
    assert seen == ["cancelled, cancel_requested=True"]
    done = archived_job(engine, job_id)
    assert done is not None and done.status == "cancelled"
    assert notes(engine) == []
    assert jobs(engine) == []
    assert [r.job_id for r in events(caplog.records, "job-cancelled")] == [job_id]
    assert events(caplog.records, "lease-lost") == [], "a cancel is no lost lease"


def test_async_stop_past_its_timeout_releases_the_lease_for_another_worker_at_once(
    database: Any, engine: sa.Engine, async_url: URL
) -> None:
    """stop() cancels the stuck handler's task and releases its lease at once (no token,
    process_at back to the due time, no unclean end), although the handler had written
    through its session (on SQLite holding the write lock): a second worker runs the job
    now, not after the 60 s lease, and only the second run's write commits."""
    job_id = enqueue_committed(engine, "stuck")
    due = job_row(engine, job_id).process_at

    async def main() -> tuple[Any, Any]:
        started = asyncio.Event()
        runs: list[int] = []

        async def handler(job: sp.AsyncJobContext) -> None:
            runs.append(job.attempts)
            if len(runs) == 1:
                job.session.add(Note(text="stuck run"))
                await job.session.flush()
                started.set()
                await asyncio.sleep(60)
            job.session.add(Note(text="second run"))

        async with async_engine(async_url) as worker_engine:
            worker = sp.create_async_queue_worker(
                worker_engine,
                handler,
                handler_mode="advanced",
                await_termination_timeout=0.2,
                **LONG_LEASE,
            )
            await worker.start()
            await asyncio.wait_for(started.wait(), 10)
            leased = await asyncio.to_thread(job_row, engine, job_id)
            await worker.stop()
            released = await asyncio.to_thread(job_row, engine, job_id)
            async with sp.create_async_queue_worker(
                worker_engine, handler, handler_mode="advanced", **LONG_LEASE
            ):
                assert await eventually(lambda: archived_job(engine, job_id) is not None, 5)
        return leased, released

    leased, released = asyncio.run(main())
    assert leased.lease_token is not None, "the job ran under a lease"
    assert released.lease_token is None
    assert released.process_at == due
    assert released.unclean_ends == 0
    assert notes(engine) == ["second run"]
    [done] = archived(engine)
    assert (done.job_id, done.status) == (job_id, "success")


def test_create_async_queue_worker_refuses_job_timeout_without_lease_seconds(
    async_url: URL,
) -> None:
    async def main() -> None:
        async with async_engine(async_url) as worker_engine:
            with pytest.raises(sp.ConfigurationError, match="lease_seconds") as refused:
                sp.create_async_queue_worker(worker_engine, lambda job: None, job_timeout=5.0)
            assert "unknown" not in str(refused.value)

    asyncio.run(main())


def test_job_timeout_cancels_an_async_handlers_task_and_retries_then_fails_the_job(
    engine: sa.Engine, async_url: URL
) -> None:
    """Past job_timeout the handler's task is cancelled; the run fails with JobTimeoutError,
    is retried once as the strategy says, then reaches the failed-job handler."""
    job_id = enqueue_committed(engine, "slow")

    async def main() -> tuple[list[int], list[Exception]]:
        cancelled: list[int] = []
        failed: list[Exception] = []

        async def handler(job: sp.AsyncJobContext) -> None:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.append(job.attempts)
                raise

        async with (
            async_engine(async_url) as worker_engine,
            sp.create_async_queue_worker(
                worker_engine,
                handler,
                handler_mode="advanced",
                lease_seconds=2.0,
                heartbeat_interval=0.1,
                job_timeout=0.3,
                polling_interval=0.02,
                retry_strategy=lambda job, exc: sp.RetryStrategy(retries=1, delays=[0]),
                failed_job_handler=lambda job, exc: failed.append(exc),
            ),
        ):
            assert await eventually(lambda: archived_job(engine, job_id) is not None)
            assert await eventually(lambda: len(cancelled) == 2)
        return cancelled, failed

    cancelled, failed = asyncio.run(main())
    assert cancelled == [1, 2]
    [exc] = failed
    assert isinstance(exc, sp.JobTimeoutError) and "timed out" in str(exc)
    done = archived_job(engine, job_id)
    assert done is not None and (done.status, done.attempts) == ("failure", 2)
    assert jobs(engine) == []
