"""How fast the dashboard answers on big tables: 1,000,000 queued and 1,000,000 archived jobs
on PostgreSQL.

    bash scripts/testdb.sh start; source /tmp/sqla-proletarian-testdb/env
    .venv/bin/python -m benchmarks.dashboard [--jobs 1000000] [--rounds 5]

It makes a scratch database on the test server (``SP_TEST_POSTGRESQL_URL``, or ``--url``
of an admin URL), fills both tables with one ``INSERT ... SELECT generate_series`` each
(four queues, a tenth of the jobs scheduled for later; archived jobs spread over a week, one
in twenty failed), vacuums and analyzes them, then times each page through the WSGI app
(rendering included) and the library reads under it: the median of ``--rounds`` after one
warm-up. A deep page (most of the way through a list) is timed beside the first, and their ratio
printed: keyset pagination makes them cost the same. The database is dropped at the end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from werkzeug.test import Client

import sqla_proletarian as sp
from sqla_proletarian import inspection
from sqla_proletarian.dashboard import create_dashboard

QUEUES = "ARRAY['mail', 'mail', 'mail', 'billing', 'billing', 'crm', 'images']"
TYPES = "ARRAY['send-welcome-email', 'charge-card', 'sync-to-crm', 'resize-image']"
FILL_QUEUE = sa.text(
    "INSERT INTO proletarian_job "
    "(job_id, queue, job_type, payload, attempts, enqueued_at, process_at) "
    f"SELECT gen_random_uuid(), ({QUEUES})[1 + i % 7], ({TYPES})[1 + (i / 7) % 4], "
    '\'{"user_id": \' || i || \', "note": "a job of the dashboard benchmark"}\', 0, '
    "now() - make_interval(secs => i % 86400), "
    "CASE WHEN i % 10 = 0 THEN now() + make_interval(secs => 60 + i % 3600) "
    "ELSE now() - make_interval(secs => i % 86400) END "
    "FROM generate_series(1, :jobs) AS i"
)
FILL_ARCHIVE = sa.text(
    "INSERT INTO proletarian_archived_job (job_id, queue, job_type, payload, attempts, "
    "enqueued_at, process_at, status, finished_at, error) "
    f"SELECT gen_random_uuid(), ({QUEUES})[1 + i % 7], ({TYPES})[1 + (i / 7) % 4], "
    "'{\"user_id\": ' || i || '}', 1, at - interval '1 second', at - interval '1 second', "
    "CASE WHEN i % 20 = 0 THEN 'failure' ELSE 'success' END, at, "
    "CASE WHEN i % 20 = 0 THEN E'RuntimeError: card declined\\nTraceback (most recent call "
    "last): ...' END "
    "FROM (SELECT i, now() - make_interval(secs => i * 604800.0 / :jobs) AS at "
    "FROM generate_series(1, :jobs) AS i) AS finished"
)
#: Jobs per page of the dashboard's lists.
PAGE = 50


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("SP_TEST_POSTGRESQL_URL"))
    parser.add_argument("--jobs", type=int, default=1_000_000, help="in each table (1000000)")
    parser.add_argument("--rounds", type=int, default=5, help="timed runs of each (5)")
    args = parser.parse_args(argv)
    if not args.url:
        parser.error("give --url of a PostgreSQL admin URL, or set SP_TEST_POSTGRESQL_URL")
    admin_url = sa.make_url(args.url)
    name = f"sp_bench_dashboard_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
    with admin.connect() as conn:
        conn.exec_driver_sql(f"CREATE DATABASE {name}")
    engine = sa.create_engine(admin_url.set(database=name))
    try:
        fill(engine, args.jobs)
        report(engine, args.jobs, args.rounds)
    finally:
        engine.dispose()
        with admin.connect() as conn:
            conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        admin.dispose()
    return 0


def fill(engine: sa.Engine, jobs: int) -> None:
    sp.metadata.create_all(engine)
    for label, statement in (("queued", FILL_QUEUE), ("archived", FILL_ARCHIVE)):
        started = time.perf_counter()
        with engine.begin() as conn:
            conn.execute(statement, {"jobs": jobs})
        print(f"filled {jobs:,} {label} jobs in {time.perf_counter() - started:.1f} s")
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql("VACUUM ANALYZE proletarian_job")
        conn.exec_driver_sql("VACUUM ANALYZE proletarian_archived_job")


def report(engine: sa.Engine, jobs: int, rounds: int) -> None:
    client = Client(create_dashboard(engine))
    # Deep pages: most of the way through the mail queue's ready jobs (3/7 of the queue,
    # nine in ten due) and through the failures (one in twenty archived jobs).
    ready_at, failed_at = int(jobs * 3 / 7 * 0.8), int(jobs / 20 * 0.8)
    deep_ready = deep_cursor(engine, "ready", ready_at)
    deep_failed = deep_cursor(engine, "failed", failed_at)
    ready_page = f"ready jobs, page {ready_at // PAGE + 1:,}, queue mail"
    failed_page = f"failed jobs, page {failed_at // PAGE + 1:,}"
    [failure] = sp.list_jobs(engine, "failed", limit=1).jobs

    def page(path: str) -> Callable[[], Any]:
        def get() -> None:
            response = client.get(path)
            assert response.status_code == 200, (path, response.status_code)
            response.close()

        return get

    timings = [
        ("overview page  GET /", page("/")),
        ("overview JSON  GET /api/overview (polled)", page("/api/overview")),
        ("  sp.queue_status", lambda: sp.queue_status(engine)),
        ("  sp.finished_per_minute (60 min)", lambda: sp.finished_per_minute(engine)),
        ("ready jobs, first page, all queues", page("/jobs?state=ready")),
        ("ready jobs, first page, queue mail", page("/jobs?state=ready&queue=mail")),
        (ready_page, page(f"/jobs?state=ready&queue=mail&after={deep_ready}")),
        ("scheduled jobs, first page", page("/jobs?state=scheduled")),
        ("failed jobs, first page", page("/jobs?state=failed")),
        (failed_page, page(f"/jobs?state=failed&after={deep_failed}")),
        ("failed jobs of type charge-card", page("/jobs?state=failed&job_type=charge-card")),
        ("failed jobs of queue images", page("/jobs?state=failed&queue=images")),
        ("failed jobs of a type with none (worst)", page("/jobs?state=failed&job_type=none")),
        ("a job's page", page(f"/jobs/{failure.job_id}")),
    ]
    with engine.connect() as conn:
        version = conn.exec_driver_sql("SHOW server_version").scalar()
    print(f"\nPostgreSQL {version}, {jobs:,} queued + {jobs:,} archived jobs, ", end="")
    print(f"median of {rounds} after a warm-up, ms:\n")
    medians = {}
    for label, call in timings:
        call()
        samples = []
        for _ in range(rounds):
            started = time.perf_counter()
            call()
            samples.append((time.perf_counter() - started) * 1000)
        medians[label] = statistics.median(samples)
        print(f"  {label:<44} {medians[label]:8.1f}")
    ready = medians[ready_page] / medians["ready jobs, first page, queue mail"]
    failed = medians[failed_page] / medians["failed jobs, first page"]
    print(f"\n  deep page / first page: ready {ready:.2f}, failed {failed:.2f}")


def deep_cursor(engine: sa.Engine, state: str, position: int) -> str:
    """The cursor of the page that starts after ``position`` jobs of the ready jobs of
    queue mail, or of the failures (found with one OFFSET query here, so the benchmark need
    not page there)."""
    table = sp.Job.__table__ if state == "ready" else sp.ArchivedJob.__table__
    with engine.connect() as conn:
        if state == "ready":
            row = conn.execute(
                sa.select(table.c.queue, table.c.run_order, table.c.process_at, table.c.seq)
                .where(table.c.queue == "mail", table.c.process_at <= sp.utc_now())
                .order_by(table.c.run_order, table.c.process_at, table.c.seq)
                .offset(position - 1)
                .limit(1)
            ).one()
            return inspection._write_cursor(inspection._queued_key(row))
        row = conn.execute(
            sa.select(table.c.finished_at, table.c.job_id)
            .where(table.c.status == "failure")
            .order_by(table.c.finished_at.desc(), table.c.job_id.desc())
            .offset(position - 1)
            .limit(1)
        ).one()
        return inspection._write_cursor((row.finished_at, row.job_id))


if __name__ == "__main__":
    sys.exit(main())
