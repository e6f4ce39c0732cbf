"""What an idle poll reads when a queue holds many jobs scheduled for later: 50,000 jobs due
over the next hour (priorities 0, 1 and 5) and 3 due now of priority -1, on SQLite,
PostgreSQL and MariaDB.

    bash scripts/testdb.sh start; source /tmp/sqla-proletarian-testdb/env
    .venv/bin/python -m benchmarks.scheduled_poll [--jobs 50000] [--rounds 20]

Three polls, each in its own transaction (rolled back, so nothing is consumed):

- ``one range``: the former poll, one range (queue, process_at <= now) of the index
  (queue, run_order, process_at, seq), which holds every scheduled job of a higher priority;
- ``loose scan``: the worker's poll, the queue's priorities that have a due job (a recursive
  CTE, two index probes per priority), then a range (queue, run_order, process_at <= now)
  per priority;
- ``ready flag``: a sketch of the other way, a ``ready`` column (set when a job is due, by an
  UPDATE that each poll runs first) and an index (queue, ready, run_order, process_at, seq)
  whose range holds due jobs only.

Each is measured on a queue with nothing due (``idle``) and on one with the 3 due jobs of low
priority (``finds low``), counted as the query-plan test counts it: PostgreSQL's buffers
(EXPLAIN (ANALYZE, BUFFERS) of every statement of the poll), MariaDB's ``Handler_read_*`` and
``Handler_icp_attempts`` counters, SQLite's virtual machine steps; and the median time of a
poll over ``--rounds``. Scratch databases are dropped at the end.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa

import sqla_proletarian as sp
from sqla_proletarian import statements as sql
from sqla_proletarian.execution import poll_due_jobs
from tests.integration import test_query_plan as plan_test

JOB = sql.JOB
#: The former poll: every priority in one range of the index, bounded by the queue only.
ONE_RANGE = (
    sa.select(*sql.JOB_COLUMNS)
    .where(JOB.c.queue == sa.bindparam("queue"), JOB.c.process_at <= sa.bindparam("now"))
    .order_by(JOB.c.run_order, JOB.c.process_at, JOB.c.seq)
    .limit(1)
    .with_for_update(skip_locked=True)
)
READY_DDL = (
    "ALTER TABLE proletarian_job ADD COLUMN ready SMALLINT NOT NULL DEFAULT 0",
    "CREATE INDEX ix_ready_poll ON proletarian_job (queue, ready, run_order, process_at, seq)",
    "CREATE INDEX ix_ready_stage ON proletarian_job (queue, ready, process_at)",
)
#: The job table as the sketch sees it: with its ``ready`` column.
STAGED = sa.table(
    "proletarian_job",
    sa.column("queue", sa.String()),
    sa.column("process_at", JOB.c.process_at.type),
    sa.column("ready", sa.SmallInteger()),
)
READY = sa.literal_column("ready")
STAGE = (
    sa.update(STAGED)
    .where(
        STAGED.c.queue == sa.bindparam("queue_name"),
        STAGED.c.ready == 0,
        STAGED.c.process_at <= sa.bindparam("now"),
    )
    .values(ready=1)
)
READY_POLL = (
    sa.select(*sql.JOB_COLUMNS)
    .where(JOB.c.queue == sa.bindparam("queue"), READY == 1)
    .order_by(JOB.c.run_order, JOB.c.process_at, JOB.c.seq)
    .limit(1)
    .with_for_update(skip_locked=True)
)
QUEUES = ("idle", "finds low")
#: A poll: the statements it runs on a connection, given the queue and now.
Poll = Callable[[sa.Connection, dict[str, Any]], list[Any]]


def one_range(conn: sa.Connection, params: dict[str, Any]) -> list[Any]:
    return list(conn.execute(ONE_RANGE, params).all())


def loose_scan(conn: sa.Connection, params: dict[str, Any]) -> list[Any]:
    return poll_due_jobs(conn, params["queue"], params["now"], 1, with_runs=False)


def ready_flag(conn: sa.Connection, params: dict[str, Any]) -> list[Any]:
    conn.execute(STAGE, {"queue_name": params["queue"], "now": params["now"]})
    return list(conn.execute(READY_POLL, params).all())


POLLS: dict[str, Poll] = {
    "one range": one_range,
    "loose scan": loose_scan,
    "ready flag": ready_flag,
}


def fill(engine: sa.Engine, jobs: int, now: datetime) -> None:
    """``jobs`` scheduled jobs in each queue, and 3 due ones of priority -1 in "finds low"."""
    rng = random.Random(5)
    rows = [
        {
            "job_id": uuid.UUID(int=rng.getrandbits(128), version=4),
            "queue": queue,
            "job_type": "work",
            "payload": "{}",
            "attempts": 0,
            "enqueued_at": now,
            "process_at": now + timedelta(seconds=rng.uniform(60, 3600)),
            "run_order": -rng.choice((0, 0, 0, 1, 5)),
        }
        for queue in QUEUES
        for _ in range(jobs)
    ]
    rows += [
        {**rows[n], "job_id": uuid.uuid4(), "queue": "finds low", "run_order": 1}
        | {"process_at": now - timedelta(seconds=n + 1)}
        for n in range(3)
    ]
    sp.metadata.drop_all(engine)
    sp.metadata.create_all(engine)
    with engine.begin() as conn:
        conn.execute(sa.insert(JOB), rows)
    analyze(engine)


def add_ready_flag(engine: sa.Engine, now: datetime) -> None:
    """The sketch's column and indexes, with the due jobs flagged ready."""
    with engine.begin() as conn:
        for statement in READY_DDL:
            conn.exec_driver_sql(statement)
        conn.execute(sa.update(STAGED).where(STAGED.c.process_at <= now).values(ready=1))
    analyze(engine)


def analyze(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            conn.exec_driver_sql("ANALYZE proletarian_job")
        elif engine.dialect.name == "sqlite":
            conn.exec_driver_sql("ANALYZE")
        else:
            conn.exec_driver_sql("ANALYZE TABLE proletarian_job").all()


#: What the work of a poll is counted in, and the query-plan test's way of counting it.
WORK = {
    "postgresql": ("buffers", plan_test.postgresql_buffers),
    "mysql": ("InnoDB reads", plan_test.mariadb_handler_reads),
    "sqlite": ("VM steps", plan_test.sqlite_steps),
}


def measure(engine: sa.Engine, now: datetime, rounds: int, names: tuple[str, ...]) -> list[str]:
    unit, work = WORK[engine.dialect.name]
    lines = []
    for queue in QUEUES:
        params = {"queue": queue, "now": now}
        for name in names:
            poll = POLLS[name]
            with engine.connect() as conn:
                found = len(poll(conn, params))
                conn.rollback()
                amount = work(conn, lambda c, poll=poll, params=params: poll(c, params))
                conn.rollback()
                times = []
                for _ in range(rounds):
                    started = time.perf_counter()
                    poll(conn, params)
                    times.append(time.perf_counter() - started)
                    conn.rollback()
            ms = statistics.median(times) * 1000
            lines.append(f"  {queue:9} {name:10}: {amount:7,} {unit}, {ms:6.2f} ms, {found} found")
    return lines


@contextmanager
def scratch(admin_url: str) -> Iterator[sa.Engine]:
    admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    name = "scheduled_poll_bench"
    with admin.connect() as conn:
        conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {name}")
        conn.exec_driver_sql(f"CREATE DATABASE {name}")
    engine = sa.create_engine(sa.make_url(admin_url).set(database=name))
    try:
        yield engine
    finally:
        engine.dispose()
        with admin.connect() as conn:
            conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {name}")
        admin.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=50_000)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    now = sp.utc_now()
    targets: list[tuple[str, Callable[[], Any]]] = []
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "poll.db"
        targets.append(("SQLite", lambda: _sqlite(path)))
        for label, variable in (
            ("PostgreSQL", "SP_TEST_POSTGRESQL_URL"),
            ("MariaDB", "SP_TEST_MARIADB_URL"),
        ):
            if os.environ.get(variable):
                targets.append((label, lambda v=variable: scratch(os.environ[v])))
        for label, make in targets:
            with make() as engine:
                fill(engine, args.jobs, now)
                print(f"{label} ({engine.dialect.server_version_info}), {args.jobs:,} scheduled:")
                lines = measure(engine, now, args.rounds, ("one range", "loose scan"))
                add_ready_flag(engine, now)
                lines += measure(engine, now, args.rounds, ("ready flag",))
                print("\n".join(sorted(lines, key=lambda line: line[:12].strip() != "idle")))


@contextmanager
def _sqlite(path: Path) -> Iterator[sa.Engine]:
    engine = sa.create_engine(f"sqlite:///{path}")
    try:
        yield engine
    finally:
        engine.dispose()


if __name__ == "__main__":
    main()
