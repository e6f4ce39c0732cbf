"""procrastinate (PostgreSQL only), through its PsycopgConnector (psycopg 3).

Its worker is asyncio: each of ``concurrency`` slots fetches one job (a transaction that
marks it doing), runs it, and finishes it (a second transaction). Its defaults:
``concurrency=1``, one process, LISTEN/NOTIFY for new jobs, jobs kept after they finish
(``delete_jobs="never"``), a psycopg pool of 4 connections (one of them listens).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import procrastinate
import psycopg

from benchmarks import server_work
from benchmarks.job import JOB_TYPE, PAYLOAD
from benchmarks.procs import Crew, Crews, sample_latencies

DEFAULTS = {"concurrency": 1, "processes": 1}
#: benchmarks.run has it drain a quarter of the jobs the others drain (in the rounds and in
#: the sweep): at its speed (hundreds of jobs/s) that still takes many seconds, and it keeps
#: ``make bench`` under 45 minutes.
SHARE = 4
#: The tuning sweep: every combination is drained once, and the fastest is "tuned". The pool
#: is sized to the concurrency (``max_size = concurrency + 2``), else slots wait for it.
SWEEP = {"concurrency": (4, 16, 32), "processes": (1, 2)}
TABLES = (
    "procrastinate_jobs, procrastinate_events, procrastinate_periodic_defers, procrastinate_workers"
)


def _app(dsn: str, concurrency: int = 1, on_start: Callable[[int], object] | None = None) -> Any:
    """An App with the no-op task; a concurrency above 1 gets a pool that size."""
    pool = {} if concurrency == 1 else {"min_size": 2, "max_size": concurrency + 2}
    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=dsn, **pool))

    @app.task(name=JOB_TYPE)
    async def noop(n: int) -> None:
        if on_start is not None:
            on_start(n)

    return app


def install(dsn: str) -> None:
    """procrastinate's schema, in a database of its own (once)."""
    with psycopg.connect(dsn) as conn:
        if conn.execute("SELECT to_regclass('procrastinate_jobs')").fetchone() != (None,):
            return
    app = _app(dsn)
    with app.open():
        app.schema_manager.apply_schema()


async def _fill(dsn: str, jobs: int) -> float:
    app = _app(dsn)
    async with app.open_async():
        started = time.perf_counter()
        if jobs:
            await app.tasks[JOB_TYPE].batch_defer_async(*[PAYLOAD] * jobs)
        return jobs / (time.perf_counter() - started)


def fill(dsn: str, jobs: int) -> float:
    """Empty tables, then ``jobs`` queued by its batch_defer (one call); jobs/s of that call."""
    with psycopg.connect(dsn) as conn:
        conn.execute("TRUNCATE " + TABLES + " RESTART IDENTITY CASCADE")
    return asyncio.run(_fill(dsn, jobs))


async def _serve(crew: Crew, dsn: str, concurrency: int, report: bool) -> None:
    def started(n: int) -> None:
        crew.report("start", n, time.monotonic())

    app = _app(dsn, concurrency, started if report else None)
    async with app.open_async():
        await asyncio.to_thread(crew.ready_and_wait)
        worker = asyncio.create_task(
            app.run_worker_async(concurrency=concurrency, install_signal_handlers=False)
        )
        await asyncio.to_thread(crew.stop.wait)
        worker.cancel()
        await asyncio.gather(worker, return_exceptions=True)


def _serve_child(crew: Crew, dsn: str, concurrency: int, report: bool) -> None:
    asyncio.run(_serve(crew, dsn, concurrency, report))


def drain(dsn: str, jobs: int, concurrency: int, processes: int) -> float:
    """Jobs/s of ``processes`` workers over a queue of ``jobs``, until the database has them
    all succeeded."""
    fill(dsn, jobs)
    with psycopg.connect(dsn, autocommit=True) as conn:

        def drained() -> bool:
            done = conn.execute(
                "SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'"
            )
            return done.fetchone() == (jobs,)

        with (
            server_work.metered(dsn, jobs),
            Crews(processes, _serve_child, dsn, concurrency, False, linger=1) as crews,
        ):
            elapsed = crews.wait_until(drained)
    return jobs / elapsed


def idle_latency(dsn: str, samples: int) -> list[float]:
    """Seconds from a defer's commit to its task's start, on an idle worker at its defaults
    (``sample_latencies``)."""
    fill(dsn, 0)
    app = procrastinate.App(connector=procrastinate.SyncPsycopgConnector(conninfo=dsn))
    noop = app.task(name=JOB_TYPE)(lambda n: None)
    with Crews(1, _serve_child, dsn, 1, True, linger=1) as crews, app.open():
        return sample_latencies(lambda n: noop.defer(n=n), crews.next_start, samples)
