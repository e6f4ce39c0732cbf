"""The QueueWorker's life: start, stop, threads, polling, graceful shutdown, queues, options."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from helpers import (
    FakeClock,
    archived,
    archived_job,
    count,
    enqueue_committed,
    events,
    jobs,
    running,
    wait_for,
)
from sqlalchemy.orm import Session

import sqla_proletarian as sp


def _ok(job_type: str, payload: Any) -> None:
    return None


def _all_connections_returned(engine: sa.Engine) -> Callable[[], bool]:
    """Whether the threads a timed-out stop() left behind have given back their connections
    (so the fixture's engine.dispose() closes them)."""
    pool: Any = engine.pool
    return lambda: pool.checkedout() == 0


def test_worker_starts_and_stops_and_works_as_a_context_manager(
    engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sqla_proletarian")
    first = enqueue_committed(engine, "t", 1)
    worker = sp.create_queue_worker(engine, _ok, polling_interval=0.05, worker_id="cm-worker")
    assert isinstance(worker, sp.QueueWorker)
    assert not worker.running
    with worker as started:
        assert started is worker and worker.running
        assert wait_for(lambda: archived_job(engine, first) is not None)
    assert not worker.running and worker.wait(0)
    worker.stop()  # a second stop is harmless
    with pytest.raises(sp.ConfigurationError):
        worker.start()

    second = enqueue_committed(engine, "t", 2)
    again = sp.create_queue_worker(engine, _ok, polling_interval=0.05).start()
    try:
        assert again.running
        assert wait_for(lambda: archived_job(engine, second) is not None)
    finally:
        again.stop()
    assert not again.running
    [starting] = events(caplog.records, "queue-worker-starting")[:1]
    assert (starting.worker_id, starting.queue, starting.worker_threads) == (
        "cm-worker",
        "default",
        1,
    )
    [done] = events(caplog.records, "completed-shutdown")[:1]
    assert (done.worker_id, done.succeeded, done.failed) == ("cm-worker", 1, 0)
    assert events(caplog.records, "shutting-down")


def test_two_worker_threads_drain_fifty_jobs_each_once(engine: sa.Engine) -> None:
    with Session(engine) as session:
        ids = {sp.enqueue(session, "t", n) for n in range(50)}
        session.commit()
    runs: list[tuple[uuid.UUID, str]] = []
    lock = threading.Lock()

    def handler(job: sp.JobContext) -> None:
        with lock:
            runs.append((job.job_id, threading.current_thread().name))
        time.sleep(0.002)

    worker = sp.create_queue_worker(
        engine, handler, handler_mode="advanced", worker_threads=2, polling_interval=0.05
    )
    with running(worker):
        assert wait_for(lambda: count(engine, sp.ArchivedJob) == 50, timeout=30)
    assert sorted(job_id for job_id, _ in runs) == sorted(ids), "each job ran exactly once"
    assert {a.status for a in archived(engine)} == {"success"}
    assert jobs(engine) == []
    assert worker.summary() == {"succeeded": 50, "retried": 0, "failed": 0}
    assert {name for _, name in runs} <= {f"{worker.worker_id}-0", f"{worker.worker_id}-1"}


class _PollReads(logging.Handler):
    """Notes how often ``clock`` had been read when each poll began (the worker logs
    polling-for-jobs in its own thread just before it reads the clock for the poll)."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(logging.DEBUG)
        self.clock = clock
        self.before: list[int] = []

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "event", None) == "polling-for-jobs":
            self.before.append(self.clock.calls)


def test_polling_interval_is_the_pause_after_the_queue_is_drained(engine: sa.Engine) -> None:
    """Queued jobs run back to back; once drained the worker waits the interval (or a wake).

    The late job is due one second after the fake clock's start. The clock moves there only
    once the poll after the fifth job has read it, so that poll finds nothing due, and the
    job, due from then on, stays queued until the pause ends: here, by wake().
    """
    clock = FakeClock()
    ids = [enqueue_committed(engine, "t", n, clock=clock) for n in range(5)]
    late = enqueue_committed(engine, "t", "late", process_in=1, clock=clock)
    polls = _PollReads(clock)
    logger = logging.getLogger("sqla_proletarian")
    level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(polls)
    try:
        worker = sp.create_queue_worker(engine, _ok, polling_interval=30, clock=clock)
        with running(worker):
            assert wait_for(lambda: count(engine, sp.ArchivedJob) == 5, timeout=10)
            assert wait_for(lambda: len(polls.before) >= 6), "no poll after the fifth job"
            assert wait_for(lambda: clock.calls > polls.before[5]), "the poll never read the clock"
            clock.advance(1)
            time.sleep(0.4)
            assert archived_job(engine, late) is None, "idle worker waits its polling interval"
            assert len(polls.before) == 6, "the worker polled again during its pause"
            worker.wake()
            assert wait_for(lambda: archived_job(engine, late) is not None, timeout=5)
    finally:
        logger.removeHandler(polls)
        logger.setLevel(level)
    assert {a.job_id for a in archived(engine)} == {*ids, late}


def test_polling_interval_sets_the_rate_of_polls_on_an_empty_queue(engine: sa.Engine) -> None:
    """Without LISTEN (here poll_only; MariaDB and SQLite never have it), an idle worker polls
    once per polling interval. With LISTEN it sleeps longer: see test_idle."""
    clock = FakeClock()  # read once per poll
    worker = sp.create_queue_worker(engine, _ok, polling_interval=0.15, clock=clock, poll_only=True)
    with running(worker):
        assert wait_for(lambda: clock.calls >= 1), "the worker never polled"
        first = clock.calls  # counted from the first poll: start-up is not the interval
        time.sleep(0.6)
        polls = clock.calls - first
    assert 2 <= polls <= 6, f"{polls} polls in 0.6 s at one per 0.15 s"


def test_stop_lets_a_running_job_finish_then_calls_on_shutdown_once(engine: sa.Engine) -> None:
    job_id = enqueue_committed(engine, "slow", None)
    started = threading.Event()
    shutdowns: list[str | None] = []

    def handler(job_type: str, payload: Any) -> None:
        started.set()
        time.sleep(0.6)

    def on_shutdown() -> None:
        done = archived_job(engine, job_id)
        shutdowns.append(done.status if done else None)

    worker = sp.create_queue_worker(engine, handler, polling_interval=0.05, on_shutdown=on_shutdown)
    worker.start()
    try:
        assert started.wait(10)
        began = time.monotonic()
        worker.stop()
        waited = time.monotonic() - began
    finally:
        worker.stop()
    assert 0.3 < waited < 5, waited
    assert worker.unfinished == 0, "the running job finished: the stop gave up on none"
    assert shutdowns == ["success"], "on_shutdown once, after the job was archived"
    done = archived_job(engine, job_id)
    assert done is not None and (done.status, done.attempts) == ("success", 1)
    assert worker.summary() == {"succeeded": 1, "retried": 0, "failed": 0}


def test_await_termination_timeout_bounds_the_wait_for_running_jobs(
    engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sqla_proletarian")
    job_id = enqueue_committed(engine, "stuck", None)
    started, release = threading.Event(), threading.Event()
    shutdowns: list[int] = []

    def handler(job_type: str, payload: Any) -> None:
        started.set()
        release.wait(20)

    worker = sp.create_queue_worker(
        engine,
        handler,
        polling_interval=0.05,
        await_termination_timeout=0.3,
        on_shutdown=lambda: shutdowns.append(1),
    )
    worker.start()
    try:
        assert started.wait(10)
        began = time.monotonic()
        worker.stop()
        waited = time.monotonic() - began
        assert 0.25 <= waited < 3, waited
        assert shutdowns == [1]
        assert worker.unfinished == 1, "the stop gave up on the running job"
        [timeout] = events(caplog.records, "queue-worker-shutdown-timeout")
        assert timeout.worker_id == worker.worker_id
    finally:
        release.set()
    # The job was not abandoned half-way: released, it finishes and is archived once.
    assert wait_for(lambda: archived_job(engine, job_id) is not None)
    assert count(engine, sp.Job) == 0
    assert wait_for(_all_connections_returned(engine))


def test_await_termination_timeout_bounds_the_whole_wait_with_several_threads(
    engine: sa.Engine, backend: str
) -> None:
    """Two threads stuck in jobs: stop() still returns after one timeout, not one per thread.

    On SQLite the second thread waits for the claim lock; after stop() it starts no job.
    """
    for n in range(2):
        enqueue_committed(engine, "stuck", n)
    started, release = threading.Semaphore(0), threading.Event()

    def handler(job_type: str, payload: Any) -> None:
        started.release()
        release.wait(20)

    worker = sp.create_queue_worker(
        engine, handler, worker_threads=2, polling_interval=0.05, await_termination_timeout=0.6
    )
    worker.start()
    try:
        # SQLite runs one job at a time per file: the second thread waits for the lock.
        for _ in range(1 if backend == "sqlite" else 2):
            assert started.acquire(timeout=10)
        began = time.monotonic()
        worker.stop()
        waited = time.monotonic() - began
    finally:
        release.set()
    running = 1 if backend == "sqlite" else 2
    assert worker.unfinished == running
    assert wait_for(lambda: count(engine, sp.ArchivedJob) == running)
    assert count(engine, sp.Job) == 2 - running
    assert wait_for(_all_connections_returned(engine))
    assert waited < 1.0, f"stop() took {waited:.2f} s with await_termination_timeout=0.6"


def test_summary_counts_match_the_outcomes(engine: sa.Engine) -> None:
    for job_type in ("ok", "ok", "flaky", "bad"):
        enqueue_committed(engine, job_type, None)
    flaky_runs: list[int] = []

    def handler(job: sp.JobContext) -> None:
        if job.job_type == "bad":
            raise RuntimeError("always")
        if job.job_type == "flaky":
            flaky_runs.append(job.attempts)
            if job.attempts == 1:
                raise RuntimeError("once")

    worker = sp.create_queue_worker(
        engine,
        handler,
        handler_mode="advanced",
        polling_interval=0.05,
        retry_strategy=lambda job, exc: sp.RetryStrategy(1) if job.job_type == "flaky" else None,
    )
    with running(worker):
        assert wait_for(lambda: count(engine, sp.ArchivedJob) == 4)
    assert worker.summary() == {"succeeded": 3, "retried": 1, "failed": 1}
    assert worker.summary_text() == "3 succeeded, 1 retried, 1 failed"
    statuses = sorted(a.status for a in archived(engine))
    assert statuses == ["failure", "success", "success", "success"]
    assert flaky_runs == [1, 2]


def test_a_worker_only_takes_jobs_of_its_own_queue_compared_exactly(engine: sa.Engine) -> None:
    """A worker on queue 'a' never takes 'b', 'A' or 'á' jobs, on every backend."""
    mine = enqueue_committed(engine, "t", None, queue="a")
    others = {enqueue_committed(engine, "t", None, queue=name): name for name in ("b", "A", "á")}
    taken: list[str] = []
    worker = sp.create_queue_worker(
        engine, lambda job: taken.append(job.queue), handler_mode="advanced", queue="a"
    )
    with running(worker):
        assert wait_for(lambda: archived_job(engine, mine) is not None)
    assert taken == ["a"]
    assert {row.job_id: row.queue for row in jobs(engine)} == others
    # Nothing is locked now: a poll of 'a' that matched 'b', 'A' or 'á' would claim it.
    assert not sp.process_next_job(engine, _ok, queue="a")
    assert sp.process_next_job(engine, _ok, queue="A")
    assert not sp.process_next_job(engine, _ok, queue="a")
    assert sorted(row.queue for row in jobs(engine)) == ["b", "á"]


def test_queue_names_differing_in_trailing_spaces_are_different_queues(
    engine: sa.Engine,
) -> None:
    spaced = enqueue_committed(engine, "t", None, queue="a ")
    plain = enqueue_committed(engine, "t", None, queue="a")
    taken: list[str] = []
    assert sp.process_next_job(
        engine, lambda job: taken.append(job.queue), handler_mode="advanced", queue="a"
    )
    assert not sp.process_next_job(engine, _ok, queue="a")
    assert taken == ["a"]
    assert archived_job(engine, plain) is not None
    [left] = jobs(engine)
    assert (left.job_id, left.queue) == (spaced, "a ")


def test_an_unknown_worker_option_is_a_configuration_error(engine: sa.Engine) -> None:
    """The refusal comes before any claim: a due job stays queued, untouched (a mistyped
    keyword of create_queue_worker is Python's TypeError, naming the function)."""
    job_id = enqueue_committed(engine, "t", None)
    with pytest.raises(TypeError, match=r"create_queue_worker\(\).*'polling_intervall'"):
        sp.create_queue_worker(engine, _ok, polling_intervall=1)  # type: ignore[call-arg]
    with pytest.raises(sp.ConfigurationError, match="retry_strategy_fn"):
        sp.process_next_job(engine, _ok, retry_strategy_fn=None)
    with pytest.raises(sp.ConfigurationError, match="handler_mode"):
        sp.create_queue_worker(engine, _ok, handler_mode="fancy")
    [row] = jobs(engine)
    assert (row.job_id, row.attempts) == (job_id, 0), "a refused worker ran nothing"
    assert archived(engine) == []


def test_install_signal_handlers_outside_the_main_thread_is_refused(engine: sa.Engine) -> None:
    errors: list[BaseException] = []

    def build() -> None:
        try:
            worker = sp.create_queue_worker(engine, _ok, install_signal_handlers=True)
        except BaseException as exc:
            errors.append(exc)
        else:
            worker.stop()

    thread = threading.Thread(target=build)
    thread.start()
    thread.join(10)
    [error] = errors
    assert isinstance(error, sp.ConfigurationError)
    assert "main thread" in str(error)
