"""``current_job()``: the running job's context from inside any handler or task, in both
handler modes, both run modes and both workers; outside a job, NoCurrentJobError."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from helpers import archived, enqueue_committed, running, wait_for
from lease_helpers import Base, Note, notes
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

import sqla_proletarian as sp

ASYNC_DRIVERNAME = {
    "sqlite": "sqlite+aiosqlite",
    "postgresql": "postgresql+psycopg",
    "mariadb": "mysql+aiomysql",
}
MODES = {"transaction": {}, "lease": {"lease_seconds": 60.0}}
HANDLER_MODES = ["default", "advanced"]


@pytest.fixture
def engine(database: Any) -> sa.Engine:
    """The test's database, with the notes table handlers write to."""
    engine = database.engine()
    Base.metadata.create_all(engine)
    return engine


def seen_by(handler_mode: str, record: Callable[[], None]) -> Callable[..., None]:
    """A handler of the handler mode that calls ``record`` (which reads current_job())."""
    if handler_mode == "advanced":
        return lambda job: record()
    return lambda job_type, payload: record()


def parallel_runs(engine: sa.Engine, mode: str) -> int:
    """How many of two jobs run at once: SQLite runs one transaction-mode job at a time."""
    return 1 if mode == "transaction" and engine.dialect.name == "sqlite" else 2


def test_outside_a_job_current_job_raises_a_lookup_error_that_says_when_it_works() -> None:
    with pytest.raises(sp.NoCurrentJobError, match="only available while a job runs") as e:
        sp.current_job()
    assert isinstance(e.value, LookupError) and isinstance(e.value, sp.ProletarianError)


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("handler_mode", HANDLER_MODES)
def test_process_next_job_handlers_see_their_job_as_current_job(
    engine: sa.Engine, mode: str, handler_mode: str
) -> None:
    """current_job() is the run's JobContext (the very one an advanced handler gets), also
    in a function the handler calls; afterwards there is no current job again."""
    job_id = enqueue_committed(engine, "report", {"month": 2}, queue="reports")
    seen: list[Any] = []

    def deep() -> Any:
        return sp.current_job()

    def record(*args: Any) -> None:
        seen.append((deep(), args))

    handler: Callable[..., None] = record
    assert sp.process_next_job(
        engine, handler, handler_mode=handler_mode, queue="reports", **MODES[mode]
    )
    [(job, args)] = seen
    assert isinstance(job, sp.JobContext)
    assert (job.job_id, job.job_type, job.payload, job.queue, job.attempts) == (
        job_id,
        "report",
        {"month": 2},
        "reports",
        1,
    )
    if handler_mode == "advanced":
        assert args == (job,)
    with pytest.raises(sp.NoCurrentJobError):
        sp.current_job()


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_default_mode_handlers_writes_through_current_job_session_commit_with_the_job(
    engine: sa.Engine, mode: str
) -> None:
    """A handler of (job_type, payload) reaches the job's session through current_job():
    what it writes there commits with the job's success, and rolls back if it raises."""
    ok = enqueue_committed(engine, "ok")
    bad = enqueue_committed(engine, "bad")

    def handler(job_type: str, payload: Any) -> None:
        session = sp.current_job().session
        assert isinstance(session, Session)
        session.add(Note(text=job_type))
        session.flush()
        if job_type == "bad":
            raise RuntimeError("no")

    while sp.process_next_job(engine, handler, **MODES[mode]):
        pass
    assert notes(engine) == ["ok"]
    assert {(job.job_id, job.status) for job in archived(engine)} == {
        (ok, "success"),
        (bad, "failure"),
    }


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("handler_mode", HANDLER_MODES)
def test_each_worker_thread_sees_its_own_job_as_current_job(
    engine: sa.Engine, mode: str, handler_mode: str
) -> None:
    """Two threads run two jobs at once (each waits until both started): each one's
    current_job() is its own."""
    job_ids = [enqueue_committed(engine, "pair", n) for n in range(2)]
    started = threading.Barrier(parallel_runs(engine, mode), timeout=20)
    seen: dict[uuid.UUID, Any] = {}

    def record() -> None:
        job = sp.current_job()
        started.wait()
        assert sp.current_job() is job
        seen[job.job_id] = job.payload

    worker = sp.create_queue_worker(
        engine,
        seen_by(handler_mode, record),
        handler_mode=handler_mode,
        worker_threads=2,
        polling_interval=0.02,
        **MODES[mode],
    )
    with running(worker):
        assert wait_for(lambda: len(archived(engine)) == 2, timeout=20)
    assert seen == {job_ids[0]: 0, job_ids[1]: 1}


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("handler_mode", HANDLER_MODES)
def test_asyncio_handlers_see_their_job_as_current_job_across_awaits(
    database: Any, engine: sa.Engine, mode: str, handler_mode: str
) -> None:
    """In the asyncio worker current_job() is the run's AsyncJobContext (an advanced
    handler's own), before and after an await, in a coroutine the handler awaits, for two
    jobs running at once (one at a time in SQLite's transaction mode); a plain function
    among the handlers sees it too; what the handler writes through its session commits
    with the job."""
    job_ids = [enqueue_committed(engine, "pair", n) for n in range(2)]
    sync_id = enqueue_committed(engine, "sync", 9, priority=-1)
    seen: dict[uuid.UUID, Any] = {}

    async def main() -> None:
        both = asyncio.Barrier(parallel_runs(engine, mode))

        async def nested() -> Any:
            await asyncio.sleep(0)
            return sp.current_job()

        async def run(*args: Any) -> None:
            job = sp.current_job()
            assert isinstance(job, sp.AsyncJobContext)
            if handler_mode == "advanced":
                assert args == (job,)
            await asyncio.wait_for(both.wait(), 20)
            assert sp.current_job() is job and await nested() is job
            assert isinstance(job.session, AsyncSession)
            job.session.add(Note(text=f"run {job.payload}"))
            seen[job.job_id] = job.payload

        def plain(*args: Any) -> None:
            job = sp.current_job()
            assert isinstance(job, sp.AsyncJobContext)
            seen[job.job_id] = job.payload

        handler = sp.JobHandlers()
        handler.register("pair")(run)
        handler.register("sync")(plain)

        url = database.url.set(drivername=ASYNC_DRIVERNAME[database.backend])
        async_engine = create_async_engine(url)
        try:
            async with sp.create_async_queue_worker(
                async_engine,
                handler,
                handler_mode=handler_mode,
                concurrency=2,
                polling_interval=0.02,
                **MODES[mode],
            ):
                deadline = time.monotonic() + 20
                while len(await asyncio.to_thread(archived, engine)) < 3:
                    assert time.monotonic() < deadline, "the jobs did not run in time"
                    await asyncio.sleep(0.02)
        finally:
            await async_engine.dispose()
        with pytest.raises(sp.NoCurrentJobError):
            sp.current_job()

    asyncio.run(main())
    assert seen == {job_ids[0]: 0, job_ids[1]: 1, sync_id: 9}
    assert notes(engine) == ["run 0", "run 1"]
    assert {job.status for job in archived(engine)} == {"success"}
