"""How the library behaves at scale: a deep queue, dead index entries at the head of the
queue, and a worker process's memory over many jobs."""

from __future__ import annotations

import resource
import time
from typing import Any

import sqlalchemy as sa

import sqla_proletarian as sp
from benchmarks.fill import fill, fresh_tables
from benchmarks.library import THREADS, count_events, run_until, worker
from benchmarks.procs import Crew, Crews
from sqla_proletarian import statements as sql
from sqla_proletarian.execution import poll_due_jobs


def deep_queue(engine: sa.Engine, jobs: int) -> None:
    """Fresh tables holding ``jobs`` due jobs, with fresh statistics."""
    fresh_tables(engine)
    fill(engine, jobs, analyze=True)


def head_drain(engine: sa.Engine, head: int) -> float:
    """Jobs/s of a worker at its defaults (4 threads) over the first ``head`` jobs of the
    queue, whatever its depth."""
    return head / run_until(worker(engine), head)


def polls_per_second(engine: sa.Engine, seconds: float) -> float:
    """The worker's poll (the priorities with a due job, then SELECT ... FOR UPDATE SKIP
    LOCKED of each one's due jobs, with the crash ledger's count), each in its own
    transaction, in one thread, after 100 to warm up."""

    def poll() -> None:
        with conn.begin():
            poll_due_jobs(conn, sp.DEFAULT_QUEUE, sp.utc_now(), 1, with_runs=True)

    with engine.connect() as conn:
        for _ in range(100):
            poll()
        polls, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            poll()
            polls += 1
        return polls / (time.perf_counter() - started)


_HOLD_SNAPSHOT = {
    "postgresql": ("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ", "SELECT 1"),
    "mysql": ("START TRANSACTION WITH CONSISTENT SNAPSHOT",),
}


def dead_index_polls(engine: sa.Engine, deletes: int, seconds: float) -> dict[str, float]:
    """Polls/s of an empty queue: fresh; after ``deletes`` jobs were queued and deleted while
    an older transaction stayed open (no cleanup can happen); and once it has ended, with
    no vacuum (PostgreSQL's autovacuum off for the table; MariaDB purges in the background)."""
    fresh_tables(engine)
    if engine.dialect.name == "postgresql":
        with engine.begin() as conn:
            conn.exec_driver_sql("ALTER TABLE proletarian_job SET (autovacuum_enabled = false)")
    before = polls_per_second(engine, seconds)
    fill(engine, deletes)
    with engine.connect() as old:
        raw = old.connection.dbapi_connection
        assert raw is not None
        cursor = raw.cursor()
        for statement in _HOLD_SNAPSHOT[engine.dialect.name]:
            cursor.execute(statement)
        with engine.begin() as conn:
            conn.execute(sa.delete(sql.JOB))
        held = polls_per_second(engine, seconds)
        raw.rollback()
    after = polls_per_second(engine, seconds)
    return {"fresh": before, "held": held, "after": after}


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _memory_child(
    crew: Crew, url: str, options: dict[str, Any], checkpoints: list[int], seconds: float
) -> None:
    count_events()
    engine = sa.create_engine(url, pool_size=2 * THREADS + 2)
    queue_worker = worker(engine, **options)
    crew.ready_and_wait()
    deadline = time.monotonic() + seconds
    with queue_worker:
        crew.report("rss", 0, _peak_rss_mib())
        for checkpoint in checkpoints:
            while queue_worker.summary()["succeeded"] < checkpoint:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            crew.report("rss", queue_worker.summary()["succeeded"], _peak_rss_mib())
    crew.report("done")


def peak_rss(
    engine: sa.Engine, url: str, checkpoints: list[int], seconds: float, **options: Any
) -> list[tuple[int, float]]:
    """A worker process's peak RSS (MiB) at its start and once it has run each checkpoint's
    number of jobs (or when ``seconds`` have passed): (jobs run, MiB) pairs."""
    worker(engine, **options)
    deep_queue(engine, checkpoints[-1])
    readings = []
    with Crews(1, _memory_child, url, options, checkpoints, seconds) as crews:
        while True:
            kind, *rest = crews.next_report(seconds + 120)
            if kind == "done":
                return readings
            readings.append((rest[0], rest[1]))
