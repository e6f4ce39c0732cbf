"""``job.set_progress``: reported progress is committed at once on a connection of its own,
so another connection sees it while the handler still runs (SQLite in transaction mode:
once the job's transaction has ended), at most once per ``progress_interval`` with the
latest report written when the interval has passed or the handler returns; bad reports
are refused; a failed write never fails the job. Both run modes, both workers, every
backend."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from helpers import archived, enqueue_committed, events, running, wait_for
from sqlalchemy.ext.asyncio import create_async_engine

import sqla_proletarian as sp
from sqla_proletarian.models import Progress
from sqla_proletarian.progress import MAX_MESSAGE_CHARS

ASYNC_DRIVERNAME = {
    "sqlite": "sqlite+aiosqlite",
    "postgresql": "postgresql+psycopg",
    "mariadb": "mysql+aiomysql",
}
MODES = {"transaction": {}, "lease": {"lease_seconds": 60.0}}
PROGRESS = Progress.__table__
#: Long enough that no second write of a job comes from the interval during a test.
NEVER = 600.0


def stored(engine: sa.Engine, job_id: uuid.UUID) -> tuple[float, str | None] | None:
    """The job's progress row as another connection reads it."""
    with engine.connect() as conn:
        row = conn.execute(
            sa.select(PROGRESS.c.progress, PROGRESS.c.message).where(PROGRESS.c.job_id == job_id)
        ).one_or_none()
    return None if row is None else (row.progress, row.message)


def held_until_end(engine: sa.Engine, mode: str) -> bool:
    """SQLite in transaction mode: the job's transaction holds the write lock while it runs."""
    return engine.dialect.name == "sqlite" and mode == "transaction"


def report_three(job: Any, first_written: Any) -> None:
    """Report a quarter, wait until ``first_written()`` (it was written), then report two
    more: the interval holds those back."""
    job.set_progress(0.25, "a quarter")
    assert first_written()
    job.set_progress(0.5)
    job.set_progress(0.75, "three quarters")


def first_written(engine: sa.Engine, mode: str, job_id: uuid.UUID) -> bool:
    """Whether the first report got written (not waited for where it is written at the
    job's end)."""
    if held_until_end(engine, mode):
        return True
    return wait_for(lambda: stored(engine, job_id) is not None, timeout=20)


def check_seen_while_running(
    engine: sa.Engine, mode: str, job_id: uuid.UUID, started: threading.Event
) -> None:
    """While the handler waits (it reported three times), the first report is stored and
    the two later ones are held back by the interval; SQLite in transaction mode stores
    nothing before the job's transaction ends."""
    assert started.wait(30), "the handler did not start"
    if held_until_end(engine, mode):
        assert stored(engine, job_id) is None
    else:
        assert wait_for(lambda: stored(engine, job_id) is not None, timeout=20)
        assert stored(engine, job_id) == (0.25, "a quarter")


@pytest.mark.parametrize("mode", sorted(MODES))
def test_threaded_worker_progress_is_visible_while_the_job_runs_and_its_last_report_stays(
    engine: sa.Engine, mode: str
) -> None:
    job_id = enqueue_committed(engine, "crunch", {"n": 1})
    started, release = threading.Event(), threading.Event()

    def handler(job_type: str, payload: Any) -> None:
        report_three(sp.current_job(), lambda: first_written(engine, mode, job_id))
        started.set()
        assert release.wait(30)

    worker = sp.create_queue_worker(
        engine, handler, polling_interval=0.02, progress_interval=NEVER, **MODES[mode]
    )
    with running(worker):
        try:
            check_seen_while_running(engine, mode, job_id, started)
        finally:
            release.set()
        assert wait_for(lambda: stored(engine, job_id) == (0.75, "three quarters"), timeout=20)
        assert wait_for(lambda: len(archived(engine)) == 1, timeout=20)
    assert [job.status for job in archived(engine)] == ["success"]


@pytest.mark.parametrize("mode", sorted(MODES))
def test_asyncio_worker_progress_is_visible_while_the_job_runs_and_its_last_report_stays(
    database: Any, engine: sa.Engine, mode: str
) -> None:
    job_id = enqueue_committed(engine, "crunch", {"n": 1})
    started, release = threading.Event(), threading.Event()
    returned: list[object] = []

    async def handler(job: sp.AsyncJobContext) -> None:
        # set_progress only schedules the write: it returns None, not an awaitable.
        returned.append(job.set_progress(0.25, "a quarter"))
        written = await asyncio.to_thread(first_written, engine, mode, job_id)
        report_three(job, lambda: written)
        started.set()
        assert await asyncio.to_thread(release.wait, 30)

    async def main() -> None:
        url = database.url.set(drivername=ASYNC_DRIVERNAME[database.backend])
        async_engine = create_async_engine(url)
        try:
            async with sp.create_async_queue_worker(
                async_engine,
                handler,
                handler_mode="advanced",
                polling_interval=0.02,
                progress_interval=NEVER,
                **MODES[mode],
            ):
                try:
                    await asyncio.to_thread(check_seen_while_running, engine, mode, job_id, started)
                finally:
                    release.set()
                deadline = time.monotonic() + 20
                while await asyncio.to_thread(stored, engine, job_id) != (0.75, "three quarters"):
                    assert time.monotonic() < deadline, "the last report was not written"
                    await asyncio.sleep(0.02)
                while not await asyncio.to_thread(archived, engine):
                    assert time.monotonic() < deadline, "the job did not end"
                    await asyncio.sleep(0.02)
        finally:
            await async_engine.dispose()

    asyncio.run(main())
    assert returned == [None]
    assert [job.status for job in archived(engine)] == ["success"]


@pytest.mark.parametrize("worker_kind", ["threaded", "asyncio"])
def test_a_report_held_back_by_the_interval_is_written_once_the_interval_has_passed(
    database: Any, engine: sa.Engine, worker_kind: str
) -> None:
    """The latest report is written when the interval has passed, while the handler still
    runs and reports nothing more (lease mode, so SQLite writes at once too)."""
    job_id = enqueue_committed(engine, "crunch")
    release = threading.Event()
    seen: list[Any] = []

    def watch() -> None:
        assert wait_for(lambda: stored(engine, job_id) is not None, timeout=20)
        seen.append(stored(engine, job_id))
        assert wait_for(lambda: stored(engine, job_id) == (0.6, "later"), timeout=20)

    options: dict[str, Any] = {
        "handler_mode": "advanced",
        "polling_interval": 0.02,
        "progress_interval": 0.5,
        "lease_seconds": 60.0,
    }
    if worker_kind == "threaded":

        def handler(job: sp.JobContext) -> None:
            job.set_progress(0.1, "first")
            assert wait_for(lambda: stored(engine, job_id) is not None, timeout=20)
            job.set_progress(0.6, "later")
            assert release.wait(30)

        with running(sp.create_queue_worker(engine, handler, **options)):
            try:
                watch()
            finally:
                release.set()
            assert wait_for(lambda: len(archived(engine)) == 1, timeout=20)
    else:

        async def async_handler(job: sp.AsyncJobContext) -> None:
            job.set_progress(0.1, "first")
            await asyncio.to_thread(wait_for, lambda: stored(engine, job_id) is not None, 20)
            job.set_progress(0.6, "later")
            assert await asyncio.to_thread(release.wait, 30)

        async def main() -> None:
            url = database.url.set(drivername=ASYNC_DRIVERNAME[database.backend])
            async_engine = create_async_engine(url)
            try:
                async with sp.create_async_queue_worker(async_engine, async_handler, **options):
                    try:
                        await asyncio.to_thread(watch)
                    finally:
                        release.set()
                    deadline = time.monotonic() + 20
                    while not await asyncio.to_thread(archived, engine):
                        assert time.monotonic() < deadline, "the job did not end"
                        await asyncio.sleep(0.02)
            finally:
                await async_engine.dispose()

        asyncio.run(main())
    # The second report was not written with the first: the interval held it back.
    assert seen == [(0.1, "first")]


@pytest.mark.parametrize(
    ("fraction", "message"),
    [(True, None), (1.5, None), (-0.01, None), (float("nan"), None), ("0.5", None), (0.5, 7)],
)
def test_a_bad_report_is_refused_with_an_error_that_says_what_to_give(
    engine: sa.Engine, fraction: Any, message: Any
) -> None:
    enqueue_committed(engine, "crunch")
    errors: list[Exception] = []

    def handler(job: sp.JobContext) -> None:
        try:
            job.set_progress(fraction, message)
        except Exception as exc:
            errors.append(exc)

    assert sp.process_next_job(engine, handler, handler_mode="advanced")
    [error] = errors
    assert isinstance(error, sp.InvalidProgressError) and isinstance(error, ValueError)
    assert ("from 0 to 1" if message is None else "a string or None") in str(error)
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(PROGRESS)).scalar() == 0


def test_a_long_message_is_cut_and_whole_numbers_count(engine: sa.Engine) -> None:
    job_id = enqueue_committed(engine, "crunch")

    def handler(job_type: str, payload: Any) -> None:
        sp.current_job().set_progress(1, "x" * (MAX_MESSAGE_CHARS + 500))

    assert sp.process_next_job(engine, handler)
    assert wait_for(lambda: stored(engine, job_id) is not None, timeout=20)
    fraction, message = stored(engine, job_id) or (None, None)
    assert fraction == 1.0
    assert message == "x" * (MAX_MESSAGE_CHARS - 3) + "..."


def test_a_failed_progress_write_is_logged_and_the_job_still_succeeds(
    engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    PROGRESS.drop(engine)  # every write fails
    enqueue_committed(engine, "crunch")

    def handler(job_type: str, payload: Any) -> None:
        sp.current_job().set_progress(0.5, "half")

    with caplog.at_level(logging.WARNING, logger="sqla_proletarian"):
        assert sp.process_next_job(engine, handler, lease_seconds=60.0)
        # Tried a few times, then dropped.
        assert wait_for(lambda: len(events(caplog.records, "progress-write-failed")) == 3, 20)
    assert [job.status for job in archived(engine)] == ["success"]
    failures = events(caplog.records, "progress-write-failed")
    assert all("the job goes on" in record.hint for record in failures)
    assert "dropped after 3 tries" in failures[-1].hint
