"""Jobs per second of the worker against a raw-SQL queue loop, measured in one run.

    python benchmarks/throughput.py URL [--jobs N] [--threads T]

Prints jobs/s for: a raw-SQL loop through the same driver (per job: SELECT ... FOR UPDATE
SKIP LOCKED, INSERT into the archive, DELETE, COMMIT), the library with the crash ledger
off (``max_unclean_ends=None``), and the library as shipped (ledger on), and each one's
ratio to the raw loop. Absolute figures depend on the machine; compare the ratios.
PostgreSQL and MySQL/MariaDB only (the raw loop needs SKIP LOCKED).
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime

import sqlalchemy as sa

import sqla_proletarian as sp
from sqla_proletarian import statements as sql

POLL = (
    "SELECT job_id, queue, job_type, payload, attempts, enqueued_at, process_at "
    "FROM proletarian_job WHERE queue = %s AND process_at <= %s "
    "ORDER BY process_at, seq LIMIT 1 FOR UPDATE SKIP LOCKED"
)
ARCHIVE = (
    "INSERT INTO proletarian_archived_job (job_id, queue, job_type, payload, attempts, "
    "enqueued_at, process_at, status, finished_at) "
    "VALUES (%s, %s, %s, %s, %s, %s, %s, 'success', %s)"
)
DELETE = "DELETE FROM proletarian_job WHERE job_id = %s"


def fill(engine: sa.Engine, jobs: int) -> None:
    sp.metadata.drop_all(engine)
    sp.metadata.create_all(engine)
    now = datetime.now(UTC)
    rows = [
        {
            "job_id": sp.uuid4(),
            "queue": sp.DEFAULT_QUEUE,
            "job_type": "noop",
            "payload": '{"n":1}',
            "attempts": 0,
            "enqueued_at": now,
            "process_at": now,
        }
        for _ in range(jobs)
    ]
    with engine.begin() as conn:
        conn.execute(sa.insert(sql.JOB), rows)


def run_threads(target: Callable[[], None], threads: int) -> None:
    pool = [threading.Thread(target=target) for _ in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()


def raw_loop(engine: sa.Engine, threads: int) -> None:
    """The baseline: the same statements per job, straight through the driver's cursor."""
    aware = engine.dialect.name == "postgresql"

    def work() -> None:
        raw = engine.raw_connection()
        try:
            cursor = raw.cursor()
            while True:
                now = datetime.now(UTC) if aware else datetime.now(UTC).replace(tzinfo=None)
                cursor.execute(POLL, (sp.DEFAULT_QUEUE, now))
                row = cursor.fetchone()
                if row is None:
                    raw.commit()
                    return
                cursor.execute(ARCHIVE, (*row[:4], 1, *row[5:7], now))
                cursor.execute(DELETE, (row[0],))
                raw.commit()
        finally:
            raw.close()

    run_threads(work, threads)


def library(engine: sa.Engine, threads: int, jobs: int, **options: object) -> None:
    """The library's QueueWorker, until every job has been run."""
    worker = sp.create_queue_worker(
        engine,
        lambda job_type, payload: None,
        worker_threads=threads,
        polling_interval=0.01,
        **options,
    )
    with worker:
        while worker.summary()["succeeded"] < jobs:
            time.sleep(0.002)


def measure(name: str, engine: sa.Engine, jobs: int, run: Callable[[], None]) -> float:
    fill(engine, jobs)
    started = time.perf_counter()
    run()
    elapsed = time.perf_counter() - started
    with engine.connect() as conn:
        left = conn.execute(sa.select(sa.func.count()).select_from(sql.JOB)).scalar_one()
        done = conn.execute(sa.select(sa.func.count()).select_from(sql.ARCHIVE)).scalar_one()
    if left or done != jobs:
        raise SystemExit(f"{name}: {left} jobs left, {done} archived of {jobs}")
    return jobs / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("--jobs", type=int, default=3000)
    parser.add_argument("--threads", type=int, default=4)
    args = parser.parse_args()
    engine = sa.create_engine(args.url, pool_size=2 * args.threads + 2)
    threads = args.threads
    rates = {
        "raw SQL loop": measure("raw", engine, args.jobs, lambda: raw_loop(engine, threads)),
        "library, ledger off": measure(
            "off",
            engine,
            args.jobs,
            lambda: library(engine, threads, args.jobs, max_unclean_ends=None),
        ),
        "library, ledger on (default)": measure(
            "on", engine, args.jobs, lambda: library(engine, threads, args.jobs)
        ),
    }
    base = rates["raw SQL loop"]
    print(f"{engine.dialect.name}: {args.jobs} jobs, {threads} threads, 1 job per transaction")
    for name, rate in rates.items():
        print(f"  {name:<30} {rate:8.0f} jobs/s   {rate / base:5.2f} x raw")
    sp.metadata.drop_all(engine)


if __name__ == "__main__":
    main()
