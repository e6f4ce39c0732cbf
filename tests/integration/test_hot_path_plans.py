"""Every statement of the hot path (``statements.hot_path.HOT_PATH``) reads the index its entry
names, on PostgreSQL in tables never analyzed (autovacuum off for them) and on MariaDB in small
and large tables whose statistics are never recalculated: no statement reads the queue, the
archive, the run records or the dependency table whole, whatever the statistics say. And the
registry is complete: the statements a worker sends while it drains queues in each mode
(transaction and lease, one job a claim and batches, the crash ledger on and off, limits,
dependencies, retries, failures, snoozes, heartbeats, results, progress; the threaded worker
and the asyncio worker) each match one entry, so a statement added to the hot path without an
entry (and so without a plan check) fails here."""

from __future__ import annotations

import asyncio
import random
import re
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import pytest
import sqlalchemy as sa
from helpers import wait_for
from sqlalchemy.engine import Dialect
from test_asyncio import DEFAULT_DRIVER, PREFIX, async_engine, eventually
from test_query_plan import explain_as_sent, plan_nodes

import sqla_proletarian as sp
from sqla_proletarian import statements
from sqla_proletarian.dialects import dialect_of
from sqla_proletarian.statements import hot_path
from sqla_proletarian.statements.base import LIMITS, SLOTS, STARTS
from sqla_proletarian.statements.hot_path import IDS, LARGE_TABLES, QUEUE, HotStatement, shape
from sqla_proletarian.statements.workflows import DEPENDENCY

if TYPE_CHECKING:
    from conftest import Database

#: Rows of the large tables on PostgreSQL: enough that reading one whole costs, and that the
#: planner, which reads a never-analyzed table's size from its pages, sees it.
PG_ROWS = 20_000
#: MariaDB: a few dozen rows (where it would rather scan), then a few thousand.
MARIADB_ROWS = (40, 5_000)


def only_servers(backend: str) -> None:
    if backend == "sqlite":
        pytest.skip("the hot path's plans are checked on PostgreSQL and MariaDB")


def fill(engine: sa.Engine, rows: int, start: int = 0) -> None:
    """``rows`` queued jobs (in the example queue and others, due and scheduled, at several
    priorities, some leased, some waiting on dependencies, some with concurrency keys),
    ``rows`` archived, a tenth as many run records and dependency rows; the example ids of
    ``hot_path`` among them (``start`` 0); limits, slots and starts of the example queue."""
    now = sp.utc_now()
    rng = random.Random(start + 3)
    first = [] if start else IDS

    def ids(n: int) -> list[uuid.UUID]:
        return [*first, *(uuid.UUID(int=rng.getrandbits(128), version=4) for _ in range(n))]

    job_ids = ids(rows)
    queued = [
        {
            "job_id": job_id,
            "queue": QUEUE if n % 3 else f"other-{n % 7}",
            "job_type": "work",
            "payload": f'{{"n":{n}}}',
            "attempts": 0,
            "enqueued_at": now - timedelta(hours=1),
            "process_at": now + timedelta(seconds=rng.uniform(-3600, 3600)),
            "run_order": -rng.choice((0, 0, 0, 1, 5)),
            "lease_token": uuid.uuid4() if n % 11 == 0 else None,
            "waiting_on": 1 if n % 13 == 0 else 0,
            "concurrency_key": f"key-{n % 5}" if n % 2 else None,
        }
        for n, job_id in enumerate(job_ids)
    ]
    archived = [
        {
            "job_id": job_id,
            "queue": QUEUE,
            "job_type": "work",
            "payload": "{}",
            "attempts": 1,
            "enqueued_at": now - timedelta(minutes=n + 1),
            "process_at": now - timedelta(minutes=n + 1),
            "status": "success",
            "finished_at": now - timedelta(minutes=n),
        }
        for n, job_id in enumerate(ids(rows))
    ]
    few = max(len(job_ids) // 10, len(first))
    runs = [
        {
            "run_id": uuid.uuid4(),
            "job_id": job_id,
            "worker_id": "w",
            "started_at": now,
            "owner": None,
            "batched": False,
        }
        for job_id in job_ids[:few]
    ]
    dependencies = [
        {
            "job_id": job_ids[-1 - n],
            "depends_on": job_ids[n],
            "kind": "success",
            "pending": n % 4 != 0,
        }
        for n in range(few)
    ]
    with engine.begin() as conn:
        conn.execute(sa.insert(statements.JOB), queued)
        conn.execute(sa.insert(statements.ARCHIVE), archived)
        conn.execute(sa.insert(statements.RUN), runs)
        conn.execute(sa.insert(DEPENDENCY), dependencies)
        if start:
            return
        conn.execute(
            sa.insert(LIMITS),
            {"queue": QUEUE, "max_running": 5, "max_running_per_key": 2, "updated_at": now},
        )
        keys = ["", *(f"key-{k}" for k in range(5))]
        conn.execute(
            sa.insert(SLOTS),
            [{"queue": QUEUE, "slot_key": key, "n": n} for key in keys for n in range(1, 6)],
        )
        conn.execute(
            sa.insert(STARTS),
            [
                {
                    "id": uuid.uuid4(),
                    "queue": QUEUE,
                    "slot_key": key,
                    "started_at": now,
                    "starts": 1,
                }
                for key in keys
            ],
        )


def explained(text: str) -> bool:
    """Whether a statement has a plan (session settings have none)."""
    return re.match(r"\s*(SELECT|INSERT|UPDATE|DELETE|WITH)\b", text) is not None


def pg_scans(entry: HotStatement, engine: sa.Engine) -> list[tuple[str, frozenset[str | None]]]:
    """(table, indexes) of each read of a table in PostgreSQL's plan of the entry's statement;
    a scan of the whole table reads the index None. A bitmap heap scan reads its bitmap
    index scans' indexes (those nodes name no table)."""
    (row,) = explain_as_sent(engine, entry.build(dialect_of(engine)), "EXPLAIN (FORMAT JSON) ")
    (document,) = row.values()
    reads = []
    for node in plan_nodes(document[0]["Plan"]):
        if "Relation Name" not in node or node["Node Type"] == "ModifyTable":
            continue
        if node["Node Type"] == "Bitmap Heap Scan":
            indexes = {n.get("Index Name") for n in plan_nodes(node) if n is not node}
            reads.append((node["Relation Name"], frozenset(indexes - {None})))
        else:
            reads.append((node["Relation Name"], frozenset({node.get("Index Name")})))
    return reads


def mariadb_scans(
    entry: HotStatement, engine: sa.Engine
) -> list[tuple[str, frozenset[str | None]]]:
    """(table, indexes) of each table MariaDB's plan reads (through the key named; None for a
    scan of the table or of a whole index); the table written by an INSERT is not read."""
    executable, params = entry.build(dialect_of(engine))
    target = re.search(r"FROM (\w+) AS target", entry.text(dialect_of(engine), engine.dialect))
    reads = []
    for row in explain_as_sent(engine, (executable, params)):
        table = row["table"]
        if table is None or row["select_type"] == "INSERT" or table.startswith("<"):
            continue
        if table == "target" and target is not None:
            table = target.group(1)
        whole = row["type"] in ("ALL", "index")
        reads.append((table, frozenset({None if whole else row["key"]})))
    return reads


def wrong_reads(
    entry: HotStatement, reads: list[tuple[str, frozenset[str | None]]], primary: str | None
) -> list[str]:
    """What is wrong with a plan's reads: a table read through an index its entry does not
    name, or a large table read whole or not named at all."""
    problems = []
    for table, indexes in reads:
        allowed = entry.reads.get(table)
        if allowed is None:
            if table in LARGE_TABLES:
                problems.append(f"reads {table} (through {set(indexes)}), which it does not name")
            continue
        if primary is not None:
            allowed = frozenset(primary if name.startswith("pk_") else name for name in allowed)
        if not indexes or not indexes <= allowed:
            problems.append(f"reads {table} through {set(indexes)}, not {set(allowed)}")
    return problems


def check_plans(engine: sa.Engine, backend: str) -> dict[str, list[str]]:
    """Each entry's problems, by name (none: every plan reads what its entry names)."""
    dialect = dialect_of(engine)
    scans = pg_scans if backend == "postgresql" else mariadb_scans
    primary = "PRIMARY" if backend == "mariadb" else None
    problems: dict[str, list[str]] = {}
    for entry in hot_path.hot_path(dialect):
        if not explained(entry.text(dialect, engine.dialect)):
            continue
        reads = scans(entry, engine)
        found = wrong_reads(entry, reads, primary)
        if backend == "postgresql":
            # PostgreSQL shows every read: each table the entry names is among them.
            read = {table for table, _ in reads}
            found += [f"does not read {table}" for table in entry.reads if table not in read]
        if found:
            problems[entry.name] = found
    return problems


def assert_plans(engine: sa.Engine, backend: str, tables: str) -> None:
    problems = check_plans(engine, backend)
    lines = [f"{name}: {'; '.join(found)}" for name, found in sorted(problems.items())]
    assert not problems, f"in {tables}:\n" + "\n".join(lines)


def test_every_hot_path_statement_reads_its_index_in_tables_whose_statistics_never_ran(
    engine: sa.Engine, backend: str
) -> None:
    """PostgreSQL: 20,000 jobs, 20,000 archived, 2,000 run records and dependency rows in
    tables never analyzed, autovacuum off for them; MariaDB: 40 of each, then 5,000, its
    statistics never recalculated (``STATS_AUTO_RECALC=0``: its planner keeps those of the
    empty tables). Each statement of the hot path reads each table through the index its
    entry names, and no large table whole."""
    only_servers(backend)
    if backend == "postgresql":
        with engine.begin() as conn:
            for table in sp.metadata.sorted_tables:
                conn.exec_driver_sql(f"ALTER TABLE {table.name} SET (autovacuum_enabled = false)")
        fill(engine, PG_ROWS)
        with engine.connect() as conn:
            analyzed = conn.exec_driver_sql(
                "SELECT relname FROM pg_stat_user_tables WHERE relname LIKE 'proletarian%%' "
                "AND (last_analyze IS NOT NULL OR last_autoanalyze IS NOT NULL)"
            ).all()
        assert analyzed == [], analyzed
        assert_plans(engine, backend, "tables never analyzed")
        return
    small, large = MARIADB_ROWS
    with engine.begin() as conn:
        for table in sp.metadata.sorted_tables:
            conn.exec_driver_sql(f"ALTER TABLE {table.name} STATS_AUTO_RECALC=0")
    fill(engine, small)
    assert_plans(engine, backend, "small tables")
    fill(engine, large, start=small)
    assert_plans(engine, backend, "large tables")


# --- the registry is complete -----------------------------------------------------------------

PLAIN, LIMITED = "plain", "limited"
#: The worker's modes, each drained once: transaction and lease mode, one job a claim and
#: batches, the crash ledger off.
MODES: dict[str, dict[str, Any]] = {
    "transaction": {},
    "transaction, batches": {"batch_size": 10},
    "transaction, no ledger": {"max_unclean_ends": None},
    "lease": {"lease_seconds": 5, "heartbeat_interval": 0.1},
    "lease, batches": {"lease_seconds": 5, "heartbeat_interval": 0.1, "batch_size": 10},
    "lease, no ledger": {"lease_seconds": 5, "heartbeat_interval": 0.1, "max_unclean_ends": None},
}


class Handler:
    """``ok`` succeeds, with its payload as its result where it is a number, and reads its
    dependencies' results where it has some; ``doomed`` raises (one retry, then it fails);
    ``snoozy`` snoozes once; ``slow`` reports progress and runs long enough for lease
    heartbeats."""

    def __init__(self) -> None:
        self.snoozed: set[Any] = set()
        self.lock = threading.Lock()

    def __call__(self, job_type: str, payload: Any) -> Any:
        if job_type == "ok":
            if payload in ("chain-2", "join"):
                return len(sp.current_job().dependency_results)
            return payload if isinstance(payload, int) else None
        if job_type == "doomed":
            raise RuntimeError("doomed")
        if job_type == "snoozy":
            with self.lock:
                first = payload not in self.snoozed
                self.snoozed.add(payload)
            if first:
                raise sp.Snooze(0)
        if job_type == "slow":
            sp.current_job().set_progress(0.5, "half")
            time.sleep(0.4)
        return None


def enqueue_work(engine: sa.Engine) -> None:
    """A plain queue's jobs (successes, a retried failure, a snooze, a slow job, a chain and
    a fan-in) and a limited queue's (with concurrency keys)."""
    with engine.begin() as conn:
        sp.enqueue_many(conn, [("ok", n) for n in range(8)], queue=PLAIN)
        for job_type in ("doomed", "snoozy", "slow"):
            sp.enqueue(conn, job_type, 0, queue=PLAIN)
        first = sp.enqueue(conn, "ok", "chain-1", queue=PLAIN)
        second = sp.enqueue(conn, "ok", "chain-2", queue=PLAIN, depends_on=[first])
        sp.enqueue(conn, "ok", "chain-3", queue=PLAIN, depends_on=[second])
        parts = [sp.enqueue(conn, "ok", f"part-{n}", queue=PLAIN) for n in range(3)]
        sp.enqueue(conn, "ok", "join", queue=PLAIN, depends_on=parts)
        for n in range(8):
            key = None if n % 4 == 0 else f"key-{n % 2}"
            sp.enqueue(conn, "ok", n, queue=LIMITED, concurrency_key=key)


def queued(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(sa.select(sa.func.count()).select_from(statements.JOB)) or 0)


@pytest.fixture
def limited_queue(engine: sa.Engine) -> Iterator[None]:
    with engine.begin() as conn:
        sp.set_queue_limits(
            conn,
            LIMITED,
            max_running=4,
            max_running_per_key=2,
            rate_limit=(1000, 1),
            rate_limit_per_key=(1000, 1),
        )
    yield


def drain(database: Database, engine: sa.Engine, options: dict[str, Any]) -> dict[str, int]:
    """The SQL texts a worker of ``options`` sent while it drained the queues (each with how
    often), recorded on its own engine by a listener the direct path calls too."""
    sent: dict[str, int] = {}
    lock = threading.Lock()

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        with lock:
            sent[statement] = sent.get(statement, 0) + 1

    record.worker_own = True  # type: ignore[attr-defined]
    worker_engine = database.engine(pool_size=10)
    sa.event.listen(worker_engine, "before_cursor_execute", record)
    enqueue_work(engine)
    worker = sp.create_queue_worker(
        worker_engine,
        Handler(),
        queues=[PLAIN, LIMITED],
        worker_threads=2,
        polling_interval=0.05,
        retry_strategy=lambda job, exc: sp.RetryStrategy(1),
        **options,
    )
    worker.start()
    try:
        assert wait_for(lambda: queued(engine) == 0, timeout=60), options
    finally:
        worker.stop()
    worker_engine.dispose()
    return sent


#: The asyncio worker's modes, drained through the backend's default async driver.
ASYNC_MODES: dict[str, dict[str, Any]] = {
    "asyncio": {},
    "asyncio, lease, batches": {"lease_seconds": 5, "heartbeat_interval": 0.1, "batch_size": 10},
}


async def async_handler(job_type: str, payload: Any) -> Any:
    """As ``Handler``, for the asyncio worker: ``doomed`` raises, ``slow`` runs a while."""
    if job_type == "doomed":
        raise RuntimeError("doomed")
    if job_type == "slow":
        await asyncio.sleep(0.4)
    return payload if isinstance(payload, int) else None


def async_drain(
    database: Database, engine: sa.Engine, options: dict[str, Any]
) -> tuple[dict[str, int], Dialect]:
    """The SQL texts an asyncio worker of ``options`` sent while it drained the queues, and
    its driver's dialect."""
    sent: dict[str, int] = {}
    url = database.url.set(
        drivername=f"{PREFIX[database.backend]}+{DEFAULT_DRIVER[database.backend]}"
    )

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        sent[statement] = sent.get(statement, 0) + 1

    async def run() -> Dialect:
        enqueue_work(engine)
        async with async_engine(url, pool_size=10) as worker_engine:
            sa.event.listen(worker_engine.sync_engine, "before_cursor_execute", record)
            worker = sp.create_async_queue_worker(
                worker_engine,
                async_handler,
                queues=[PLAIN, LIMITED],
                concurrency=2,
                polling_interval=0.05,
                retry_strategy=lambda job, exc: sp.RetryStrategy(1),
                **options,
            )
            await worker.start()
            try:
                assert await eventually(lambda: queued(engine) == 0, timeout=60), options
            finally:
                await worker.stop()
            return worker_engine.sync_engine.dialect

    return sent, asyncio.run(run())


def test_the_registry_names_every_statement_a_worker_sends_in_each_mode(
    database: Database, engine: sa.Engine, backend: str, limited_queue: None
) -> None:
    """Drains in each mode, by the threaded worker and by the asyncio worker (asyncpg,
    aiomysql): every SQL text the worker sent has the shape of one entry's statement on this
    server and driver (its parameters left out); the text of a statement no entry names is
    reported with the modes that sent it."""
    only_servers(backend)
    dialect = dialect_of(engine)
    known = {shape(entry.text(dialect, engine.dialect)) for entry in hot_path.hot_path(dialect)}
    unnamed: dict[str, tuple[str, set[str]]] = {}

    def name(texts: dict[str, int], mode: str, known: set[str]) -> None:
        assert texts, f"{mode}: the worker sent nothing the listener saw"
        for text in texts:
            if shape(text) not in known:
                _, modes = unnamed.setdefault(shape(text), (" ".join(text.split()), set()))
                modes.add(mode)

    for mode, options in MODES.items():
        name(drain(database, engine, options), mode, known)
    for mode, options in ASYNC_MODES.items():
        texts, async_dialect = async_drain(database, engine, options)
        entries = hot_path.hot_path(dialect)
        name(texts, mode, {shape(entry.text(dialect, async_dialect)) for entry in entries})
    lines = [f"{', '.join(sorted(modes))}: {text}" for text, modes in sorted(unnamed.values())]
    assert not unnamed, "statements no entry of hot_path names:\n" + "\n".join(lines)
