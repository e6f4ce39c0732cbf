"""This library's contenders: the queue worker's drain (threads, batches, processes), its
enqueue paths, and its idle latency."""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import sqla_proletarian as sp
from benchmarks import server_work
from benchmarks.fill import check_drained, fill, fresh_tables
from benchmarks.job import JOB_TYPE, PAYLOAD, PAYLOAD_TEXT
from benchmarks.procs import Crew, Crews, sample_latencies

THREADS = 4
#: What a drain must never show, counted over its rounds: a job's handler run more than once,
#: a job transaction the library logged as lost, a deadlock the server detected.
PROBLEMS = ("extra runs", "job-transaction-lost", "deadlocks")


class NotAvailable(Exception):
    """The library does not have this yet; the row shows n/a."""


class EventCounter(logging.Handler):
    """Counts the library's warnings and errors by event name instead of printing them."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.counts: Counter[str] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        self.counts[str(getattr(record, "event", record.getMessage()))] += 1
        # SP_BENCH_EVENTS=FILE keeps the records too, to look into what was counted.
        kept = os.environ.get("SP_BENCH_EVENTS")
        if kept:
            with open(kept, "a", encoding="utf-8") as out:
                out.write(record.getMessage() + "\n")


EVENTS = EventCounter()


def count_events() -> None:
    """Send the library's log to ``EVENTS`` (the worker processes' log is dropped)."""
    logger = logging.getLogger("sqla_proletarian")
    logger.addHandler(EVENTS)
    logger.propagate = False


def noop(job_type: str, payload: Any) -> None:
    """The handler every contender runs: nothing."""


def worker(engine: sa.Engine, handler: Any = noop, **options: Any) -> sp.QueueWorker:
    """A worker with 4 threads; an option the library does not know yet is NotAvailable."""
    try:
        return sp.create_queue_worker(engine, handler, worker_threads=THREADS, **options)
    except sp.ConfigurationError as exc:
        if "unknown worker option" in str(exc):
            raise NotAvailable("n/a (not yet available)") from exc
        raise


def has_batches(engine: sa.Engine) -> bool:
    try:
        worker(engine, batch_size=2)
    except NotAvailable:
        return False
    return True


def run_until(queue_worker: sp.QueueWorker, jobs: int, timeout: float = 600.0) -> float:
    """Seconds from start() until the worker has run ``jobs`` jobs (then it stops)."""
    started = time.perf_counter()
    with queue_worker:
        while (summary := queue_worker.summary())["succeeded"] < jobs:
            stalled = time.perf_counter() - started > timeout
            if summary["failed"] or summary["retried"] or not queue_worker.running or stalled:
                raise RuntimeError(
                    f"the worker stopped, stalled or failed jobs: {summary} of {jobs} jobs"
                    f" (exception: {queue_worker.exception!r}; errors in proletarian_archived_job)"
                )
            time.sleep(0.002)
        return time.perf_counter() - started


def drain(engine: sa.Engine, jobs: int, **options: Any) -> float:
    """Jobs/s of one in-process worker (4 threads) over a queue of ``jobs``."""
    queue_worker = worker(engine, **options)
    fresh_tables(engine)
    fill(engine, jobs)
    with server_work.metered(engine.url, jobs):
        elapsed = run_until(queue_worker, jobs)
    check_drained(engine, jobs, f"sqla-proletarian {options}")
    return jobs / elapsed


@dataclass
class Drained:
    """A drain's jobs/s and its ``PROBLEMS`` counted (the server's deadlocks by the caller)."""

    rate: float
    counts: Counter[str] = field(default_factory=Counter)


class RunCounter:
    """A no-op handler (advanced mode) that counts its runs by job id."""

    def __init__(self) -> None:
        self.runs: Counter[str] = Counter()
        self._lock = threading.Lock()

    def __call__(self, job: sp.JobContext) -> None:
        with self._lock:
            self.runs[job.job_id.hex] += 1


def problems(runs: Counter[str], logged: Counter[str]) -> Counter[str]:
    """The extra handler runs (a job run more than once) and the lost job transactions."""
    return Counter(
        {
            "extra runs": sum(runs.values()) - len(runs),
            "job-transaction-lost": logged["job-transaction-lost"],
        }
    )


def drain_counted(engine: sa.Engine, jobs: int, **options: Any) -> Drained:
    """``drain``, with each job's handler runs and the library's lost transactions counted."""
    runs = RunCounter()
    queue_worker = worker(engine, runs, handler_mode="advanced", **options)
    fresh_tables(engine)
    fill(engine, jobs)
    before = Counter(EVENTS.counts)
    with server_work.metered(engine.url, jobs):
        elapsed = run_until(queue_worker, jobs)
    check_drained(engine, jobs, f"sqla-proletarian {options}")
    return Drained(jobs / elapsed, problems(runs.runs, EVENTS.counts - before))


def _drain_child(crew: Crew, url: str, options: dict[str, Any]) -> None:
    count_events()
    engine = sa.create_engine(url, pool_size=2 * THREADS + 2)
    runs = RunCounter()
    queue_worker = worker(engine, runs, handler_mode="advanced", **options)
    crew.ready_and_wait()
    with queue_worker:
        while not crew.stop.wait(0.002):
            crew.count.value = queue_worker.summary()["succeeded"]
    crew.report("counts", dict(runs.runs), dict(EVENTS.counts))


def drain_processes(
    engine: sa.Engine, url: str, jobs: int, processes: int, **options: Any
) -> Drained:
    """Jobs/s of ``processes`` worker processes, each with 4 threads, and what they counted."""
    worker(engine, **options)  # NotAvailable before any process starts
    name = f"sqla-proletarian, {processes} processes"
    return _crews_drain(engine, url, jobs, processes, _drain_child, options, name)


def _crews_drain(
    engine: sa.Engine,
    url: str,
    jobs: int,
    processes: int,
    child: Any,
    options: dict[str, Any],
    name: str,
) -> Drained:
    """Fill a queue of ``jobs``, drain it with ``processes`` processes running ``child`` on
    ``url``, metered; the jobs/s and what the processes counted."""
    fresh_tables(engine)
    fill(engine, jobs)
    runs: Counter[str] = Counter()
    logged: Counter[str] = Counter()
    with server_work.metered(engine.url, jobs), Crews(processes, child, url, options) as crews:
        elapsed = crews.wait_count(jobs)
        crews.stop.set()
        for _ in range(processes):
            _, counted, events = crews.next_report(120)
            runs.update(counted)
            logged.update(events)
    check_drained(engine, jobs, name)
    return Drained(jobs / elapsed, problems(runs, logged))


def async_url(url: str) -> str:
    """The URL of the same database through asyncpg (the asyncio worker's driver here)."""
    return sa.make_url(url).set(drivername="postgresql+asyncpg").render_as_string(False)


async def _async_drain(crew: Crew, url: str, options: dict[str, Any]) -> None:
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = create_async_engine(url, pool_size=2 * THREADS + 2)
    runs = RunCounter()

    async def handler(job: sp.AsyncJobContext) -> None:
        runs(job)  # type: ignore[arg-type]

    queue_worker = sp.create_async_queue_worker(
        engine, handler, handler_mode="advanced", concurrency=THREADS, **options
    )
    await asyncio.to_thread(crew.ready_and_wait)
    async with queue_worker:
        while not crew.stop.is_set():
            crew.count.value = queue_worker.summary()["succeeded"]
            if not queue_worker.running:
                raise RuntimeError(f"the asyncio worker stopped: {queue_worker.exception!r}")
            await asyncio.sleep(0.002)
    await engine.dispose()
    crew.report("counts", dict(runs.runs), dict(EVENTS.counts))


def _async_drain_child(crew: Crew, url: str, options: dict[str, Any]) -> None:
    count_events()
    asyncio.run(_async_drain(crew, url, options))


def drain_async_processes(
    engine: sa.Engine, url: str, jobs: int, processes: int, **options: Any
) -> Drained:
    """Jobs/s of ``processes`` processes each running the asyncio worker on asyncpg
    (``concurrency`` 4, the threads of the threaded rows), and what they counted."""
    if not hasattr(sp, "create_async_queue_worker"):
        raise NotAvailable("n/a (no asyncio worker)")
    name = f"sqla-proletarian asyncio worker, {processes} processes"
    return _crews_drain(engine, async_url(url), jobs, processes, _async_drain_child, options, name)


def enqueue_many(engine: sa.Engine, jobs: int) -> float:
    """Jobs/s of ``sp.enqueue_many`` in one transaction."""
    if not hasattr(sp, "enqueue_many"):
        raise NotAvailable("n/a (not yet available)")
    fresh_tables(engine)
    pairs = [(JOB_TYPE, PAYLOAD) for _ in range(jobs)]
    started = time.perf_counter()
    with engine.begin() as conn:
        sp.enqueue_many(conn, pairs)
    return jobs / (time.perf_counter() - started)


def enqueue_per_connection(engine: sa.Engine, jobs: int) -> float:
    """Jobs/s of ``sp.enqueue(connection, ...)`` and a commit per job, one thread."""
    fresh_tables(engine)
    started = time.perf_counter()
    for _ in range(jobs):
        with engine.begin() as conn:
            sp.enqueue(conn, JOB_TYPE, PAYLOAD)
    return jobs / (time.perf_counter() - started)


def enqueue_per_session(engine: sa.Engine, jobs: int) -> float:
    """Jobs/s of ``sp.enqueue(session, ...)`` and ``session.commit()`` per job, one thread."""
    fresh_tables(engine)
    started = time.perf_counter()
    for _ in range(jobs):
        with Session(engine) as session:
            sp.enqueue(session, JOB_TYPE, PAYLOAD)
            session.commit()
    return jobs / (time.perf_counter() - started)


class _Base(DeclarativeBase):
    pass


class PlainRow(_Base):
    """An application's own row, the size and shape of a job (same columns and indexes)."""

    __tablename__ = "bench_plain_row"
    __table_args__ = (sa.Index("ix_bench_plain_row_poll", "queue", "process_at", "seq"),)

    seq: Mapped[int] = mapped_column(sa.BigInteger(), primary_key=True, autoincrement=True)
    job_id: Mapped[uuid.UUID] = mapped_column(sa.Uuid(), unique=True)
    queue: Mapped[str] = mapped_column(sa.String(255))
    job_type: Mapped[str] = mapped_column(sa.String(255))
    payload: Mapped[str] = mapped_column(sa.Text())
    attempts: Mapped[int] = mapped_column(sa.Integer())
    enqueued_at: Mapped[datetime] = mapped_column(sa.DateTime(timezone=True))
    process_at: Mapped[datetime] = mapped_column(sa.DateTime(timezone=True))


def plain_row_per_session(engine: sa.Engine, jobs: int) -> float:
    """Rows/s of the same Session loop adding a plain ORM row instead of a job."""
    _Base.metadata.drop_all(engine)
    _Base.metadata.create_all(engine)
    started = time.perf_counter()
    for _ in range(jobs):
        with Session(engine) as session:
            now = datetime.now(UTC)
            session.add(
                PlainRow(
                    job_id=uuid.uuid4(),
                    queue="default",
                    job_type=JOB_TYPE,
                    payload=PAYLOAD_TEXT,
                    attempts=0,
                    enqueued_at=now,
                    process_at=now,
                )
            )
            session.commit()
    elapsed = time.perf_counter() - started
    _Base.metadata.drop_all(engine)
    return jobs / elapsed


def _serve_child(crew: Crew, url: str, options: dict[str, Any]) -> None:
    count_events()
    engine = sa.create_engine(url, pool_size=2 * THREADS + 2)

    def handler(job_type: str, payload: Any) -> None:
        crew.report("start", payload["n"], time.monotonic())

    with worker(engine, handler, **options):
        crew.ready_and_wait()
        crew.stop.wait()


def _enqueuer(engine: sa.Engine) -> Callable[[int], None]:
    def enqueue(n: int) -> None:
        with engine.begin() as conn:
            sp.enqueue(conn, JOB_TYPE, {"n": n})

    return enqueue


def idle_latency(engine: sa.Engine, url: str, samples: int, **options: Any) -> list[float]:
    """Seconds from an enqueue's commit to its handler's start, on an idle worker (4 threads)
    in another process (``sample_latencies``)."""
    worker(engine, **options)  # NotAvailable before the process starts
    fresh_tables(engine)
    with Crews(1, _serve_child, url, options) as crews:
        return sample_latencies(_enqueuer(engine), crews.next_start, samples)


def idle_latency_in_process(engine: sa.Engine, samples: int) -> list[float]:
    """The same with the worker in the enqueuing process."""
    fresh_tables(engine)
    starts: queue.SimpleQueue[tuple[int, float]] = queue.SimpleQueue()

    def handler(job_type: str, payload: Any) -> None:
        starts.put((payload["n"], time.monotonic()))

    with worker(engine, handler):
        return sample_latencies(_enqueuer(engine), lambda: starts.get(timeout=30), samples)
