"""The poll is served by the index ix_proletarian_job_poll on every backend: first the queue's
priorities that have a due job, two index probes per priority (a loose index scan; on MariaDB
one statement per priority, each reading the first index entry past the last), then per
priority one range of due jobs that gives both the WHERE (queue, run_order, due time) and the
ORDER BY (process_at, seq), so no sort, no scan of the whole table and no job scheduled for
later is read, with realistic data and fresh statistics (no planner switches), and in a new
table whose statistics were never refreshed. On PostgreSQL and SQLite the claim's first poll
finds the first due priority itself, with the same probes evaluated once, and reads its range
with the priority as a key. Whether the queue is paused is one primary-key lookup, made once
per statement. The run count read with
the claim goes through ix_proletarian_job_run_job_id, and prune_archive's batches through
ix_proletarian_archived_job_finished_at and the archive's primary key: their cost stays flat
however many jobs are queued or archived. On MariaDB a finishing batch's multi-row
statements read their tables' job-id indexes on small tables too, and so do the locking
reads with which a job's end settles its dependents (PostgreSQL: in a table never
analyzed)."""

from __future__ import annotations

import json
import random
import re
import uuid
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.base import Executable
from sqlalchemy.sql.expression import ClauseElement

import sqla_proletarian as sp
from sqla_proletarian import statements
from sqla_proletarian.dialects import dialect_of
from sqla_proletarian.execution import poll_due_jobs
from sqla_proletarian.running import next_due_at
from sqla_proletarian.statements import Statement
from sqla_proletarian.values import build_job_values

INDEX = "ix_proletarian_job_poll"
PAUSED = ("proletarian_paused_queue", "pk_proletarian_paused_queue")
#: The poll also checks that the queue has no limits (a limited queue is claimed by ``flow``).
LIMITED = ("proletarian_queue_limit", "pk_proletarian_queue_limit")
RUN_INDEX = "ix_proletarian_job_run_job_id"
ARCHIVE_INDEX = "ix_proletarian_archived_job_finished_at"
TABLES = ("proletarian_job", "proletarian_archived_job", "proletarian_job_run")

#: The crowded database: jobs queued, jobs archived, and run records.
QUEUED = 50_000
#: Jobs scheduled for later (over the next hour, priorities 0, 1 and 5) beside a few due ones
#: of priority -1.
SCHEDULED = 50_000
DUE_LOW = 3
ARCHIVED = 50_000
RUNS = 1_000


class Explain(Executable, ClauseElement):
    """``EXPLAIN`` (with a dialect's prefix) of a statement, run with its bound parameters."""

    inherit_cache = False

    def __init__(self, statement: Any, prefix: str) -> None:
        self.statement = statement
        self.prefix = prefix


@compiles(Explain)
def _compile_explain(element: Explain, compiler: Any, **kw: Any) -> str:
    text = element.prefix + compiler.process(element.statement, **kw)
    # The rows are the plan's, not the statement's: type none of them as its columns (a
    # plan with as many columns as the statement would otherwise be read by position).
    compiler._result_columns = []
    return text


def analyze(engine: sa.Engine) -> None:
    """Refresh the planner's statistics of the library's tables."""
    with engine.connect() as conn:
        if engine.dialect.name == "postgresql":
            conn.exec_driver_sql(f"ANALYZE {', '.join(TABLES)}")
        elif engine.dialect.name == "sqlite":
            conn.exec_driver_sql("ANALYZE")
        else:
            for table in TABLES:
                conn.exec_driver_sql(f"ANALYZE TABLE {table}").all()
        conn.commit()


@pytest.fixture
def busy_engine(engine: sa.Engine) -> sa.Engine:
    """2,000 jobs: most in one busy queue, the rest in four small ones, due times spread over
    the past and the next hour, priorities from -2 to 2; table statistics refreshed."""
    now = sp.utc_now()
    rng = random.Random(2)
    jobs = [
        build_job_values(
            "work",
            {"n": n},
            queue=sp.DEFAULT_QUEUE if n % 4 else f"small-{n % 16 // 4}",
            process_at=now + timedelta(seconds=rng.uniform(-3600, 3600)),
            priority=rng.randint(-2, 2),
        )
        for n in range(2000)
    ]
    with engine.connect() as conn:
        conn.execute(sa.insert(statements.JOB), jobs)
        conn.commit()
    analyze(engine)
    return engine


@pytest.fixture
def crowded_engine(engine: sa.Engine) -> sa.Engine:
    """50,000 jobs queued (three in four in the busy queue, the rest in four small ones, due
    over the past and the next hour), 50,000 archived (one a minute over the last five weeks,
    one in five failed) and 1,000 run records of queued jobs; statistics refreshed.

    A crash ledger of a few records is one page, which PostgreSQL rightly scans whole; with
    1,000 (a large fleet's running jobs, or records left by crashed workers) reading it
    without its index would cost, so the plan shows whether the index is there to use.
    """
    now = sp.utc_now()
    rng = random.Random(7)
    queued = [
        {
            "job_id": uuid.UUID(int=rng.getrandbits(128), version=4),
            "queue": sp.DEFAULT_QUEUE if n % 4 else f"small-{n % 16 // 4}",
            "job_type": "work",
            "payload": f'{{"n":{n}}}',
            "attempts": 0,
            "enqueued_at": now - timedelta(hours=1),
            "process_at": now + timedelta(seconds=rng.uniform(-3600, 3600)),
            "run_order": -rng.choice((0, 0, 0, 1, 5)),
        }
        for n in range(QUEUED)
    ]
    archived = [
        {
            "job_id": uuid.UUID(int=rng.getrandbits(128), version=4),
            "queue": sp.DEFAULT_QUEUE,
            "job_type": "work",
            "payload": f'{{"n":{n}}}',
            "attempts": 1,
            "enqueued_at": now - timedelta(minutes=n + 1),
            "process_at": now - timedelta(minutes=n + 1),
            "status": "failure" if n % 5 == 0 else "success",
            "finished_at": now - timedelta(minutes=n),
            "error": None,
        }
        for n in range(ARCHIVED)
    ]
    runs = [
        {
            "run_id": uuid.UUID(int=rng.getrandbits(128), version=4),
            "job_id": job["job_id"],
            "worker_id": "a worker",
            "started_at": now,
            "owner": None,
        }
        for job in rng.sample(queued, RUNS)
    ]
    # Executemany: PyMySQL sends multi-row INSERTs, psycopg pipelines, sqlite3 loops in C.
    with engine.begin() as conn:
        conn.execute(sa.insert(statements.JOB), queued)
        conn.execute(sa.insert(statements.ARCHIVE), archived)
        conn.execute(sa.insert(statements.RUN), runs)
        for table, rows in ((statements.JOB, QUEUED), (statements.ARCHIVE, ARCHIVED)):
            assert conn.scalar(sa.select(sa.func.count()).select_from(table)) == rows
    analyze(engine)
    return engine


def explain(engine: sa.Engine, prefix: str, statement: Statement) -> list[Any]:
    """The plan of a statement with its parameters, as the backend's EXPLAIN gives it."""
    executable, params = statement
    with engine.connect() as conn:
        rows = conn.execute(Explain(executable, prefix), params).all()
        conn.rollback()
    return rows


def plan_nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
    return [node, *(n for child in node.get("Plans", []) for n in plan_nodes(child))]


def postgresql_plan(engine: sa.Engine, statement: Statement) -> list[dict[str, Any]]:
    """Every node of PostgreSQL's plan of the statement, depth first."""
    (row,) = explain(engine, "EXPLAIN (FORMAT JSON) ", statement)
    document = row[0] if not isinstance(row[0], str) else json.loads(row[0])
    return plan_nodes(document[0]["Plan"])


def scans(nodes: list[dict[str, Any]]) -> list[tuple[str, str | None]]:
    """(table, index) of each scan node; the index is None for a scan of the whole table."""
    return [
        (node["Relation Name"], node.get("Index Name"))
        for node in nodes
        if "Relation Name" in node and "Scan" in node["Node Type"]
    ]


def assert_no_sort(kinds: list[str]) -> None:
    assert "Sort" not in kinds and "Incremental Sort" not in kinds, kinds


def check_plan(engine: sa.Engine, backend: str, queue: str, *, with_runs: bool) -> None:
    statement = statements.poll(queue, sp.utc_now(), run_order=0, with_runs=with_runs)
    if backend == "postgresql":
        nodes = postgresql_plan(engine, statement)
        kinds = [node["Node Type"] for node in nodes]
        expected = [("proletarian_job", INDEX), PAUSED, LIMITED]
        for table in (PAUSED, LIMITED):
            (check,) = [n for n in nodes if n.get("Relation Name") == table[0]]
            assert check["Parent Relationship"] == "InitPlan", kinds  # once per poll
        if with_runs:
            expected.append(("proletarian_job_run", RUN_INDEX))
            (subplan,) = [n for n in nodes if n.get("Parent Relationship") == "SubPlan"]
            assert scans(plan_nodes(subplan)) == [("proletarian_job_run", RUN_INDEX)], kinds
        assert sorted(scans(nodes)) == sorted(expected), kinds
        for node in nodes:
            if "Scan" in node["Node Type"]:
                assert node["Node Type"] in ("Index Scan", "Index Only Scan"), kinds
        assert_no_sort(kinds)
        assert "LockRows" in kinds, kinds
    elif backend == "mariadb":
        plan = {row.table: dict(row._mapping) for row in explain(engine, "EXPLAIN ", statement)}
        # The pause and limits checks: primary-key lookups made while planning; with no row
        # for the queue, MariaDB reports "no matching row in const table" and no table.
        rows = [dict(row._mapping) for row in explain(engine, "EXPLAIN ", statement)]
        checks = [row for row in rows if row["table"] is None]
        plan.pop(None)
        assert len(checks) == 2, rows
        for check in checks:
            assert check["select_type"] == "SUBQUERY", check
            assert check["Extra"] == "no matching row in const table", check
        tables = {"proletarian_job", "proletarian_job_run"} if with_runs else {"proletarian_job"}
        assert set(plan) == tables, plan
        job = plan["proletarian_job"]
        assert job["key"] == INDEX, plan
        assert job["type"] in ("range", "ref"), plan
        for row in plan.values():
            assert "filesort" not in (row["Extra"] or ""), plan
            assert "temporary" not in (row["Extra"] or ""), plan
        if with_runs:
            run = plan["proletarian_job_run"]
            assert run["select_type"] == "DEPENDENT SUBQUERY", plan
            assert (run["key"], run["type"]) == (RUN_INDEX, "ref"), plan
    else:
        details = [row.detail for row in explain(engine, "EXPLAIN QUERY PLAN ", statement)]
        assert any(f"INDEX {INDEX}" in detail for detail in details), details
        if with_runs:
            assert any(f"INDEX {RUN_INDEX} (job_id=?)" in detail for detail in details), details
        assert not any("TEMP B-TREE" in detail for detail in details), details
        assert not any(detail.startswith("SCAN") for detail in details), details
        for table in (PAUSED, LIMITED):
            checks = [detail for detail in details if table[0] in detail]
            assert len(checks) == 1 and "(queue=?)" in checks[0], details


def priority_reads(engine: sa.Engine, queue: str) -> list[Statement]:
    """The reads of a queue's priorities: the poll's first (the priorities with a due job)
    and the idle worker's read of each one's earliest job; on MariaDB the hops that serve
    both, from the start of the queue's range and past a priority."""
    if dialect_of(engine).priority_scan == "hops":
        return [statements.first_entry(queue), statements.first_entry(queue, after=-1)]
    return [statements.due_run_orders(queue, sp.utc_now()), statements.next_due(queue)]


def check_priority_scan_plan(engine: sa.Engine, backend: str, statement: Statement) -> None:
    """A read of the priorities probes the poll index (a recursive CTE; on MariaDB one entry
    of the index, in its order): no scan of the table, no sort."""
    if backend == "postgresql":
        nodes = postgresql_plan(engine, statement)
        kinds = [node["Node Type"] for node in nodes]
        assert set(scans(nodes)) == {("proletarian_job", INDEX), PAUSED}, kinds
        assert "Seq Scan" not in kinds and "Bitmap Heap Scan" not in kinds, kinds
        assert_no_sort(kinds)
    elif backend == "mariadb":
        plan = [dict(row._mapping) for row in explain(engine, "EXPLAIN ", statement)]
        (job,) = [row for row in plan if row["table"] == "proletarian_job"]
        assert job["key"] == INDEX and job["type"] in ("range", "ref"), plan
        for row in plan:
            assert "filesort" not in (row["Extra"] or ""), plan
            assert "temporary" not in (row["Extra"] or ""), plan
    else:
        details = [row.detail for row in explain(engine, "EXPLAIN QUERY PLAN ", statement)]
        assert not any(f"SCAN {statements.JOB.name}" in detail for detail in details), details
        assert any(f"INDEX {INDEX}" in detail for detail in details), details


def check_first_poll_plan(engine: sa.Engine, backend: str, queue: str, *, with_runs: bool) -> None:
    """The claim's first poll, which finds the first due priority itself, hops through the poll
    index to it once (an InitPlan on PostgreSQL, a scalar subquery on SQLite), then reads that
    priority's range of due jobs with the priority as a key: no sort, no scan of a table.
    MySQL and MariaDB do not send it (``Dialect.poll_finds_priority``)."""
    if not dialect_of(engine).poll_finds_priority:
        assert backend == "mariadb"
        return
    statement = statements.poll_first(queue, sp.utc_now(), with_runs=with_runs)
    if backend == "postgresql":
        nodes = postgresql_plan(engine, statement)
        kinds = [node["Node Type"] for node in nodes]
        expected = {("proletarian_job", INDEX), PAUSED, LIMITED}
        if with_runs:
            expected.add(("proletarian_job_run", RUN_INDEX))
        assert set(scans(nodes)) == expected, kinds
        for node in nodes:
            if "Relation Name" in node:
                assert node["Node Type"] in ("Index Scan", "Index Only Scan"), kinds
        (claimed,) = [n for n in nodes if "process_at <=" in n.get("Index Cond", "")]
        assert re.search(r"run_order = (\$\d+|\(InitPlan)", claimed["Index Cond"]), claimed
        (first,) = [n for n in nodes if n.get("Subplan Name", "").startswith("CTE")]
        assert first["Parent Relationship"] == "InitPlan", kinds  # once per poll
        assert_no_sort(kinds)
        assert "LockRows" in kinds, kinds
    else:
        details = [row.detail for row in explain(engine, "EXPLAIN QUERY PLAN ", statement)]
        claim = (
            f"SEARCH proletarian_job USING INDEX {INDEX} (queue=? AND run_order=? AND process_at<?)"
        )
        assert claim in details, details
        assert not any(f"SCAN {statements.JOB.name}" in detail for detail in details), details
        assert not any("TEMP B-TREE" in detail for detail in details), details


def test_the_poll_of_a_busy_and_of_a_small_queue_reads_the_index_in_order_without_sorting(
    busy_engine: sa.Engine, backend: str
) -> None:
    for queue in (sp.DEFAULT_QUEUE, "small-1"):
        check_plan(busy_engine, backend, queue, with_runs=False)
        for statement in priority_reads(busy_engine, queue):
            check_priority_scan_plan(busy_engine, backend, statement)
        check_first_poll_plan(busy_engine, backend, queue, with_runs=False)


def test_the_poll_with_its_run_count_stays_on_its_indexes_with_50000_queued_and_archived(
    crowded_engine: sa.Engine, backend: str
) -> None:
    """The claim as the worker sends it (with the run count), in the busy queue and in a
    small one, with 50,000 jobs queued, 50,000 archived and 1,000 run records."""
    for queue in (sp.DEFAULT_QUEUE, "small-2"):
        check_plan(crowded_engine, backend, queue, with_runs=True)
        for statement in priority_reads(crowded_engine, queue):
            check_priority_scan_plan(crowded_engine, backend, statement)
        check_first_poll_plan(crowded_engine, backend, queue, with_runs=True)


def test_prune_batches_read_the_finished_at_index_and_delete_by_primary_key(
    crowded_engine: sa.Engine, backend: str
) -> None:
    """Each of prune_archive's batches reads its ids in finished_at order from the index, with
    and without a status filter, first and later batches alike (no sort, no scan). On MariaDB
    its DELETE finds the rows by primary key (so, at READ COMMITTED, it locks those rows and
    no range of the index); PostgreSQL's DELETE locks only the rows it deletes, whatever
    its plan."""
    cutoff = sp.utc_now() - timedelta(days=30)
    after = cutoff - timedelta(days=2)
    batches = [
        statements.archived_batch(cutoff, 1000),
        statements.archived_batch(cutoff, 1000, status="failure"),
        statements.archived_batch(cutoff, 1000, after=after),
        statements.archived_batch(cutoff, 1000, status="success", after=after),
    ]
    with crowded_engine.connect() as conn:
        executable, params = batches[0]
        ids = [row.job_id for row in conn.execute(executable, params)]
    assert len(ids) == 1000
    delete = statements.delete_archived(ids, cutoff, status="success")
    for batch in batches:
        check_archive_batch_plan(crowded_engine, backend, batch)
    check_archive_delete_plan(crowded_engine, backend, delete)


def check_archive_batch_plan(engine: sa.Engine, backend: str, batch: Statement) -> None:
    if backend == "postgresql":
        nodes = postgresql_plan(engine, batch)
        kinds = [node["Node Type"] for node in nodes]
        assert scans(nodes) == [("proletarian_archived_job", ARCHIVE_INDEX)], kinds
        assert_no_sort(kinds)
    elif backend == "mariadb":
        (row,) = explain(engine, "EXPLAIN ", batch)
        plan = dict(row._mapping)
        assert (plan["key"], plan["type"]) == (ARCHIVE_INDEX, "range"), plan
        assert "filesort" not in (plan["Extra"] or ""), plan
    else:
        details = [row.detail for row in explain(engine, "EXPLAIN QUERY PLAN ", batch)]
        assert any(f"INDEX {ARCHIVE_INDEX} (finished_at" in detail for detail in details), details
        assert not any("TEMP B-TREE" in detail for detail in details), details
        assert not any(detail.startswith("SCAN") for detail in details), details


def check_archive_delete_plan(engine: sa.Engine, backend: str, delete: Statement) -> None:
    if backend == "mariadb":
        (row,) = explain(engine, "EXPLAIN ", delete)
        plan = dict(row._mapping)
        assert (plan["key"], plan["type"]) == ("PRIMARY", "range"), plan
    elif backend == "sqlite":
        details = [row.detail for row in explain(engine, "EXPLAIN QUERY PLAN ", delete)]
        assert any(detail.startswith("SEARCH") and "(job_id=?)" in detail for detail in details), (
            details
        )
        assert not any(detail.startswith("SCAN") for detail in details), details


def test_a_claims_multi_row_statements_read_their_indexes_on_a_small_mariadb_table(
    engine: sa.Engine, backend: str
) -> None:
    """The archive copy and the deletes of a finishing batch, and the delete of run records
    given up, each read the job-id index of their table even on tables of a few dozen rows,
    where MariaDB would scan (and, at READ COMMITTED, lock the rows other claims hold)."""
    if backend != "mariadb":
        pytest.skip("PostgreSQL archives a batch in one statement; SQLite has no row locks")
    now = sp.utc_now()
    with engine.begin() as conn:
        job_ids = sp.enqueue_many(conn, [("work", n) for n in range(60)])
        runs = [(job_id, uuid.uuid4()) for job_id in job_ids[:40]]
        conn.execute(
            sa.insert(statements.RUN),
            [
                {"run_id": run_id, "job_id": job_id, "worker_id": "w", "started_at": now}
                for job_id, run_id in runs
            ],
        )
    analyze(engine)
    dialect = sp.dialects.dialect_of(engine)
    sent = [
        *statements.archive_succeeded(
            job_ids[:20],
            job_ids[:10],
            dict(runs[10:20]),
            now,
            upsert=dialect.archive_upsert,
            returning=False,
            force_index=dialect.force_index,
        ),
        statements.end_runs_by_id(runs[20:30], force_index=dialect.force_index),
    ]
    keys = ["uq_proletarian_job_job_id"] * 2 + [RUN_INDEX] * 3
    for statement, key in zip(sent, keys, strict=True):
        (row,) = explain_as_sent(engine, statement)
        assert (row["key"], row["type"]) == (key, "range"), row


def test_a_lease_groups_completion_reads_the_job_id_index_on_a_small_mariadb_table(
    engine: sa.Engine, backend: str
) -> None:
    """Lease mode's grouped completion (its lock of the group's leases, then the archive
    copy and the delete of those it kept) reads the job-id index even on a table of a few
    dozen rows, where MariaDB would scan (and lock the rows other workers' claims hold)."""
    if backend != "mariadb":
        pytest.skip("PostgreSQL archives a group in one statement; SQLite has no row locks")
    now = sp.utc_now()
    with engine.begin() as conn:
        job_ids = sp.enqueue_many(conn, [("work", n) for n in range(60)])
    analyze(engine)
    dialect = sp.dialects.dialect_of(engine)
    group = job_ids[:20]
    (lock, params), _ = statements.end_leases(
        group, [uuid.uuid4()], force_index=dialect.force_index, arrays=dialect.id_arrays
    )
    sent = [
        (lock, params),
        *statements.archive_leased_succeeded(
            group,
            now,
            upsert=dialect.archive_upsert,
            force_index=dialect.force_index,
        ),
    ]
    for statement in sent:
        (row,) = explain_as_sent(engine, statement)
        assert (row["key"], row["type"]) == ("uq_proletarian_job_job_id", "range"), row


def explain_as_sent(
    engine: sa.Engine, statement: Statement, prefix: str = "EXPLAIN "
) -> list[dict[str, Any]]:
    """MariaDB's plan of a statement (DML included) as the driver sends it, its parameters
    bound (or the plan another ``prefix`` asks for); the statement then runs in a
    transaction that is rolled back."""
    plans: list[dict[str, Any]] = []

    def explain_first(conn: Any, cursor: Any, text: str, parameters: Any, *args: Any) -> None:
        cursor.execute(prefix + text, parameters)
        names = [column[0] for column in cursor.description]
        plans.extend(dict(zip(names, row, strict=True)) for row in cursor.fetchall())

    with engine.connect() as conn:
        sa.event.listen(conn, "before_cursor_execute", explain_first)
        conn.execute(*statement)
        conn.rollback()
    return plans


@pytest.fixture
def scheduled_engine(engine: sa.Engine) -> sa.Engine:
    """50,000 jobs of the default queue scheduled over the next hour, of priorities 0, 1
    and 5, and 3 due a minute ago, of priority -1; statistics refreshed."""
    now = sp.utc_now()
    rng = random.Random(11)
    rows = [
        {
            "job_id": uuid.UUID(int=rng.getrandbits(128), version=4),
            "queue": sp.DEFAULT_QUEUE,
            "job_type": "later" if n < SCHEDULED else "low",
            "payload": f'{{"n":{n}}}',
            "attempts": 0,
            "enqueued_at": now - timedelta(hours=1),
            "process_at": now
            + (
                timedelta(seconds=rng.uniform(60, 3600))
                if n < SCHEDULED
                else timedelta(minutes=-1, seconds=n - SCHEDULED)
            ),
            "run_order": -rng.choice((0, 0, 0, 1, 5)) if n < SCHEDULED else 1,
        }
        for n in range(SCHEDULED + DUE_LOW)
    ]
    with engine.begin() as conn:
        conn.execute(sa.insert(statements.JOB), rows)
    analyze(engine)
    return engine


def postgresql_buffers(conn: sa.Connection, poll: Any) -> int:
    """The shared buffers (hit or read) of every statement ``poll`` sends, each run again
    under EXPLAIN (ANALYZE, BUFFERS) in the same order and transaction state."""
    sent: list[tuple[str, Any]] = []

    def record(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        sent.append((statement, parameters))

    sa.event.listen(conn, "before_cursor_execute", record)
    try:
        poll(conn)
    finally:
        sa.event.remove(conn, "before_cursor_execute", record)
    conn.rollback()
    cursor = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
    buffers = 0
    for statement, parameters in sent:
        cursor.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + statement, parameters)
        document = cursor.fetchone()[0]
        plan = (json.loads(document) if isinstance(document, str) else document)[0]["Plan"]
        buffers += plan.get("Shared Hit Blocks", 0) + plan.get("Shared Read Blocks", 0)
    cursor.close()
    return buffers


#: InnoDB's reads: index entries and rows handed to the server, and the index entries it
#: tested against a pushed-down condition without handing them over.
READ_COUNTERS = ("Handler_read_", "Handler_icp_attempts")


def mariadb_handler_reads(conn: sa.Connection, poll: Any) -> int:
    """The index entries and rows InnoDB read while ``poll`` ran, less what reading the
    counters itself costs."""

    def reads() -> int:
        rows = conn.exec_driver_sql("SHOW SESSION STATUS LIKE 'Handler_%%'").all()
        return sum(int(value) for name, value in rows if name.startswith(READ_COUNTERS))

    first = reads()
    overhead = reads() - first
    before = reads()
    poll(conn)
    return reads() - before - overhead


def sqlite_steps(conn: sa.Connection, poll: Any) -> int:
    """How many virtual machine instructions SQLite ran for ``poll`` (counted in tens)."""
    steps = 0

    def step() -> int:
        nonlocal steps
        steps += 10
        return 0

    driver = conn.connection.dbapi_connection
    driver.set_progress_handler(step, 10)  # type: ignore[union-attr]
    try:
        poll(conn)
    finally:
        driver.set_progress_handler(None, 0)  # type: ignore[union-attr]
    return steps


#: What a poll may cost beside 50,000 scheduled jobs: a few index pages, entries or steps per
#: priority. Reading the scheduled jobs costs far more: about 300 buffers on PostgreSQL,
#: 50,000 reads on MariaDB, 250,000 steps on SQLite.
POLL_WORK = {
    "postgresql": (postgresql_buffers, 100),
    "mariadb": (mariadb_handler_reads, 60),
    "sqlite": (sqlite_steps, 2_000),
}


def test_an_idle_poll_and_one_finding_due_jobs_of_low_priority_read_no_scheduled_job(
    scheduled_engine: sa.Engine, backend: str
) -> None:
    """Beside 50,000 jobs scheduled for later at higher priorities, a poll with nothing due,
    and one that claims the 3 due jobs of the lowest priority (a batch of 10, as the worker
    sends it, with the run count), each read a bounded part of the index, not the scheduled
    jobs; the claim comes in due order."""
    measure, bound = POLL_WORK[backend]
    now = sp.utc_now()
    with scheduled_engine.connect() as conn:
        found = poll_due_jobs(conn, sp.DEFAULT_QUEUE, now, 10, with_runs=True)
        conn.rollback()
        assert [job["job_type"] for job in found] == ["low"] * DUE_LOW
        assert found == sorted(found, key=lambda job: job["process_at"])
        for when in (now - timedelta(hours=1), now):

            def poll(c: sa.Connection, when: Any = when) -> None:
                poll_due_jobs(c, sp.DEFAULT_QUEUE, when, 10, with_runs=True)

            work = measure(conn, poll)
            conn.rollback()
            assert 0 < work <= bound, (when, work)
        if dialect_of(conn).poll_finds_priority:
            # The first poll alone, hopping past the three scheduled priorities to the due one.
            def first(c: sa.Connection) -> None:
                c.execute(*statements.poll_first(sp.DEFAULT_QUEUE, now, 10, with_runs=True)).all()

            work = measure(conn, first)
            conn.rollback()
            assert 0 < work <= bound, work


def test_an_idle_workers_read_of_the_next_due_time_reads_no_scheduled_job(
    scheduled_engine: sa.Engine, backend: str
) -> None:
    """The read an idle worker sleeps by (each priority's earliest job) probes the poll index
    once or twice per priority beside 50,000 jobs scheduled for later, and finds the
    earliest: it does not read the scheduled jobs."""
    measure, bound = POLL_WORK[backend]
    for statement in priority_reads(scheduled_engine, sp.DEFAULT_QUEUE):
        check_priority_scan_plan(scheduled_engine, backend, statement)
    scan = dialect_of(scheduled_engine).priority_scan
    with scheduled_engine.connect() as conn:
        earliest = next_due_at(conn, sp.DEFAULT_QUEUE, scan)
        first = conn.execute(sa.select(sa.func.min(statements.JOB.c.process_at))).scalar_one()
        assert earliest == first
        work = measure(conn, lambda c: next_due_at(c, sp.DEFAULT_QUEUE, scan))
        conn.rollback()
        assert 0 < work <= bound, work


#: Jobs scheduled for later in a new table whose statistics were never refreshed.
UNANALYZED = (0, 2_000, 8_000)
#: MariaDB's table options: none (persistent statistics recalculated in the background once
#: a tenth of the table changed, some seconds later), or no recalculation (as stale as they get).
STATS_OPTIONS = {"mariadb": ("", "STATS_AUTO_RECALC=0")}


def test_an_idle_poll_reads_no_scheduled_job_in_a_table_never_analyzed(
    engine: sa.Engine, backend: str
) -> None:
    """In a new table whose planner statistics are still those of the empty table (no
    ANALYZE; read right after the inserts; on MariaDB with the persistent statistics'
    automatic recalculation on, and off), an idle claim (a batch of 10 with the run count,
    as the worker sends it) and the idle worker's read of the next due time each read a few
    index entries at 0, 2,000 and 8,000 jobs scheduled for later at three priorities: never
    the scheduled jobs, whatever the statistics say. Then 3 jobs of a lower priority come
    due: the claim takes them, in due order, reading as little."""
    measure, bound = POLL_WORK[backend]
    scan = dialect_of(engine).priority_scan
    claimed: list[str] = []

    def claim(c: sa.Connection) -> None:
        found = poll_due_jobs(c, sp.DEFAULT_QUEUE, sp.utc_now(), 10, with_runs=True)
        claimed[:] = [job["job_type"] for job in found]

    def sleep(c: sa.Connection) -> None:
        assert next_due_at(c, sp.DEFAULT_QUEUE, scan) == earliest

    work = {}
    for options in STATS_OPTIONS.get(backend, ("",)):
        sp.metadata.drop_all(engine)
        sp.metadata.create_all(engine)
        if options:
            with engine.begin() as conn:
                conn.exec_driver_sql(f"ALTER TABLE {statements.JOB.name} {options}")
        rng = random.Random(5)
        scheduled = 0
        for total in UNANALYZED:
            now = sp.utc_now()
            jobs = [
                build_job_values(
                    "later",
                    n,
                    process_at=now + timedelta(seconds=rng.uniform(60, 3600)),
                    priority=rng.choice((0, 1, 5)),
                )
                for n in range(scheduled, total)
            ]
            with engine.begin() as conn:
                if jobs:
                    conn.execute(sa.insert(statements.JOB), jobs)
                earliest = conn.scalar(sa.select(sa.func.min(statements.JOB.c.process_at)))
            scheduled = total
            with engine.connect() as conn:
                claim(conn)  # the first statements on a new table open it: not measured
                conn.rollback()
                work[options, total] = (measure(conn, claim), measure(conn, sleep))
                conn.rollback()
            assert claimed == [], claimed
        due = [
            build_job_values(f"due-{n}", n, process_at=now - timedelta(minutes=3 - n), priority=-1)
            for n in range(3)
        ]
        with engine.begin() as conn:
            conn.execute(sa.insert(statements.JOB), due)
        with engine.connect() as conn:
            work[options, "3 due"] = (measure(conn, claim),)
            conn.rollback()
        assert claimed == ["due-0", "due-1", "due-2"], claimed
    assert all(0 <= w <= bound for pair in work.values() for w in pair), work


def dependency_graph(engine: sa.Engine, parts: int) -> tuple[list[uuid.UUID], list[uuid.UUID]]:
    """``parts`` jobs, each with a dependent of its own waiting for it, and one join waiting
    for all of them: the parts' ids and the dependents'."""
    with engine.begin() as conn:
        part_ids = sp.enqueue_many(conn, [("part", n) for n in range(parts)])
        dependents = [sp.enqueue(conn, "next", depends_on=[part]) for part in part_ids]
        sp.enqueue(conn, "join", depends_on=part_ids)
    return part_ids, dependents


def test_a_job_ends_look_for_its_dependents_through_their_indexes(
    engine: sa.Engine, backend: str
) -> None:
    """The settle at a job's end locks the rows waiting for it through the depends_on index,
    and the dependents' rows through the job-id index, on tables whose statistics were never
    refreshed: MariaDB would rather scan a small table (and lock every row it reads, other
    ends' included); PostgreSQL reads the index of a table of 2,000 rows without statistics."""
    if backend == "sqlite":
        pytest.skip("SQLite has no row locks")
    from sqla_proletarian.statements import workflows as wsql

    part_ids, dependents = dependency_graph(engine, 1000 if backend == "postgresql" else 30)
    ended = part_ids[:3]
    if backend == "mariadb":
        pending, locked = (
            explain_as_sent(engine, wsql.pending_on(ended)),
            explain_as_sent(engine, wsql.lock_dependents(dependents[:3])),
        )
        assert [(row["key"], row["type"]) for row in pending] == [
            ("ix_proletarian_dependency_depends_on", "range")
        ], pending
        assert [(row["key"], row["type"]) for row in locked] == [
            ("uq_proletarian_job_job_id", "range")
        ], locked
        return
    # A bitmap heap scan's index is its child's (a Bitmap Index Scan node names no table).
    for statement, table, indexes in (
        (
            wsql.pending_on(ended),
            "proletarian_dependency",
            {"ix_proletarian_dependency_depends_on", "ix_proletarian_dependency_pending"},
        ),
        (wsql.lock_dependents(dependents[:3]), "proletarian_job", {"uq_proletarian_job_job_id"}),
    ):
        nodes = postgresql_plan(engine, statement)
        kinds = [node["Node Type"] for node in nodes]
        assert "Seq Scan" not in kinds, kinds
        used = {node["Index Name"] for node in nodes if "Index Name" in node}
        assert used and used <= indexes, (table, used)
