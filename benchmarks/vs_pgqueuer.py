"""pgqueuer (PostgreSQL only), through asyncpg (its quick start's driver) or psycopg 3.

Its worker is asyncio: a QueueManager claims up to ``batch_size`` jobs per dequeue (marking
them picked, committed at once), runs each as a task, and logs their ends in batches (the
same statement deletes them from the queue). Its defaults, as its quick start runs it:
asyncpg, ``batch_size=10``, one process, LISTEN/NOTIFY for new jobs, tables LOGGED.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import asyncpg
import psycopg
from pgqueuer import AsyncpgDriver, PsycopgDriver, Queries, QueueManager
from pgqueuer.db import SyncPsycopgDriver
from pgqueuer.models import Job
from pgqueuer.queries import SyncQueries

from benchmarks import server_work
from benchmarks.job import JOB_TYPE, PAYLOAD_TEXT
from benchmarks.procs import Crew, Crews, sample_latencies

DEFAULTS = {"driver": "asyncpg", "batch_size": 10, "processes": 1}
#: The share of benchmarks.run's jobs it drains: all (see vs_procrastinate).
SHARE = 1
#: The tuning sweep: every combination is drained once, and the fastest is "tuned".
SWEEP = {"driver": ("asyncpg", "psycopg"), "batch_size": (10, 50, 100, 200), "processes": (1, 2)}


async def _driver(dsn: str, driver: str) -> Any:
    if driver == "asyncpg":
        return AsyncpgDriver(await asyncpg.connect(dsn))
    return PsycopgDriver(await psycopg.AsyncConnection.connect(dsn, autocommit=True))


async def _fill(dsn: str, jobs: int) -> float:
    connection = await asyncpg.connect(dsn)
    queries = Queries(AsyncpgDriver(connection))
    if await queries.schema_is_installed():
        await queries.uninstall()
    await queries.install()
    started = time.perf_counter()
    if jobs:
        await queries.enqueue([JOB_TYPE] * jobs, [PAYLOAD_TEXT.encode()] * jobs, [0] * jobs)
    elapsed = time.perf_counter() - started
    await connection.close()
    return jobs / elapsed


def fill(dsn: str, jobs: int) -> float:
    """Fresh tables, then ``jobs`` queued by its bulk enqueue (one call, through asyncpg);
    jobs/s of that call."""
    return asyncio.run(_fill(dsn, jobs))


def _manager(driver: Any, on_start: Callable[[Job], object] | None = None) -> QueueManager:
    manager = QueueManager(Queries(driver))

    @manager.entrypoint(JOB_TYPE)
    async def noop(job: Job) -> None:
        if on_start is not None:
            on_start(job)

    return manager


async def _serve(crew: Crew, dsn: str, driver: str, batch_size: int, report: bool) -> None:
    def started(job: Job) -> None:
        crew.report("start", json.loads(job.payload or b"{}")["n"], time.monotonic())

    manager = _manager(await _driver(dsn, driver), started if report else None)
    await asyncio.to_thread(crew.ready_and_wait)

    async def stop_when_told() -> None:
        await asyncio.to_thread(crew.stop.wait)
        manager.shutdown.set()

    stopper = asyncio.create_task(stop_when_told())
    await manager.run(batch_size=batch_size)
    await stopper


def _serve_child(crew: Crew, dsn: str, driver: str, batch_size: int, report: bool) -> None:
    asyncio.run(_serve(crew, dsn, driver, batch_size, report))


def drain(dsn: str, jobs: int, driver: str, batch_size: int, processes: int) -> float:
    """Jobs/s of ``processes`` QueueManagers over a queue of ``jobs``, until the database
    has every job logged successful (and so gone from the queue)."""
    fill(dsn, jobs)
    with psycopg.connect(dsn, autocommit=True) as conn:

        def drained() -> bool:
            done = conn.execute("SELECT count(*) FROM pgqueuer_log WHERE status = 'successful'")
            return done.fetchone() == (jobs,)

        with (
            server_work.metered(dsn, jobs),
            Crews(processes, _serve_child, dsn, driver, batch_size, False, linger=1) as crews,
        ):
            elapsed = crews.wait_until(drained)
        left = conn.execute("SELECT count(*) FROM pgqueuer").fetchone()
    if left != (0,):
        raise RuntimeError(f"pgqueuer: {left} jobs left after all were logged successful")
    return jobs / elapsed


def idle_latency(dsn: str, samples: int, driver: str = "asyncpg") -> list[float]:
    """Seconds from an enqueue's commit to its handler's start, on an idle worker at its
    defaults (``sample_latencies``)."""
    fill(dsn, 0)
    with (
        Crews(1, _serve_child, dsn, driver, DEFAULTS["batch_size"], True, linger=1) as crews,
        psycopg.connect(dsn, autocommit=True) as conn,
    ):
        queries = SyncQueries(SyncPsycopgDriver(conn))

        def enqueue(n: int) -> None:
            queries.enqueue(JOB_TYPE, json.dumps({"n": n}).encode())

        return sample_latencies(enqueue, crews.next_start, samples)
