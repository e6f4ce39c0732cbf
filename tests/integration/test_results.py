"""Results on every backend and in both modes: a handler's return value is stored with its
archived job (None stores nothing, and costs no statement), a result that cannot be stored
fails the job, a job archived again keeps no earlier result, ``get_result`` tells a result
from a job not ended, failed or unknown, ``wait_for_result`` (LISTEN on PostgreSQL, polling
elsewhere) and its asyncio twin wait for the end, and ``job.dependency_results`` reads the
results of a job's dependencies."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import date
from decimal import Decimal
from typing import Any

import pytest
import sqlalchemy as sa
from helpers import archived_job, enqueue_committed, running, wait_for
from lease_helpers import Base, Note, notes
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.orm import Session, scoped_session, sessionmaker

import sqla_proletarian as sp
from sqla_proletarian import results, workflows
from sqla_proletarian.models import WAITING_AT, Dependency
from sqla_proletarian.testing import drain

#: The two modes: transaction mode, and lease mode with a lease no test outlives.
MODES = {"transaction": {}, "lease": {"lease_seconds": 60.0}}
EVERY_MODE = pytest.mark.parametrize("mode", list(MODES))
ARCHIVE = sp.ArchivedJob.__table__
WAITS = Dependency.__table__
#: An async driver of each backend, and the drivername prefix of its URLs.
ASYNC_DRIVER = {"sqlite": "aiosqlite", "postgresql": "asyncpg", "mariadb": "aiomysql"}
PREFIX = {"sqlite": "sqlite", "postgresql": "postgresql", "mariadb": "mysql"}
#: A result with every kind of value the JSON serializer keeps.
RICH = {
    "sum": 3,
    "items": [1, "two", None, True, 2.5],
    "when": date(2040, 2, 29),
    "id": uuid.UUID(int=7),
    "price": Decimal("1.10"),
}


@pytest.fixture
def engine(database: Any) -> sa.Engine:
    """An engine on a fresh database with the library's tables and the notes table."""
    engine = database.engine()
    Base.metadata.create_all(engine)
    return engine


def stored(engine: sa.Engine, job_id: uuid.UUID) -> str | None:
    """The archive's result column of a job, as stored."""
    with engine.connect() as conn:
        return conn.execute(  # type: ignore[no-any-return]
            sa.select(ARCHIVE.c.result).where(ARCHIVE.c.job_id == job_id)
        ).scalar_one()


def result_of(engine: sa.Engine, job_id: uuid.UUID) -> Any:
    with Session(engine) as session:
        return sp.get_result(session, job_id)


def waits(engine: sa.Engine) -> int:
    """The wait rows of ``wait_for_result`` callers."""
    with engine.connect() as conn:
        query = sa.select(sa.func.count()).where(WAITS.c.kind == workflows.WAIT_KIND)
        return int(conn.execute(query).scalar_one())


def archive_updates(engine: sa.Engine) -> list[str]:
    """Starts recording the UPDATE statements on the archive that ``engine`` runs."""
    seen: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        text = " ".join(statement.split()).lower()
        if text.startswith("update") and "proletarian_archived_job" in text.split(" set ")[0]:
            seen.append(text)

    sa.event.listen(engine, "before_cursor_execute", record)
    return seen


# --- storing ---------------------------------------------------------------------------------


@EVERY_MODE
@pytest.mark.parametrize("kind", ["default", "advanced", "task"])
def test_a_handlers_return_value_is_stored_with_its_archived_job(
    engine: sa.Engine, mode: str, kind: str
) -> None:
    """What the handler returns (a plain function of (job_type, payload), an advanced one of
    the job, or a task) is stored, serialized, with the archived job and read back equal."""
    handlers = sp.JobHandlers()

    @handlers.task
    def total(a: int, b: int) -> dict[str, Any]:
        return {**RICH, "sum": a + b}

    def plain(job_type: str, payload: Any) -> dict[str, Any]:
        return {**RICH, "sum": payload["a"] + payload["b"]}

    def advanced(job: sp.JobContext) -> dict[str, Any]:
        return {**RICH, "sum": job.payload["a"] + job.payload["b"]}

    if kind == "task":
        with Session(engine) as session:
            job_id = total.enqueue(session, 1, 2)
            session.commit()
        handler: Any = handlers
    else:
        job_id = enqueue_committed(engine, "total", {"a": 1, "b": 2})
        handler = plain if kind == "default" else advanced
    handler_mode = "advanced" if kind == "advanced" else "default"
    assert sp.process_next_job(engine, handler, handler_mode=handler_mode, **MODES[mode])
    archived = archived_job(engine, job_id)
    assert archived is not None and archived.status == "success"
    assert archived.result is not None
    assert result_of(engine, job_id) == RICH


@EVERY_MODE
def test_a_batch_stores_each_result_and_none_stores_nothing_nor_costs_a_statement(
    engine: sa.Engine, backend: str, mode: str
) -> None:
    """A batch of jobs completed together stores each job's own result with at most one
    UPDATE of the archive; a batch whose handlers all returned None runs no UPDATE of the
    archive and stores NULL."""
    if backend == "sqlite" and mode == "transaction":
        pytest.skip("SQLite claims one job at a time in transaction mode")
    updates = archive_updates(engine)
    quiet = [enqueue_committed(engine, "quiet", n) for n in range(3)]
    assert drain(engine, lambda t, p: None, batch_size=3, **MODES[mode]) == 3
    assert updates == []
    assert [stored(engine, job_id) for job_id in quiet] == [None, None, None]
    assert [result_of(engine, job_id) for job_id in quiet] == [None, None, None]

    loud = [enqueue_committed(engine, "loud", n) for n in range(3)]
    drain(engine, lambda t, p: None if p == 1 else {"n": p}, batch_size=3, **MODES[mode])
    assert [result_of(engine, job_id) for job_id in loud] == [{"n": 0}, None, {"n": 2}]
    assert stored(engine, loud[1]) is None
    # One UPDATE after the batch's archive insert where the archive rows are copied from
    # the queue rows (transaction mode; lease mode's grouped ends on MariaDB); none where
    # each archive row is written with its result (lease mode's grouped ends on PostgreSQL,
    # SQLite's leases).
    assert len(updates) <= 1


@EVERY_MODE
def test_a_single_job_that_returns_none_runs_no_update_of_the_archive(
    engine: sa.Engine, mode: str
) -> None:
    updates = archive_updates(engine)
    job_id = enqueue_committed(engine, "quiet")
    assert sp.process_next_job(engine, lambda t, p: None, **MODES[mode])
    assert updates == []
    assert archived_job(engine, job_id).status == "success"  # type: ignore[union-attr]
    assert stored(engine, job_id) is None


@EVERY_MODE
@pytest.mark.parametrize(
    ("returned", "wanted"),
    [
        ("x" * 300, "max_result_bytes (256)"),
        ({1, 2}, "the value is a set, which cannot be stored as JSON"),
    ],
    ids=["too-large", "unserializable"],
)
def test_a_result_that_cannot_be_stored_fails_the_job_and_rolls_back_its_writes(
    engine: sa.Engine, mode: str, returned: Any, wanted: str
) -> None:
    """A result longer than max_result_bytes, or one the serializer refuses, fails the job
    as a handler exception would (retry strategy asked, error archived, failed-job handler
    called) with an error that says what to do; what the handler wrote through job.session
    rolls back."""
    job_id = enqueue_committed(engine, "returns")
    asked: list[Exception] = []
    failed: list[Exception] = []

    def handler(job: sp.JobContext) -> Any:
        job.session.add(Note(text="written"))
        job.session.flush()
        return returned

    def retry(job: sp.JobContext, exc: Exception) -> None:
        asked.append(exc)

    assert sp.process_next_job(
        engine,
        handler,
        handler_mode="advanced",
        max_result_bytes=256,
        retry_strategy=retry,
        failed_job_handler=lambda job, exc: failed.append(exc),
        **MODES[mode],
    )
    archived = archived_job(engine, job_id)
    assert archived is not None and archived.status == "failure"
    assert archived.result is None
    assert wanted in (archived.error or "")
    assert isinstance(asked[0], sp.ResultSerializationError)
    assert failed == asked
    if isinstance(returned, str):
        assert isinstance(asked[0], sp.ResultTooLargeError)
        assert (asked[0].size, asked[0].limit) == (302, 256)
        assert "return its key" in str(asked[0])
    assert notes(engine) == []
    with pytest.raises(sp.JobFailedError) as raised:
        result_of(engine, job_id)
    assert raised.value.status == "failure"


def test_max_result_bytes_is_checked_and_can_be_turned_off(engine: sa.Engine) -> None:
    for bad in (0, -1, 1.5, "1MiB", True):
        with pytest.raises(sp.ConfigurationError, match="max_result_bytes"):
            sp.WorkerOptions(max_result_bytes=bad)  # type: ignore[arg-type]
    assert sp.WorkerOptions().max_result_bytes == 1024 * 1024
    job_id = enqueue_committed(engine, "big")
    big = "y" * (1024 * 1024 + 10)
    assert sp.process_next_job(engine, lambda t, p: big, max_result_bytes=None)
    assert result_of(engine, job_id) == big


@EVERY_MODE
@pytest.mark.parametrize("batch_size", [1, 2])
def test_a_job_archived_again_keeps_no_earlier_result(
    engine: sa.Engine, backend: str, mode: str, batch_size: int
) -> None:
    """A job id archived with a result, enqueued again and ended with None (or failed),
    reads back None (or the failure), not the earlier result: the archive's upsert replaces
    the result too (the single-row archive and the batch's archive from the queue rows).
    While it is back in the queue it has no result; a failure put back by retry_failed
    that then succeeds has its new result."""
    job_id = enqueue_committed(engine, "again", 1)
    options = {**MODES[mode], "batch_size": batch_size}
    drain(engine, lambda t, p: {"first": p}, **options)
    assert result_of(engine, job_id) == {"first": 1}
    enqueue_committed(engine, "again", 2, job_id=job_id)
    with pytest.raises(sp.ResultNotReady):
        result_of(engine, job_id)  # not the archive's earlier result
    enqueue_committed(engine, "other", 3)  # a batch of two where the backend claims two
    drain(engine, lambda t, p: None, **options)
    assert stored(engine, job_id) is None
    assert result_of(engine, job_id) is None
    enqueue_committed(engine, "again", 4, job_id=job_id)
    drain(engine, lambda t, p: {"third": p}, **options)
    assert result_of(engine, job_id) == {"third": 4}

    def fail(job_type: str, payload: Any) -> Any:
        raise RuntimeError("no result this time")

    enqueue_committed(engine, "again", 5, job_id=job_id)
    drain(engine, fail, **options)
    assert stored(engine, job_id) is None
    with pytest.raises(sp.JobFailedError, match="no result this time"):
        result_of(engine, job_id)
    assert sp.retry_failed(engine, [job_id]) == 1
    with pytest.raises(sp.ResultNotReady):
        result_of(engine, job_id)
    drain(engine, lambda t, p: {"last": p}, **options)
    assert result_of(engine, job_id) == {"last": 5}


# --- get_result -----------------------------------------------------------------------------


def test_get_result_tells_a_job_not_ended_from_a_failed_cancelled_or_unknown_one(
    engine: sa.Engine,
) -> None:
    """Queued and waiting jobs raise ResultNotReady naming their state; a failed one
    JobFailedError with the archive's status and error; a cancelled one JobFailedError with
    status "cancelled"; an unknown id JobNotFoundError, a LookupError. Session, scoped_session
    and Connection all work, and nothing is committed."""
    queued = enqueue_committed(engine, "later", queue="later")
    with Session(engine) as session:
        with pytest.raises(sp.ResultNotReady, match="it is queued") as not_ready:
            sp.get_result(session, queued)
        assert (not_ready.value.job_id, not_ready.value.status) == (queued, "queued")
        assert not session.new and not session.dirty
    waiting = enqueue_committed(engine, "waits", queue="later")
    with engine.begin() as conn:  # as enqueue's depends_on writes a job that waits
        table = sp.Job.__table__
        waits_for_one = {"waiting_on": 1, "process_at": WAITING_AT}
        conn.execute(sa.update(table).where(table.c.job_id == waiting).values(waits_for_one))
    with engine.connect() as conn:
        with pytest.raises(sp.ResultNotReady, match="waiting for its dependencies"):
            sp.get_result(conn, waiting)
        with pytest.raises(sp.ResultNotReady):
            sp.get_result(conn, str(queued))  # a job id's text works too

    failing = enqueue_committed(engine, "fails")

    def handler(job_type: str, payload: Any) -> None:
        raise ValueError("bad input 42")

    assert sp.process_next_job(engine, handler)
    scoped = scoped_session(sessionmaker(engine))
    try:
        with pytest.raises(sp.JobFailedError) as failed:
            sp.get_result(scoped, failing)
        assert failed.value.status == "failure"
        assert failed.value.job_id == failing
        assert "ValueError: bad input 42" in (failed.value.error or "")
        assert "bad input 42" in str(failed.value)
    finally:
        scoped.remove()

    cancelled = enqueue_committed(engine, "cancelled")
    with Session(engine) as session:
        sp.cancel_job(session, cancelled)
        session.commit()
    with Session(engine) as session, pytest.raises(sp.JobFailedError) as ended:
        sp.get_result(session, cancelled)
    assert ended.value.status == "cancelled"

    unknown = uuid.uuid4()
    with Session(engine) as session, pytest.raises(LookupError) as missing:
        sp.get_result(session, unknown)
    assert isinstance(missing.value, sp.JobNotFoundError)
    assert str(unknown) in str(missing.value)
    with Session(engine) as session, pytest.raises(sp.ConfigurationError, match="not a job id"):
        sp.get_result(session, "not-a-uuid")


def test_get_result_says_running_while_a_leased_job_runs(engine: sa.Engine) -> None:
    job_id = enqueue_committed(engine, "long")
    seen: list[BaseException] = []

    def handler(job_type: str, payload: Any) -> int:
        with Session(engine) as session:
            try:
                sp.get_result(session, job_id)
            except sp.ResultNotReady as exc:
                seen.append(exc)
        return 5

    assert sp.process_next_job(engine, handler, **MODES["lease"])
    assert len(seen) == 1 and seen[0].status == "running"  # type: ignore[attr-defined]
    assert result_of(engine, job_id) == 5


# --- waiting ---------------------------------------------------------------------------------


@contextlib.contextmanager
def worker_of(database: Any, handler: Any, mode: str) -> Iterator[sp.QueueWorker]:
    worker = sp.create_queue_worker(
        database.engine(), handler, polling_interval=0.05, **MODES[mode]
    )
    with running(worker):
        yield worker


@EVERY_MODE
def test_wait_for_result_returns_once_a_worker_has_run_the_job(
    database: Any, engine: sa.Engine, mode: str
) -> None:
    """wait_for_result blocks until a running worker has ended the job, then returns its
    result; on PostgreSQL it has a wait row while it waits (the job's end is announced to
    it), removed when it returns."""
    job_id = enqueue_committed(engine, "slow", 21)
    release = threading.Event()
    waiting: list[int] = []

    def handler(job_type: str, payload: Any) -> int:
        release.wait(10)
        return int(payload) * 2

    with worker_of(database, handler, mode):
        result: list[Any] = []
        waiter = threading.Thread(
            target=lambda: result.append(sp.wait_for_result(engine, job_id, timeout=30))
        )
        waiter.start()
        if database.backend == "postgresql":
            assert wait_for(lambda: waits(engine) == 1)
        waiting.append(len(result))
        release.set()
        waiter.join(30)
    assert waiting == [0]
    assert result == [42]
    assert waits(engine) == 0


@EVERY_MODE
def test_wait_for_result_raises_the_failure_of_a_failed_job(
    database: Any, engine: sa.Engine, mode: str
) -> None:
    job_id = enqueue_committed(engine, "fails")

    def handler(job_type: str, payload: Any) -> None:
        raise KeyError("missing thing")

    with worker_of(database, handler, mode), pytest.raises(sp.JobFailedError) as failed:
        sp.wait_for_result(engine, job_id, timeout=30)
    assert failed.value.status == "failure"
    assert "missing thing" in (failed.value.error or "")
    assert waits(engine) == 0


def test_wait_for_result_times_out_and_removes_its_wait_row(engine: sa.Engine) -> None:
    """No worker runs the job: TimeoutError after the timeout (not much later), and no wait
    row is left. An unknown id raises JobNotFoundError at once."""
    job_id = enqueue_committed(engine, "never")
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"did not end within 0\.3 s"):
        sp.wait_for_result(engine, job_id, timeout=0.3)
    took = time.monotonic() - started
    assert 0.3 <= took < 10
    assert waits(engine) == 0
    with pytest.raises(sp.JobNotFoundError):
        sp.wait_for_result(engine, uuid.uuid4(), timeout=5)
    assert waits(engine) == 0
    with pytest.raises(sp.ConfigurationError, match="timeout"):
        sp.wait_for_result(engine, job_id, timeout=-1)


def test_wait_for_result_of_an_ended_job_returns_at_once(engine: sa.Engine) -> None:
    job_id = enqueue_committed(engine, "done")
    sp.process_next_job(engine, lambda t, p: "done")
    assert sp.wait_for_result(engine, job_id, timeout=0) == "done"


@EVERY_MODE
def test_on_postgresql_the_jobs_end_wakes_wait_for_result_at_once(
    database: Any, engine: sa.Engine, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the safety net's re-check a minute apart, a waiter still returns as soon as the
    worker ends the job: the end deletes the wait row and NOTIFYs its id. (Polling, on the
    other backends, needs no notification.)"""
    if database.backend != "postgresql":
        pytest.skip("LISTEN/NOTIFY is PostgreSQL's")
    monkeypatch.setattr(results, "RECHECK_INTERVAL", 60.0)
    job_id = enqueue_committed(engine, "slow", 1)
    release = threading.Event()

    def handler(job_type: str, payload: Any) -> str:
        release.wait(10)
        return "woken"

    with worker_of(database, handler, mode):
        got: list[Any] = []
        waiter = threading.Thread(
            target=lambda: got.append(sp.wait_for_result(engine, job_id, timeout=40))
        )
        waiter.start()
        assert wait_for(lambda: waits(engine) == 1)  # listening, and checked once
        released = time.monotonic()
        release.set()
        waiter.join(50)
        took = time.monotonic() - released
    assert got == ["woken"]
    # Without the notification it would have returned at its timeout's end (40 s).
    assert took < 20
    assert waits(engine) == 0


# --- asyncio -------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def async_engine(database: Any) -> AsyncIterator[AsyncEngine]:
    url: URL = database.url.set(
        drivername=f"{PREFIX[database.backend]}+{ASYNC_DRIVER[database.backend]}"
    )
    engine = create_async_engine(url)
    try:
        yield engine
    finally:
        await engine.dispose()


@EVERY_MODE
def test_the_asyncio_worker_stores_an_async_handlers_result_and_wait_for_result_async_gets_it(
    database: Any, engine: sa.Engine, mode: str
) -> None:
    """An ``async def`` handler's awaited value is the result (default and advanced mode);
    wait_for_result_async waits for it without blocking the loop, and times out."""
    plain_id = enqueue_committed(engine, "plain", 2)
    advanced_id = enqueue_committed(engine, "advanced", 3, queue="jobs")
    never = enqueue_committed(engine, "never", queue="nobody")

    async def plain(job_type: str, payload: Any) -> dict[str, Any]:
        await asyncio.sleep(0.01)
        return {"square": payload * payload}

    async def advanced(job: sp.AsyncJobContext) -> list[int]:
        await asyncio.sleep(0.01)
        return [job.payload] * 2

    async def main() -> tuple[Any, Any, float]:
        async with async_engine(database) as aengine:
            workers = [
                sp.create_async_queue_worker(aengine, plain, polling_interval=0.05, **MODES[mode]),
                sp.create_async_queue_worker(
                    aengine,
                    advanced,
                    queue="jobs",
                    handler_mode="advanced",
                    polling_interval=0.05,
                    **MODES[mode],
                ),
            ]
            for worker in workers:
                await worker.start()
            try:
                first = await sp.wait_for_result_async(aengine, plain_id, timeout=30)
                second = await sp.wait_for_result_async(aengine, advanced_id, timeout=30)
                started = time.monotonic()
                with pytest.raises(TimeoutError):
                    await sp.wait_for_result_async(aengine, never, timeout=0.3)
                return first, second, time.monotonic() - started
            finally:
                for worker in workers:
                    await worker.stop()

    first, second, took = asyncio.run(main())
    assert first == {"square": 4}
    assert second == [3, 3]
    assert 0.3 <= took < 10
    assert waits(engine) == 0


@pytest.mark.parametrize("driver", ["asyncpg", "psycopg"])
def test_on_postgresql_the_jobs_end_wakes_wait_for_result_async_at_once(
    database: Any, engine: sa.Engine, driver: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """wait_for_result_async LISTENs through asyncpg and psycopg's async side: with the
    re-check a minute apart, the job's end (run here by the threaded worker) still wakes it
    at once, and its wait row is gone."""
    if database.backend != "postgresql":
        pytest.skip("LISTEN/NOTIFY is PostgreSQL's")
    monkeypatch.setattr(results, "RECHECK_INTERVAL", 60.0)
    job_id = enqueue_committed(engine, "slow")
    release = threading.Event()

    def handler(job_type: str, payload: Any) -> str:
        release.wait(10)
        return "woken"

    async def main() -> tuple[Any, float]:
        url = database.url.set(drivername=f"postgresql+{driver}")
        aengine = create_async_engine(url)
        try:
            waiter = asyncio.create_task(sp.wait_for_result_async(aengine, job_id, timeout=40))
            while await asyncio.to_thread(waits, engine) != 1:
                await asyncio.sleep(0.02)
            released = time.monotonic()
            release.set()
            got = await waiter
            return got, time.monotonic() - released
        finally:
            await aengine.dispose()

    with worker_of(database, handler, "transaction"):
        got, took = asyncio.run(main())
    assert got == "woken"
    assert took < 20  # without the notification: the timeout's end, 40 s
    assert waits(engine) == 0


def test_wait_for_result_async_raises_the_failure_and_the_unknown(
    database: Any, engine: sa.Engine
) -> None:
    failing = enqueue_committed(engine, "fails")
    sp.process_next_job(engine, lambda t, p: {1})  # unserializable: fails

    async def main() -> None:
        async with async_engine(database) as aengine:
            with pytest.raises(sp.JobFailedError) as failed:
                await sp.wait_for_result_async(aengine, failing, timeout=5)
            assert failed.value.status == "failure"
            with pytest.raises(sp.JobNotFoundError):
                await sp.wait_for_result_async(aengine, uuid.uuid4(), timeout=5)

    asyncio.run(main())
    assert waits(engine) == 0


# --- dependency_results ----------------------------------------------------------------------


def add_wait(engine: sa.Engine, job_id: uuid.UUID) -> None:
    """A wait_for_result caller's row on ``job_id``: no dependency of anything."""
    with engine.begin() as conn:
        wait = {"job_id": uuid.uuid4(), "depends_on": job_id, "kind": workflows.WAIT_KIND}
        conn.execute(sa.insert(WAITS), {**wait, "pending": True})


@EVERY_MODE
@pytest.mark.parametrize("kind", ["advanced", "current_job", "task"])
def test_dependency_results_maps_each_dependency_to_its_result(
    engine: sa.Engine, mode: str, kind: str
) -> None:
    """job.dependency_results of a job enqueued with depends_on (and
    on_dependency_failure="run"): each dependency's id with its result, None for one that
    returned None or failed; read through the JobContext of an advanced handler, or
    current_job() in a default-mode handler or a task. A waiter's row is no dependency, and
    a job without dependencies sees {}."""
    handlers = sp.JobHandlers()
    seen: list[tuple[str, dict[uuid.UUID, Any]]] = []

    @handlers.task
    def downstream(name: str) -> None:
        seen.append((name, sp.current_job().dependency_results))

    def upstream(job_type: str, payload: Any) -> Any:
        if job_type == "failing":
            raise RuntimeError("no")
        if job_type == downstream.job_type:
            name = payload["args"][0] if kind == "task" else payload
            seen.append((name, sp.current_job().dependency_results))
            return None
        return None if job_type == "second" else {"from": payload}

    with Session(engine) as session:
        first = sp.enqueue(session, "first", 1)
        second = sp.enqueue(session, "second", 2)
        failing = sp.enqueue(session, "failing", 3)
        deps = {"depends_on": [first, second, failing], "on_dependency_failure": "run"}
        payloads = ({"args": [n], "kwargs": {}} for n in ("joined", "alone"))
        if kind != "task":
            payloads = iter(("joined", "alone"))
        joined = sp.enqueue(session, downstream.job_type, next(payloads), **deps)
        sp.enqueue(session, downstream.job_type, next(payloads))
        session.commit()
    add_wait(engine, first)

    def advanced(job: sp.JobContext) -> Any:
        if job.job_type == downstream.job_type:
            seen.append((job.payload, job.dependency_results))
            return None
        return upstream(job.job_type, job.payload)

    for name in ("first", "second", "failing"):
        handlers.register(name)(upstream)
    handler: Any = {"advanced": advanced, "current_job": upstream, "task": handlers}[kind]
    handler_mode = "advanced" if kind == "advanced" else "default"
    assert drain(engine, handler, handler_mode=handler_mode, **MODES[mode]) == 5
    assert dict(seen) == {"joined": {first: {"from": 1}, second: None, failing: None}, "alone": {}}
    assert result_of(engine, joined) is None


def test_reading_dependency_results_opens_no_savepoint_for_the_handler(
    engine: sa.Engine,
) -> None:
    """Transaction mode reads them on the job's own connection as the worker's read: a
    handler that only reads them costs no savepoint; one that then writes still has its
    writes kept with the job."""
    with Session(engine) as session:
        first = sp.enqueue(session, "first", 1)
        session.commit()
    sp.process_next_job(engine, lambda t, p: {"from": p})
    with Session(engine) as session:
        reader = sp.enqueue(session, "reader", depends_on=[first])
        writer = sp.enqueue(session, "writer", depends_on=[first])
        session.commit()
    savepoints: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.lstrip().upper().startswith("SAVEPOINT"):
            savepoints.append(statement)

    sa.event.listen(engine, "before_cursor_execute", record)
    seen: list[Any] = []

    def handler(job: sp.JobContext) -> None:
        seen.append(job.dependency_results)
        if job.job_type == "writer":
            job.session.add(Note(text="kept"))

    assert sp.process_next_job(engine, handler, handler_mode="advanced")
    assert savepoints == []
    assert sp.process_next_job(engine, handler, handler_mode="advanced")
    assert savepoints  # the writer's: the worker's and its session's
    assert seen == [{first: {"from": 1}}] * 2
    assert notes(engine) == ["kept"]
    assert result_of(engine, reader) is None and result_of(engine, writer) is None


@EVERY_MODE
def test_the_asyncio_workers_job_reads_its_dependency_results(
    database: Any, engine: sa.Engine, mode: str
) -> None:
    """An async handler (default and advanced mode) reads its dependency_results through
    current_job() or its AsyncJobContext; the dependent runs once its dependency ended."""
    with Session(engine) as session:
        first = sp.enqueue(session, "first", 1)
        job_id = sp.enqueue(session, "downstream", depends_on=[first])
        session.commit()
    seen: list[Any] = []

    async def handler(job_type: str, payload: Any) -> Any:
        if job_type == "first":
            return {"from": payload}
        seen.append(sp.current_job().dependency_results)
        return None

    async def main() -> None:
        async with async_engine(database) as aengine:
            worker = sp.create_async_queue_worker(
                aengine, handler, polling_interval=0.05, **MODES[mode]
            )
            await worker.start()
            try:
                await sp.wait_for_result_async(aengine, job_id, timeout=30)
            finally:
                await worker.stop()

    asyncio.run(main())
    assert seen == [{first: {"from": 1}}]


# --- the command line ------------------------------------------------------------------------

HANDLER_MODULE = """\
def handle(job_type, payload):
    return "x" * payload
"""


def test_the_worker_commands_max_result_bytes_flag_sets_the_limit(
    database: Any, engine: sa.Engine, tmp_path: Any
) -> None:
    """``worker --max-result-bytes N`` fails a job whose result is longer than N bytes;
    ``off`` stores any; a bad value is a usage error saying what to give."""
    (tmp_path / "results_handler.py").write_text(HANDLER_MODULE)
    url = database.url.render_as_string(hide_password=False)
    small, large = enqueue_committed(engine, "short", 5), enqueue_committed(engine, "long", 50)

    def worker(*flags: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "sqla_proletarian", "worker", "results_handler:handle"]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
        return subprocess.run(
            [*command, "--burst", "--url", url, *flags],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    done = worker("--max-result-bytes", "20")
    assert done.returncode == 3, done.stderr
    assert result_of(engine, small) == "xxxxx"
    with pytest.raises(sp.JobFailedError, match=r"max_result_bytes \(20\)"):
        result_of(engine, large)
    again = enqueue_committed(engine, "long", 50)
    assert worker("--max-result-bytes", "off").returncode == 0
    assert result_of(engine, again) == "x" * 50
    refused = worker("--max-result-bytes", "0")
    assert refused.returncode == 2
    assert "max_result_bytes is 0" in refused.stderr
