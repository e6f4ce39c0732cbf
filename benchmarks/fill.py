"""Fresh library tables, and queues filled fast by one INSERT ... SELECT on the server."""

from __future__ import annotations

import sqlalchemy as sa

import sqla_proletarian as sp
from benchmarks.job import PAYLOAD_TEXT

_FILL = {
    "postgresql": sa.text(
        "INSERT INTO proletarian_job "
        "(job_id, queue, job_type, payload, attempts, enqueued_at, process_at) "
        "SELECT gen_random_uuid(), 'default', 'noop', :payload, 0, now(), now() "
        "FROM generate_series(1, :jobs)"
    ),
    # MariaDB's SEQUENCE engine: up to a billion rows, cut to size by LIMIT.
    "mysql": sa.text(
        "INSERT INTO proletarian_job "
        "(job_id, queue, job_type, payload, attempts, enqueued_at, process_at) "
        "SELECT REPLACE(UUID(), '-', ''), 'default', 'noop', :payload, 0, "
        "UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) "
        "FROM seq_0_to_999 a, seq_0_to_999 b, seq_0_to_999 c LIMIT :jobs"
    ),
}

_ANALYZE = {"postgresql": "ANALYZE proletarian_job", "mysql": "ANALYZE TABLE proletarian_job"}


def fresh_tables(engine: sa.Engine) -> None:
    """Drop and create the library's tables: no dead rows left by an earlier measurement."""
    sp.metadata.drop_all(engine)
    sp.metadata.create_all(engine)


def fill(engine: sa.Engine, jobs: int, *, analyze: bool = False) -> None:
    """Queue ``jobs`` due no-op jobs in one statement (``analyze``: refresh the statistics
    afterwards, as autovacuum would on a queue that has been that deep for a while)."""
    with engine.begin() as conn:
        conn.execute(_FILL[engine.dialect.name], {"jobs": jobs, "payload": PAYLOAD_TEXT})
    if analyze:
        with engine.begin() as conn:
            conn.exec_driver_sql(_ANALYZE[conn.dialect.name])


def count(engine: sa.Engine, table: sa.Table) -> int:
    with engine.connect() as conn:
        return conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one()


def check_drained(engine: sa.Engine, jobs: int, name: str) -> None:
    """Every job archived once and none left: a drain that lost or kept jobs is refused."""
    left = count(engine, sp.Job.__table__)  # type: ignore[arg-type]
    done = count(engine, sp.ArchivedJob.__table__)  # type: ignore[arg-type]
    if left or done != jobs:
        raise RuntimeError(f"{name}: {left} jobs left, {done} archived of {jobs}")
