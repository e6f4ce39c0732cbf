"""Bad jobs end as a clear archived failure (or retry), never as a dead worker or a loop.

Each test starts a QueueWorker in this process, queues a bad job and then a normal one,
and checks that the bad job is archived with a clear error, the normal job behind it
succeeds, and the worker is still running.
"""

from __future__ import annotations

import gc
import logging
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

import pytest
import sqlalchemy as sa
from helpers import enqueue_committed as enqueue
from helpers import wait_for
from sqlalchemy.orm import Session

import sqla_proletarian as sp

DEADLINE = 15.0


@contextmanager
def running_worker(
    engine: sa.Engine, handler: Callable[..., Any], **options: Any
) -> Iterator[sp.QueueWorker]:
    worker = sp.create_queue_worker(engine, handler, polling_interval=0.02, **options)
    worker.start()
    try:
        yield worker
    finally:
        worker.stop()


def wait_archived(engine: sa.Engine, *job_ids: uuid.UUID) -> dict[uuid.UUID, sp.ArchivedJob]:
    """The archived rows of the jobs, once all of them are archived (polling with a deadline)."""
    deadline = time.monotonic() + DEADLINE
    while True:
        with Session(engine) as session:
            rows = session.scalars(
                sa.select(sp.ArchivedJob).where(sp.ArchivedJob.job_id.in_(job_ids))
            ).all()
        if len(rows) == len(job_ids):
            return {row.job_id: row for row in rows}
        assert time.monotonic() < deadline, f"jobs not archived in {DEADLINE} s: {rows}"
        time.sleep(0.02)


def queue_is_empty(engine: sa.Engine) -> bool:
    with engine.connect() as conn:
        return conn.scalar(sa.select(sa.func.count()).select_from(sp.Job)) == 0


def events(caplog: pytest.LogCaptureFixture, name: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "event", None) == name]


def assert_still_working(engine: sa.Engine, worker: sp.QueueWorker) -> None:
    """The worker is running and runs a normal job queued now."""
    assert worker.running
    job_id = enqueue(engine, "normal", {"after": "the bad job"})
    assert wait_archived(engine, job_id)[job_id].status == "success"
    assert worker.running


def normal_or(bad: Callable[..., Any]) -> Callable[[str, Any], Any]:
    """A default-mode handler: ``normal`` jobs succeed, every other type goes to ``bad``."""

    def handler(job_type: str, payload: Any) -> Any:
        if job_type == "normal":
            return None
        return bad(job_type, payload)

    return handler


def insert_raw_job(engine: sa.Engine, payload_text: str, job_type: str = "normal") -> uuid.UUID:
    """A job row written by hand, bypassing enqueue (like an older serializer would)."""
    job_id = uuid.uuid4()
    now = datetime.now(UTC)
    with engine.begin() as conn:
        conn.execute(
            sa.insert(sp.Job.__table__).values(
                job_id=job_id,
                queue=sp.DEFAULT_QUEUE,
                job_type=job_type,
                payload=payload_text,
                attempts=0,
                enqueued_at=now,
                process_at=now,
            )
        )
    return job_id


# --- payloads that cannot be decoded ----------------------------------------------------


def test_a_payload_that_cannot_be_decoded_is_archived_as_failed_with_a_decoding_error(
    engine: sa.Engine,
) -> None:
    """A hand-written 'not json{' payload never reaches the handler: it fails, clearly."""
    seen: list[Any] = []
    with running_worker(engine, lambda job_type, payload: seen.append(payload)) as worker:
        bad = insert_raw_job(engine, "not json{")
        good = enqueue(engine, "normal", {"n": 1})
        jobs = wait_archived(engine, bad, good)
        assert jobs[bad].status == "failure"
        assert jobs[bad].attempts == 1
        error = jobs[bad].error or ""
        assert "PayloadDeserializationError" in error
        assert "cannot be decoded" in error
        assert "serializer" in error
        assert jobs[bad].payload == "not json{"
        assert jobs[good].status == "success"
        assert seen == [{"n": 1}]
        assert_still_working(engine, worker)
    assert queue_is_empty(engine)


def test_a_payload_that_cannot_be_decoded_is_retried_as_the_retry_strategy_says(
    engine: sa.Engine,
) -> None:
    """The retry strategy sees PayloadDeserializationError and its retries are used up."""
    strategy_saw: list[tuple[int, type[Exception]]] = []

    def retry_strategy(job: sp.JobContext, exc: Exception) -> sp.RetryStrategy:
        strategy_saw.append((job.attempts, type(exc)))
        return sp.RetryStrategy(2)

    handler = normal_or(lambda job_type, payload: pytest.fail("handler ran on a bad payload"))
    with running_worker(engine, handler, retry_strategy=retry_strategy) as worker:
        bad = insert_raw_job(engine, "not json{")
        job = wait_archived(engine, bad)[bad]
        assert job.status == "failure"
        assert job.attempts == 3
        assert "cannot be decoded" in (job.error or "")
        assert strategy_saw == [(n, sp.PayloadDeserializationError) for n in (1, 2, 3)]
        # The worker counts an outcome just after its commit, which the archive shows first.
        expected = {"succeeded": 0, "retried": 2, "failed": 1}
        assert wait_for(lambda: worker.summary() == expected), worker.summary()
        assert_still_working(engine, worker)


# --- job types with no handler ----------------------------------------------------------


MODES: dict[str, dict[str, Any]] = {"transaction": {}, "lease": {"lease_seconds": 30.0}}


@pytest.mark.parametrize("mode", MODES)
def test_a_job_type_with_no_handler_fails_at_once_naming_the_known_types(
    engine: sa.Engine, mode: str
) -> None:
    """JobHandlers without a handler for the type: the job is archived as failed on its
    first run, whatever the retry strategy would say (it is not asked: no retry could
    succeed), with an UnknownJobTypeError naming the type and the registered types; the
    failed-job handler runs; the worker keeps going."""
    handlers = sp.JobHandlers()
    done: list[Any] = []

    @handlers.register("normal")
    def normal(job_type: str, payload: Any) -> None:
        done.append(payload)

    @handlers.register("another")
    def another(job_type: str, payload: Any) -> None:
        done.append(payload)

    strategy_saw: list[Exception] = []
    failed_saw: list[Exception] = []

    def retry_strategy(job: sp.JobContext, exc: Exception) -> sp.RetryStrategy:
        strategy_saw.append(exc)
        return sp.RetryStrategy(retries=5, delays=[0])

    def failed_job_handler(job: sp.JobContext, exc: Exception) -> None:
        failed_saw.append(exc)

    with running_worker(
        engine,
        handlers,
        retry_strategy=retry_strategy,
        failed_job_handler=failed_job_handler,
        **MODES[mode],
    ) as worker:
        bad = enqueue(engine, "nobody-handles-this", {"x": 1})
        good = enqueue(engine, "normal", {"n": 2})
        jobs = wait_archived(engine, bad, good)
        assert jobs[bad].status == "failure"
        assert jobs[bad].attempts == 1
        error = jobs[bad].error or ""
        assert error.startswith("sqla_proletarian.errors.UnknownJobTypeError: ")
        assert "no handler is registered for job type 'nobody-handles-this'" in error
        assert "(known job types: 'another', 'normal')" in error
        assert strategy_saw == []
        assert wait_for(lambda: len(failed_saw) == 1)
        assert isinstance(failed_saw[0], sp.UnknownJobTypeError)
        assert failed_saw[0].job_type == "nobody-handles-this"
        assert failed_saw[0].known_types == ("another", "normal")
        assert jobs[good].status == "success"
        assert done == [{"n": 2}]
        assert_still_working(engine, worker)


# --- retry strategies that misbehave ----------------------------------------------------


def test_a_retry_strategy_that_raises_archives_the_job_as_failed(
    engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """A raising retry strategy: logged as retry-strategy-error, job failed once, no loop."""
    caplog.set_level(logging.INFO, logger="sqla_proletarian")
    calls: list[int] = []

    def retry_strategy(job: sp.JobContext, exc: Exception) -> sp.RetryStrategy:
        calls.append(job.attempts)
        raise RuntimeError("the retry strategy itself is broken")

    def bad(job_type: str, payload: Any) -> None:
        raise ValueError("the handler failed")

    with running_worker(engine, normal_or(bad), retry_strategy=retry_strategy) as worker:
        bad_id = enqueue(engine, "bad")
        good = enqueue(engine, "normal")
        jobs = wait_archived(engine, bad_id, good)
        assert jobs[bad_id].status == "failure"
        assert jobs[bad_id].attempts == 1
        assert "ValueError: the handler failed" in (jobs[bad_id].error or "")
        assert jobs[good].status == "success"
        assert calls == [1]
        assert_still_working(engine, worker)
    logged = events(caplog, "retry-strategy-error")
    assert len(logged) == 1
    assert "the retry strategy itself is broken" in logged[0].error


ODD_STRATEGY_RESULTS: list[object] = [3, "twice", {"retries": 2}, sp.RetryStrategy]


def test_a_retry_strategy_returning_something_else_archives_the_job_as_failed(
    engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """A strategy that returns no RetryStrategy (an int, a str, a dict, the class itself):
    each job fails once, the log says what to return instead."""
    caplog.set_level(logging.INFO, logger="sqla_proletarian")

    def bad(job_type: str, payload: Any) -> None:
        raise ValueError("the handler failed")

    def retry_strategy(job: sp.JobContext, exc: Exception) -> Any:
        return ODD_STRATEGY_RESULTS[job.payload["odd"]]

    with running_worker(engine, normal_or(bad), retry_strategy=retry_strategy) as worker:
        bad_ids = [enqueue(engine, "bad", {"odd": i}) for i in range(len(ODD_STRATEGY_RESULTS))]
        good = enqueue(engine, "normal")
        jobs = wait_archived(engine, *bad_ids, good)
        assert [(jobs[i].status, jobs[i].attempts) for i in bad_ids] == [("failure", 1)] * len(
            bad_ids
        )
        assert jobs[good].status == "success"
        assert_still_working(engine, worker)
    logged = events(caplog, "retry-strategy-error")
    assert len(logged) == len(ODD_STRATEGY_RESULTS)
    for record in logged:
        assert "InvalidRetryStrategyError" in record.error
        assert "return a sqla_proletarian.RetryStrategy" in record.error


# --- failed-job handlers that raise -----------------------------------------------------


def test_a_failed_job_handler_that_raises_leaves_the_job_archived_as_failed(
    engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """The failed-job handler is called once; its exception is logged and changes nothing."""
    caplog.set_level(logging.INFO, logger="sqla_proletarian")
    calls: list[tuple[uuid.UUID, str]] = []
    lock = threading.Lock()

    def failed_job_handler(job: sp.JobContext, exc: Exception) -> None:
        with lock:
            calls.append((job.job_id, str(exc)))
        raise RuntimeError("the failed-job handler is broken too")

    def bad(job_type: str, payload: Any) -> None:
        raise ValueError("the handler failed")

    with running_worker(engine, normal_or(bad), failed_job_handler=failed_job_handler) as worker:
        bad_id = enqueue(engine, "bad")
        good = enqueue(engine, "normal")
        jobs = wait_archived(engine, bad_id, good)
        assert jobs[bad_id].status == "failure"
        assert jobs[bad_id].attempts == 1
        assert jobs[good].status == "success"
        assert_still_working(engine, worker)
        assert calls == [(bad_id, "the handler failed")]
        expected = {"succeeded": 2, "retried": 0, "failed": 1}
        assert wait_for(lambda: worker.summary() == expected), worker.summary()
    assert queue_is_empty(engine)
    logged = events(caplog, "failed-job-handler-error")
    assert len(logged) == 1
    assert "the failed-job handler is broken too" in logged[0].error


# --- handlers that return something odd -------------------------------------------------


def test_a_handler_return_value_is_ignored(engine: sa.Engine) -> None:
    """Like Proletarian, what a plain handler returns (here an int) does not matter: success."""
    with running_worker(engine, lambda job_type, payload: 42) as worker:
        job_id = enqueue(engine, "normal")
        job = wait_archived(engine, job_id)[job_id]
        assert job.status == "success"
        assert job.error is None
        assert_still_working(engine, worker)


def test_an_async_handler_is_refused_with_a_clear_failure_and_no_warning(
    engine: sa.Engine,
) -> None:
    """An ``async def`` handler never runs its body: the job fails saying so, and the
    coroutine is closed so no 'coroutine was never awaited' warning escapes."""
    ran: list[Any] = []

    async def handler(job_type: str, payload: Any) -> None:
        ran.append(payload)

    with Session(engine) as session:
        first = sp.enqueue(session, "async", {"n": 1})
        session.commit()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert sp.process_next_job(engine, handler)
        gc.collect()
    assert [w for w in caught if issubclass(w.category, RuntimeWarning)] == []
    job = wait_archived(engine, first)[first]
    assert job.status == "failure"
    assert "returned an awaitable" in (job.error or "")
    assert "asyncio.run" in (job.error or "")
    assert ran == []

    with running_worker(engine, handler) as worker:
        second = enqueue(engine, "async", {"n": 2})
        assert wait_archived(engine, second)[second].status == "failure"
        assert worker.running
    gc.collect()
    assert ran == []


def test_a_generator_handler_is_refused_like_an_async_one(engine: sa.Engine) -> None:
    """A handler written as a generator returns without running its body, so, like an
    async handler, the job must fail with a clear message instead of passing as done."""
    ran: list[Any] = []

    def handler(job_type: str, payload: Any) -> Iterator[None]:
        ran.append(payload)
        yield None

    with running_worker(engine, handler) as worker:
        job_id = enqueue(engine, "generator", {"n": 1})
        job = wait_archived(engine, job_id)[job_id]
        assert worker.running
    assert ran == []
    assert job.status == "failure", "a generator handler's body never ran, yet it 'succeeded'"
    assert "generator" in (job.error or "")


def test_a_handler_that_calls_sys_exit_cannot_loop_forever(engine: sa.Engine) -> None:
    """sys.exit() in a handler stops the worker like a dying process would; restarting the
    worker must not run the job forever: within max_unclean_ends + 1 starts it is archived
    as failed (as a crash, or as a failure), and the job behind it runs."""
    runs: list[int] = []

    def handler(job_type: str, payload: Any) -> None:
        if job_type == "exits":
            runs.append(1)
            sys.exit(3)

    bad = enqueue(engine, "exits")
    good = enqueue(engine, "normal")
    for _ in range(4):
        worker = sp.create_queue_worker(engine, handler, polling_interval=0.02)
        worker.start()
        try:
            deadline = time.monotonic() + DEADLINE
            while worker.running and not queue_is_empty(engine):
                assert time.monotonic() < deadline, "the worker neither stopped nor finished"
                time.sleep(0.02)
        finally:
            worker.stop()
        if queue_is_empty(engine):
            break
    assert queue_is_empty(engine), f"still queued after {len(runs)} runs that called sys.exit()"
    # Each sys.exit() run is an unclean end; the start after the third archives the job as
    # crashed without running it again.
    assert len(runs) == 3
    jobs = wait_archived(engine, bad, good)
    assert (jobs[bad].status, jobs[bad].attempts) == ("failure", 3)
    assert "JobCrashedError" in (jobs[bad].error or "")
    assert jobs[good].status == "success"
