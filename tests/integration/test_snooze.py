"""sp.Snooze: a handler puts its job back in the queue, due in some seconds, without taking
an attempt (no retry consumed, no retry strategy or failed-job handler called), its
``job.session`` writes rolled back and ``snoozes`` counted: in both modes (the job's
transaction, a fenced lease update), in the threaded and the asyncio worker, on every
backend. The archive, get_job, list_jobs and retry_failed carry ``snoozes`` and
``concurrency_key``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from helpers import T0, FakeClock, archived_job, enqueue_committed, events, running, wait_for
from lease_helpers import Base, Note, job_row, notes
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

import sqla_proletarian as sp

#: The worker options of each mode: the job's transaction, or a lease.
MODES = {"transaction": {}, "lease": {"lease_seconds": 60.0}}
EACH_MODE = pytest.mark.parametrize("mode", list(MODES))
ASYNC_DRIVERNAME = {
    "sqlite": "sqlite+aiosqlite",
    "postgresql": "postgresql+psycopg",
    "mariadb": "mysql+aiomysql",
}


@pytest.fixture
def engine(database: Any) -> sa.Engine:
    """The test database's engine, with the table handlers write notes to."""
    engine = database.engine()
    Base.metadata.create_all(engine)
    return engine


def note(job: sp.JobContext, text: str) -> None:
    """Write a note through the job's session (flushed, so it reaches the database)."""
    job.session.add(Note(text=text))
    job.session.flush()


def run_one(engine: sa.Engine, handler: Callable[..., Any], mode: str, **options: Any) -> bool:
    return sp.process_next_job(engine, handler, handler_mode="advanced", **MODES[mode], **options)


@EACH_MODE
def test_a_snooze_puts_the_job_back_due_later_with_the_same_attempt_and_no_retry_taken(
    engine: sa.Engine, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A failure takes attempt 1 (retried); the next run snoozes twice, each time due in the
    snooze's seconds by the worker's clock, its session's writes rolled back, the retry
    strategy and the failed-job handler not called; the run after them sees attempt 2 again
    and succeeds. The archive counts 2 attempts and 2 snoozes."""
    caplog.set_level(logging.INFO, logger="sqla_proletarian")
    clock = FakeClock()
    job_id = enqueue_committed(engine, "call-partner", {"n": 1}, clock=clock)
    seen: list[int] = []
    strategy_calls: list[str] = []
    failed_calls: list[str] = []
    plan = ["fail", "snooze", "snooze-delta", "ok"]

    def handler(job: sp.JobContext) -> None:
        seen.append(job.attempts)
        step = plan[len(seen) - 1]
        note(job, f"run {len(seen)}")
        if step == "fail":
            raise ValueError("partner down")
        if step == "snooze":
            raise sp.Snooze(30)
        if step == "snooze-delta":
            raise sp.Snooze(timedelta(minutes=2))

    def retry_strategy(job: sp.JobContext, exc: Exception) -> sp.RetryStrategy:
        strategy_calls.append(repr(exc))
        return sp.RetryStrategy(retries=1, delays=[0])

    def failed_job_handler(job: sp.JobContext, exc: Exception) -> None:
        failed_calls.append(repr(exc))

    options = {
        "clock": clock,
        "retry_strategy": retry_strategy,
        "failed_job_handler": failed_job_handler,
    }
    assert run_one(engine, handler, mode, **options)
    assert strategy_calls == ["ValueError('partner down')"]

    assert run_one(engine, handler, mode, **options)
    row = job_row(engine, job_id)
    assert row is not None
    assert (row.snoozes, row.process_at) == (1, T0 + timedelta(seconds=30))
    assert (row.lease_token, row.due_at, row.lease_owner) == (None, None, None)
    assert notes(engine) == []  # each run's note was rolled back
    assert not run_one(engine, handler, mode, **options)  # not due yet

    clock.advance(30)
    assert run_one(engine, handler, mode, **options)
    row = job_row(engine, job_id)
    assert row is not None
    assert (row.snoozes, row.process_at) == (2, T0 + timedelta(seconds=150))
    clock.advance(120)
    assert run_one(engine, handler, mode, **options)

    assert seen == [1, 2, 2, 2]
    assert strategy_calls == ["ValueError('partner down')"]
    assert failed_calls == []
    done = archived_job(engine, job_id)
    assert done is not None
    assert (done.status, done.attempts, done.snoozes) == ("success", 2, 2)
    assert notes(engine) == ["run 4"]
    snoozed = events(caplog.records, "job-snoozed")
    assert [(r.job_id, r.attempt, r.seconds) for r in snoozed] == [
        (job_id, 2, 30.0),
        (job_id, 2, 120.0),
    ]
    assert all(r.levelno == logging.INFO for r in snoozed)


@EACH_MODE
def test_a_snooze_in_a_job_handlers_table_in_default_mode_takes_no_attempt(
    engine: sa.Engine, mode: str
) -> None:
    """A plain handler registered in JobHandlers snoozes: the job stays queued with no
    attempt counted, so a retry strategy of no retries never fails it."""
    clock = FakeClock()
    job_id = enqueue_committed(engine, "sync", None, clock=clock)
    handlers = sp.JobHandlers()
    runs: list[int] = []

    @handlers.register("sync")
    def sync(job_type: str, payload: Any) -> None:
        runs.append(1)
        if len(runs) < 3:
            raise sp.Snooze(0)

    for _ in range(3):
        assert sp.process_next_job(engine, handlers, clock=clock, **MODES[mode])
    assert len(runs) == 3
    done = archived_job(engine, job_id)
    assert done is not None
    assert (done.status, done.attempts, done.snoozes) == ("success", 1, 2)


@EACH_MODE
def test_a_snooze_of_a_bad_value_fails_the_run_with_what_to_give(
    engine: sa.Engine, mode: str
) -> None:
    """Snooze(-1) raises ConfigurationError where the handler makes it: the run fails with
    that error (archived as failed, no retry strategy), and the worker goes on."""
    bad = enqueue_committed(engine, "bad", None)
    good = enqueue_committed(engine, "good", None)

    def handler(job: sp.JobContext) -> None:
        if job.job_type == "bad":
            raise sp.Snooze(-1)

    assert run_one(engine, handler, mode)
    assert run_one(engine, handler, mode)
    failed = archived_job(engine, bad)
    assert failed is not None and failed.status == "failure"
    assert failed.error is not None
    assert failed.error.startswith("sqla_proletarian.errors.ConfigurationError: Snooze(-1)")
    assert "from 0 to 604800" in failed.error
    assert failed.snoozes == 0
    done = archived_job(engine, good)
    assert done is not None and done.status == "success"


def test_a_snooze_after_a_cancel_request_archives_the_job_cancelled(engine: sa.Engine) -> None:
    """Lease mode: a cancel requested while the handler ran wins over its snooze, as over a
    retry (the retry strategy is not asked): the fenced update finds the request and the
    job is archived as cancelled."""
    job_id = enqueue_committed(engine, "long", None)
    asked: list[Exception] = []

    def handler(job: sp.JobContext) -> None:
        with engine.begin() as conn:
            assert sp.cancel_job(conn, job.job_id)
        raise sp.Snooze(30)

    def retry_strategy(job: sp.JobContext, exc: Exception) -> sp.RetryStrategy:
        asked.append(exc)
        return sp.RetryStrategy(retries=5)

    assert run_one(engine, handler, "lease", retry_strategy=retry_strategy)
    assert asked == []
    assert job_row(engine, job_id) is None
    done = archived_job(engine, job_id)
    assert done is not None
    assert (done.status, done.snoozes) == ("cancelled", 0)


def test_a_snooze_of_a_run_whose_lease_was_taken_writes_nothing(engine: sa.Engine) -> None:
    """Lease mode: a snooze is fenced by the run's token: once another run holds the job's
    lease, the snoozing run changes nothing of it (and asks no retry strategy)."""
    job_id = enqueue_committed(engine, "long", None)
    other = uuid.uuid4()
    table = sp.Job.__table__

    def handler(job: sp.JobContext) -> None:
        with engine.begin() as conn:
            conn.execute(
                sa.update(table).where(table.c.job_id == job.job_id).values(lease_token=other)
            )
        raise sp.Snooze(30)

    def retry_strategy(job: sp.JobContext, exc: Exception) -> sp.RetryStrategy:
        asked.append(exc)
        return sp.RetryStrategy(retries=5)

    asked: list[Exception] = []
    assert run_one(engine, handler, "lease", retry_strategy=retry_strategy)
    assert asked == []
    row = job_row(engine, job_id)
    assert row is not None
    assert (row.lease_token, row.snoozes, row.attempts) == (other, 0, 1)
    assert archived_job(engine, job_id) is None


@EACH_MODE
def test_a_job_snoozed_more_than_its_count_holds_goes_on_snoozing(
    engine: sa.Engine, mode: str
) -> None:
    """``snoozes`` is a SMALLINT: at its largest value a snooze still puts the job back,
    due later, and the count stays there instead of overflowing."""
    clock = FakeClock()
    job_id = enqueue_committed(engine, "poll", None, clock=clock)
    table = sp.Job.__table__
    with engine.begin() as conn:
        conn.execute(sa.update(table).where(table.c.job_id == job_id).values(snoozes=32_767))

    def handler(job_type: str, payload: Any) -> None:
        raise sp.Snooze(1)

    assert sp.process_next_job(engine, handler, clock=clock, **MODES[mode])
    row = job_row(engine, job_id)
    assert row is not None
    assert (row.snoozes, row.attempts, row.process_at) == (32_767, 0, T0 + timedelta(seconds=1))
    assert archived_job(engine, job_id) is None


def test_a_snoozed_job_in_a_batch_goes_back_while_the_others_succeed(engine: sa.Engine) -> None:
    """Transaction mode, several jobs a claim: the snoozed one stays queued, snoozed once,
    its batch mates are archived as succeeded."""
    clock = FakeClock()
    ids = [enqueue_committed(engine, "part", {"n": n}, clock=clock) for n in range(3)]

    def handler(job_type: str, payload: Any) -> None:
        if payload["n"] == 1:
            raise sp.Snooze(5)

    while sp.process_next_job(engine, handler, clock=clock, batch_size=3):
        pass  # SQLite claims one job at a time
    row = job_row(engine, ids[1])
    assert row is not None and (row.snoozes, row.attempts) == (1, 0)
    for job_id in (ids[0], ids[2]):
        done = archived_job(engine, job_id)
        assert done is not None and done.status == "success"


@EACH_MODE
def test_the_threaded_worker_counts_a_snooze_as_retried(
    engine: sa.Engine, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker's handler snoozes a job once: it runs again once the clock reaches its due
    time, and the summary counts one retried and one succeeded run."""
    caplog.set_level(logging.INFO, logger="sqla_proletarian")
    clock = FakeClock()
    job_id = enqueue_committed(engine, "call-partner", None, clock=clock)
    attempts: list[int] = []

    def handler(job: sp.JobContext) -> None:
        attempts.append(job.attempts)
        if len(attempts) == 1:
            raise sp.Snooze(30)

    worker = sp.create_queue_worker(
        engine,
        handler,
        handler_mode="advanced",
        clock=clock,
        polling_interval=0.05,
        **MODES[mode],
    )
    with running(worker):
        assert wait_for(lambda: events(caplog.records, "job-snoozed") != [])
        clock.advance(30)
        # An idle worker sleeps until the job's due time by the real clock: wake it.
        assert wait_for(lambda: worker.wake() or archived_job(engine, job_id) is not None)
        assert wait_for(lambda: worker.summary()["succeeded"] == 1)
    assert attempts == [1, 1]
    assert worker.summary() == {"succeeded": 1, "retried": 1, "failed": 0}
    done = archived_job(engine, job_id)
    assert done is not None and (done.attempts, done.snoozes) == (1, 1)


@contextlib.asynccontextmanager
async def async_engine(url: URL) -> AsyncIterator[AsyncEngine]:
    engine = create_async_engine(url)
    try:
        yield engine
    finally:
        await engine.dispose()


async def eventually(
    check: Callable[[], bool], timeout: float = 10.0, poke: Callable[[], None] | None = None
) -> bool:
    """Run a sync check in a thread (the loop keeps running) until it holds or time is up,
    calling ``poke`` before each look."""
    deadline = time.monotonic() + timeout
    while True:
        if poke is not None:
            poke()
        if await asyncio.to_thread(check):
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.02)


@EACH_MODE
def test_the_asyncio_worker_snoozes_an_async_handlers_job_with_its_writes_rolled_back(
    database: Any, engine: sa.Engine, mode: str
) -> None:
    """An async handler writes through its AsyncSession, then snoozes: the write is rolled
    back, the job comes back due in the seconds given with the same attempt, and the
    summary counts the snooze as retried."""
    clock = FakeClock()
    job_id = enqueue_committed(engine, "call-partner", None, clock=clock)
    attempts: list[int] = []
    url = database.url.set(drivername=ASYNC_DRIVERNAME[database.backend])

    async def handler(job: sp.AsyncJobContext) -> None:
        attempts.append(job.attempts)
        job.session.add(Note(text=f"run {len(attempts)}"))
        await job.session.flush()
        if len(attempts) == 1:
            raise sp.Snooze(30)

    def snoozed() -> bool:
        row = job_row(engine, job_id)
        return row is not None and row.snoozes == 1 and row.lease_token is None

    async def main() -> sp.AsyncQueueWorker:
        async with async_engine(url) as async_eng:
            worker = sp.create_async_queue_worker(
                async_eng,
                handler,
                handler_mode="advanced",
                clock=clock,
                polling_interval=0.05,
                **MODES[mode],
            )
            async with worker:
                assert await eventually(snoozed)
                row = job_row(engine, job_id)
                assert row.process_at == T0 + timedelta(seconds=30)
                assert notes(engine) == []
                clock.advance(30)
                # An idle worker sleeps until the job's due time by the real clock: wake it.
                assert await eventually(
                    lambda: archived_job(engine, job_id) is not None, poke=worker.wake
                )
                assert await eventually(lambda: worker.summary()["succeeded"] == 1)
        return worker

    worker = asyncio.run(main())
    assert attempts == [1, 1]
    assert worker.summary() == {"succeeded": 1, "retried": 1, "failed": 0}
    assert notes(engine) == ["run 2"]
    done = archived_job(engine, job_id)
    assert done is not None and (done.attempts, done.snoozes) == (1, 1)


# --- what inspection and retry_failed show --------------------------------------------------


@EACH_MODE
def test_get_job_and_list_jobs_show_snoozes_and_the_concurrency_key_in_every_state(
    engine: sa.Engine, mode: str
) -> None:
    """Queued (scheduled after its snooze), running (seen from its handler) and archived:
    get_job and list_jobs give the job's snoozes and concurrency key."""
    clock = FakeClock()
    job_id = enqueue_committed(
        engine, "call-partner", None, clock=clock, concurrency_key="tenant-42"
    )
    seen: list[tuple[str, int, str | None]] = []

    def handler(job: sp.JobContext) -> None:
        detail = sp.get_job(engine, job.job_id, clock=clock)
        assert detail is not None
        seen.append((detail.state, detail.snoozes, detail.concurrency_key))
        if len(seen) == 1:
            raise sp.Snooze(10)

    ready = sp.get_job(engine, job_id, clock=clock)
    assert ready is not None
    assert (ready.state, ready.snoozes, ready.concurrency_key) == ("ready", 0, "tenant-42")
    assert run_one(engine, handler, mode, clock=clock, max_unclean_ends=3)
    scheduled = sp.get_job(engine, job_id, clock=clock)
    assert scheduled is not None
    assert (scheduled.state, scheduled.snoozes, scheduled.concurrency_key) == (
        "scheduled",
        1,
        "tenant-42",
    )
    [listed] = sp.list_jobs(engine, "scheduled", clock=clock).jobs
    assert (listed.snoozes, listed.concurrency_key) == (1, "tenant-42")
    clock.advance(10)
    assert run_one(engine, handler, mode, clock=clock, max_unclean_ends=3)
    assert seen == [("running", 0, "tenant-42"), ("running", 1, "tenant-42")]
    done = sp.get_job(engine, job_id, clock=clock)
    assert done is not None
    assert (done.state, done.snoozes, done.concurrency_key) == ("succeeded", 1, "tenant-42")
    [archived] = sp.list_jobs(engine, "succeeded", clock=clock).jobs
    assert (archived.snoozes, archived.concurrency_key) == (1, "tenant-42")


def test_a_failure_and_a_cancel_archive_the_jobs_snoozes(engine: sa.Engine) -> None:
    """A snoozed job that then fails, or is cancelled while queued, keeps its snoozes in the
    archive."""
    clock = FakeClock()
    failing = enqueue_committed(engine, "fail", None, clock=clock)
    cancelled = enqueue_committed(engine, "cancel", None, clock=clock)
    snoozed: set[uuid.UUID] = set()

    def handler(job: sp.JobContext) -> None:
        if job.job_id not in snoozed:
            snoozed.add(job.job_id)
            raise sp.Snooze(5)
        raise ValueError("no good")

    assert run_one(engine, handler, "transaction", clock=clock)
    assert run_one(engine, handler, "transaction", clock=clock)
    assert snoozed == {failing, cancelled}
    with engine.begin() as conn:
        assert sp.cancel_job(conn, cancelled, clock=clock)
    clock.advance(5)
    assert run_one(engine, handler, "transaction", clock=clock)
    failed = archived_job(engine, failing)
    assert failed is not None and (failed.status, failed.snoozes) == ("failure", 1)
    gone = archived_job(engine, cancelled)
    assert gone is not None and (gone.status, gone.snoozes) == ("cancelled", 1)


@pytest.mark.parametrize("unique_key", [None, "charge-7"], ids=["unkeyed", "keyed"])
def test_retry_failed_puts_a_failure_back_with_its_concurrency_key_and_no_snoozes(
    engine: sa.Engine, unique_key: str | None
) -> None:
    """A failure put back keeps its concurrency key (and unique key), and starts again from
    zero attempts and zero snoozes."""
    clock = FakeClock()
    job_id = enqueue_committed(
        engine, "charge", None, clock=clock, concurrency_key="tenant-7", unique_key=unique_key
    )
    runs: list[int] = []

    def handler(job: sp.JobContext) -> None:
        runs.append(job.attempts)
        if len(runs) == 1:
            raise sp.Snooze(0)
        raise ValueError("declined")

    assert run_one(engine, handler, "transaction", clock=clock)
    assert run_one(engine, handler, "transaction", clock=clock)
    failed = archived_job(engine, job_id)
    assert failed is not None and (failed.status, failed.snoozes) == ("failure", 1)
    assert failed.concurrency_key == "tenant-7"

    assert sp.retry_failed(engine, [job_id], clock=clock) == 1
    row = job_row(engine, job_id)
    assert row is not None
    assert (row.concurrency_key, row.unique_key, row.attempts, row.snoozes) == (
        "tenant-7",
        unique_key,
        0,
        0,
    )
    detail = sp.get_job(engine, job_id, clock=clock)
    assert detail is not None
    assert (detail.state, detail.concurrency_key, detail.snoozes) == ("ready", "tenant-7", 0)
