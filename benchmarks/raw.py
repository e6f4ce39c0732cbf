"""The raw-SQL baselines: the same statements as a queue needs, straight through the driver.

Per transaction: SELECT ... FOR UPDATE SKIP LOCKED (1 or N jobs), INSERT into the archive,
DELETE, COMMIT, on psycopg 3 (PostgreSQL) or PyMySQL (MariaDB), 4 threads. Plus the enqueue
baselines: one INSERT + COMMIT per job, and one multi-row INSERT for many.
"""

from __future__ import annotations

import threading
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa

from benchmarks import server_work
from benchmarks.fill import check_drained, fill, fresh_tables
from benchmarks.job import JOB_TYPE, PAYLOAD_TEXT

POLL = (
    "SELECT job_id, queue, job_type, payload, attempts, enqueued_at, process_at "
    "FROM proletarian_job WHERE queue = %s AND process_at <= %s "
    "ORDER BY run_order, process_at, seq LIMIT %s FOR UPDATE SKIP LOCKED"
)
# Only placeholders in VALUES (...): PyMySQL's executemany then sends one multi-row INSERT.
ARCHIVE = (
    "INSERT INTO proletarian_archived_job (job_id, queue, job_type, payload, attempts, "
    "enqueued_at, process_at, status, finished_at) "
    "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)"
)
#: One DELETE for the whole claim, with a placeholder per job.
DELETE = "DELETE FROM proletarian_job WHERE job_id IN ({})"
INSERT = (
    "INSERT INTO proletarian_job (job_id, queue, job_type, payload, attempts, enqueued_at, "
    "process_at) VALUES (%s, %s, %s, %s, %s, %s, %s)"
)

#: Deadlocks and lock wait timeouts (MariaDB 1213/1205, PostgreSQL 40P01): roll back, go on.
TRANSIENT = ("1213", "1205", "40P01", "deadlock")


def _now(engine: sa.Engine) -> datetime:
    now = datetime.now(UTC)
    return now if engine.dialect.name == "postgresql" else now.replace(tzinfo=None)


def _job_row(engine: sa.Engine, now: datetime) -> tuple[Any, ...]:
    job_id: Any = uuid.uuid4()
    if engine.dialect.name != "postgresql":
        job_id = str(job_id)
    return (job_id, "default", JOB_TYPE, PAYLOAD_TEXT, 0, now, now)


def _threads(target: Any, threads: int) -> None:
    pool = [threading.Thread(target=target) for _ in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()


def drain(engine: sa.Engine, jobs: int, per_transaction: int, threads: int = 4) -> float:
    """Jobs/s of the raw loop over a queue of ``jobs``, ``per_transaction`` jobs a commit."""
    fresh_tables(engine)
    fill(engine, jobs)

    def work() -> None:
        raw = engine.raw_connection()
        cursor = raw.cursor()
        try:
            while True:
                now = _now(engine)
                try:
                    cursor.execute(POLL, ("default", now, per_transaction))
                    rows = cursor.fetchall()
                    if not rows:
                        raw.commit()
                        return
                    archived = [(*row[:4], 1, *row[5:7], "success", now) for row in rows]
                    cursor.executemany(ARCHIVE, archived)
                    cursor.execute(
                        DELETE.format(", ".join(["%s"] * len(rows))), [r[0] for r in rows]
                    )
                    raw.commit()
                except Exception as exc:
                    if not any(code in str(exc) for code in TRANSIENT):
                        raise
                    raw.rollback()
        finally:
            raw.close()

    with server_work.metered(engine.url, jobs):
        started = time.perf_counter()
        _threads(work, threads)
        elapsed = time.perf_counter() - started
    check_drained(engine, jobs, f"raw SQL, {per_transaction} per transaction")
    return jobs / elapsed


def insert_commit_loop(engine: sa.Engine, jobs: int) -> float:
    """Jobs/s of one INSERT + COMMIT per job, in one thread."""
    fresh_tables(engine)
    raw = engine.raw_connection()
    try:
        cursor = raw.cursor()
        started = time.perf_counter()
        for _ in range(jobs):
            now = _now(engine)
            cursor.execute(INSERT, _job_row(engine, now))
            raw.commit()
        return jobs / (time.perf_counter() - started)
    finally:
        raw.close()


def bulk_insert(engine: sa.Engine, jobs: int) -> float:
    """Jobs/s of one executemany INSERT (sent as batches) and one COMMIT."""
    fresh_tables(engine)
    now = _now(engine)
    rows = [_job_row(engine, now) for _ in range(jobs)]
    raw = engine.raw_connection()
    try:
        cursor = raw.cursor()
        started = time.perf_counter()
        cursor.executemany(INSERT, rows)
        raw.commit()
        return jobs / (time.perf_counter() - started)
    finally:
        raw.close()
