"""Concurrent workers: real threads and connections race for jobs, and no job runs twice.

Each handler also inserts the job id into a ``seen`` table (job id as primary key) through
``job.session``, the job's own transaction: a second run of a job would fail there, and a
run that does not commit leaves no row behind.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

import sqla_proletarian as sp
from sqla_proletarian import statements
from sqla_proletarian.execution import poll_due_jobs

SEEN_METADATA = sa.MetaData()
SEEN = sa.Table(
    "seen",
    SEEN_METADATA,
    sa.Column("job_id", sa.Uuid(), primary_key=True),
    sa.Column("thread", sa.String(255), nullable=False),
)

#: Longest a test waits for its jobs to be done.
DEADLINE = 60.0

#: Make a claim that waits for a locked row fail within two seconds (session settings).
LOCK_TIMEOUT = {
    "postgresql": "SET lock_timeout = '2s'",
    "mariadb": "SET SESSION innodb_lock_wait_timeout = 2",
}


class Recorder:
    """An advanced-mode handler that records each run, in memory and in the ``seen`` table."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.runs: list[uuid.UUID] = []
        self.threads: set[str] = set()

    def __call__(self, job: sp.JobContext) -> None:
        thread = threading.current_thread().name
        with self.lock:
            self.runs.append(job.job_id)
            self.threads.add(thread)
        job.session.execute(sa.insert(SEEN).values(job_id=job.job_id, thread=thread))


def enqueue_jobs(engine: sa.Engine, count: int, queue: str = sp.DEFAULT_QUEUE) -> set[uuid.UUID]:
    with Session(engine) as session:
        ids = {sp.enqueue(session, "work", {"n": n}, queue=queue) for n in range(count)}
        session.commit()
    return ids


def count(engine: sa.Engine, table: sa.Table | type[Any]) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one())


def wait_until(condition: Callable[[], bool], what: str, timeout: float = DEADLINE) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting until {what}")
        time.sleep(0.05)


def assert_each_job_ran_once(engine: sa.Engine, ids: set[uuid.UUID], recorder: Recorder) -> None:
    assert len(recorder.runs) == len(set(recorder.runs)), "a job ran twice"
    assert set(recorder.runs) == ids
    with engine.connect() as conn:
        archived = conn.execute(
            sa.select(statements.ARCHIVE.c.job_id, statements.ARCHIVE.c.status).add_columns(
                statements.ARCHIVE.c.attempts
            )
        ).all()
        seen = set(conn.execute(sa.select(SEEN.c.job_id)).scalars())
    assert {row.job_id for row in archived} == ids
    assert {(row.status, row.attempts) for row in archived} == {("success", 1)}
    assert seen == ids
    assert count(engine, sp.Job) == 0
    assert count(engine, sp.JobRun) == 0


def drain(engine: sa.Engine, ids: set[uuid.UUID], workers: list[sp.QueueWorker]) -> None:
    for worker in workers:
        worker.start()
    try:
        wait_until(lambda: count(engine, sp.ArchivedJob) >= len(ids), "all jobs are archived")
    finally:
        for worker in workers:
            worker.stop()


@pytest.fixture
def seen_engine(engine: sa.Engine) -> sa.Engine:
    SEEN_METADATA.create_all(engine)
    return engine


def test_two_worker_threads_drain_a_thousand_jobs_and_run_none_twice(
    seen_engine: sa.Engine, backend: str
) -> None:
    """On SQLite, whose claims serialise, a smaller run shows two threads never share a job."""
    engine = seen_engine
    jobs = 100 if backend == "sqlite" else 1000
    ids = enqueue_jobs(engine, jobs)
    recorder = Recorder()
    worker = sp.create_queue_worker(
        engine, recorder, worker_threads=2, polling_interval=0.01, handler_mode="advanced"
    )
    drain(engine, ids, [worker])
    assert_each_job_ran_once(engine, ids, recorder)
    assert worker.summary() == {"succeeded": jobs, "retried": 0, "failed": 0}
    if backend != "sqlite":
        # On SQLite the thread that just committed usually takes the write lock again before
        # the waiting one wakes from its busy wait: the jobs run one at a time either way.
        assert len(recorder.threads) == 2, "both threads should have run jobs"


def test_two_queue_workers_of_two_threads_each_share_a_queue_and_run_no_job_twice(
    seen_engine: sa.Engine, backend: str
) -> None:
    if backend == "sqlite":
        pytest.skip("SQLite runs one job at a time per database file; covered by the test above")
    engine = seen_engine
    ids = enqueue_jobs(engine, 400)
    recorder = Recorder()
    workers = [
        sp.create_queue_worker(
            engine,
            recorder,
            worker_threads=2,
            polling_interval=0.01,
            handler_mode="advanced",
            worker_id=f"worker-{n}",
        )
        for n in range(2)
    ]
    drain(engine, ids, workers)
    assert_each_job_ran_once(engine, ids, recorder)
    assert sum(worker.summary()["succeeded"] for worker in workers) == 400
    assert all(worker.summary()["succeeded"] > 0 for worker in workers)


def test_open_claims_on_separate_connections_skip_each_others_locked_jobs(
    engine: sa.Engine, backend: str
) -> None:
    """The poll itself: each open transaction gets the next unlocked job, in enqueue order.

    A short lock timeout turns a poll that waits for another claim's row lock (no SKIP
    LOCKED) into a prompt failure instead of a hang until the test timeout.
    """
    if backend == "sqlite":
        pytest.skip("SQLite has no row locks: a claim takes the whole database (BEGIN IMMEDIATE)")
    ordered = [next(iter(enqueue_jobs(engine, 1))) for _ in range(4)]
    connections = [engine.connect() for _ in range(5)]
    claimed: list[uuid.UUID | None] = []
    try:
        for conn in connections:
            conn.execution_options(isolation_level="READ COMMITTED")
            conn.begin()
            conn.exec_driver_sql(LOCK_TIMEOUT[backend])
            rows = poll_due_jobs(conn, sp.DEFAULT_QUEUE, sp.utc_now(), 1, with_runs=False)
            claimed.append(rows[0]["job_id"] if rows else None)
    finally:
        for conn in connections:
            conn.rollback()
            conn.close()
    assert claimed == [*ordered, None]


def test_concurrent_process_next_job_calls_run_jobs_side_by_side_and_none_twice(
    database: Any, backend: str
) -> None:
    """Eight callers, each on its own engine, race for three jobs at the same moment.

    Every handler waits until all three jobs are running at once, which happens only if the
    claims skip the locked rows instead of queueing behind them.
    """
    if backend == "sqlite":
        pytest.skip("SQLite runs one job at a time per database file (BEGIN IMMEDIATE)")
    setup = database.engine()
    SEEN_METADATA.create_all(setup)
    ids = enqueue_jobs(setup, 3)
    all_running = threading.Barrier(3, timeout=10)
    recorder = Recorder()

    def handler(job: sp.JobContext) -> None:
        recorder(job)
        all_running.wait()

    callers = 8
    start = threading.Barrier(callers, timeout=10)
    results: list[bool] = []
    errors: list[BaseException] = []
    engines = [database.engine(poolclass=sa.pool.NullPool) for _ in range(callers)]

    def call(engine: sa.Engine) -> None:
        try:
            start.wait()
            results.append(sp.process_next_job(engine, handler, handler_mode="advanced"))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(engine,)) for engine in engines]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors
    assert sorted(results) == [False] * (callers - 3) + [True] * 3
    assert_each_job_ran_once(setup, ids, recorder)
