"""sp.prune_archive: deletes exactly the archived jobs that finished before the cut-off, in
short transactions of at most ``batch_size`` rows, refuses bad arguments before touching
anything, and never makes a worker wait: workers go on archiving while it runs."""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import pytest
import sqlalchemy as sa
from helpers import T0, FakeClock, count, enqueue_committed, events
from sqlalchemy.orm import Session
from test_privileges import Roles, permission_denied

import sqla_proletarian as sp
from sqla_proletarian import statements

if TYPE_CHECKING:
    from conftest import Database

OLD = T0 - timedelta(days=60)
MONTH = timedelta(days=30)


def archive(engine: sa.Engine, *rows: tuple[datetime, str]) -> list[uuid.UUID]:
    """Archive rows as a worker would write them, each ``(finished_at, status)``; their ids."""
    values = [
        {
            "job_id": uuid.uuid4(),
            "queue": sp.DEFAULT_QUEUE,
            "job_type": "work",
            "payload": "{}",
            "attempts": 1,
            "enqueued_at": finished_at - timedelta(seconds=1),
            "process_at": finished_at - timedelta(seconds=1),
            "status": status,
            "finished_at": finished_at,
            "error": None if status == "success" else "RuntimeError: no",
        }
        for finished_at, status in rows
    ]
    if values:
        with engine.begin() as conn:
            conn.execute(sa.insert(statements.ARCHIVE), values)
    return [value["job_id"] for value in values]


def archived_ids(engine: sa.Engine) -> set[uuid.UUID]:
    with engine.connect() as conn:
        return set(conn.scalars(sa.select(statements.ARCHIVE.c.job_id)))


class Transactions:
    """Counts an engine's commits and the rows each DELETE of the archive removed."""

    def __init__(self, engine: sa.Engine) -> None:
        self.commits = 0
        self.deletes: list[int] = []
        sa.event.listen(engine, "commit", self._commit)
        sa.event.listen(engine, "after_cursor_execute", self._executed)

    def _commit(self, conn: sa.Connection) -> None:
        self.commits += 1

    def _executed(self, conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.lstrip().upper().startswith("DELETE FROM PROLETARIAN_ARCHIVED_JOB"):
            self.deletes.append(cursor.rowcount)


# --- what is deleted ----------------------------------------------------------------------


def test_only_the_jobs_that_finished_before_now_minus_older_than_are_deleted(
    engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """The cut-off is exclusive and exact to the microsecond; the queue is left alone."""
    old = archive(
        engine, (T0 - timedelta(days=400), "success"), (T0 - MONTH - timedelta(0, 0, 1), "failure")
    )
    kept = archive(
        engine,
        (T0 - MONTH, "success"),
        (T0 - timedelta(days=29), "failure"),
        (T0, "success"),
        (T0 + timedelta(days=1), "success"),
    )
    queued = enqueue_committed(engine, "work", process_at=OLD)
    caplog.set_level(logging.INFO, logger="sqla_proletarian")

    deleted = sp.prune_archive(engine, older_than=MONTH, clock=FakeClock(T0))

    assert deleted == len(old) == 2
    assert archived_ids(engine) == set(kept)
    assert count(engine, sp.Job) == 1, f"the queued job {queued} stays"
    (record,) = events(caplog.records, "archive-pruned")
    assert record.deleted == 2
    assert record.levelno == logging.INFO
    assert sp.prune_archive(engine, older_than=MONTH, clock=FakeClock(T0)) == 0
    assert archived_ids(engine) == set(kept)


def test_the_status_filter_deletes_only_old_jobs_that_ended_that_way(engine: sa.Engine) -> None:
    old_successes = archive(engine, *[(OLD - timedelta(hours=n), "success") for n in range(3)])
    old_failures = archive(engine, *[(OLD - timedelta(minutes=n), "failure") for n in range(2)])
    recent = archive(engine, (T0, "success"), (T0, "failure"))
    clock = FakeClock(T0)

    assert sp.prune_archive(engine, older_than=MONTH, status="failure", clock=clock) == 2
    assert archived_ids(engine) == {*old_successes, *recent}
    assert sp.prune_archive(engine, older_than=MONTH, status="success", clock=clock) == 3
    assert archived_ids(engine) == set(recent)
    assert not set(old_failures) & archived_ids(engine)


def test_the_status_filter_takes_cancelled_jobs_too(engine: sa.Engine) -> None:
    """``status="cancelled"`` deletes the old cancelled jobs only: cancel_job archives them so."""
    job_id = enqueue_committed(engine, "work", process_at=OLD)
    with engine.begin() as conn:
        assert sp.cancel_job(conn, job_id, clock=FakeClock(OLD))
    others = archive(engine, (OLD, "success"), (OLD, "failure"))
    with engine.connect() as conn:
        cancelled = conn.scalar(
            sa.select(statements.ARCHIVE.c.status).where(statements.ARCHIVE.c.job_id == job_id)
        )
    assert cancelled == "cancelled"

    clock = FakeClock(T0)
    assert sp.prune_archive(engine, older_than=MONTH, status="cancelled", clock=clock) == 1
    assert archived_ids(engine) == set(others)


# --- batches ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("old_rows", "deletes", "commits"),
    [(10, [3, 3, 3, 1], 4), (9, [3, 3, 3], 4), (2, [2], 1), (0, [], 1)],
    ids=["10-rows", "9-rows", "2-rows", "none"],
)
def test_rows_go_in_transactions_of_at_most_batch_size_until_a_batch_comes_back_short(
    engine: sa.Engine, old_rows: int, deletes: list[int], commits: int
) -> None:
    """Each batch is a transaction of its own (9 rows take a fourth, empty, batch to know
    that nothing is left)."""
    archive(engine, *[(OLD + timedelta(seconds=n), "success") for n in range(old_rows)])
    recent = archive(engine, (T0, "success"), (T0, "failure"))
    transactions = Transactions(engine)

    deleted = sp.prune_archive(engine, older_than=MONTH, batch_size=3, clock=FakeClock(T0))

    assert deleted == old_rows
    assert transactions.deletes == deletes, "one DELETE of at most batch_size rows per batch"
    assert transactions.commits == commits, "each batch commits on its own"
    assert archived_ids(engine) == set(recent)


def test_batches_go_on_past_rows_the_status_filter_skips_and_rows_finished_at_the_same_time(
    engine: sa.Engine,
) -> None:
    """Each batch starts where the last one ended, so equal finished_at values spread over
    two batches and rows of the other status before them are neither missed nor lost."""
    same = OLD + timedelta(hours=1)
    failures = archive(engine, *[(same, "failure")] * 7, (OLD + timedelta(hours=2), "failure"))
    successes = archive(engine, *[(OLD, "success")] * 5, *[(same, "success")] * 5)

    deleted = sp.prune_archive(
        engine, older_than=MONTH, status="failure", batch_size=3, clock=FakeClock(T0)
    )

    assert deleted == len(failures) == 8
    assert archived_ids(engine) == set(successes)


def test_a_job_archived_again_while_its_batch_is_pruned_is_kept(
    database: Database, engine: sa.Engine
) -> None:
    """A failed job put back in the queue under its id, run to success by a worker between
    the batch's SELECT and its DELETE: the new archive row is not deleted with the old one.
    (On SQLite the batch holds the write lock from its start, so no worker gets between.)"""
    if database.backend == "sqlite":
        pytest.skip("SQLite: the batch holds the database's write lock from its first read")
    job_id, other = archive(engine, (OLD, "failure"), (OLD, "failure"))
    enqueue_committed(engine, "work", job_id=job_id)
    prune_engine = database.engine()
    ran: list[bool] = []

    def worker_between(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "FROM proletarian_archived_job" in statement and not ran:
            ran.append(sp.process_next_job(engine, lambda t, p: None, clock=FakeClock(T0)))

    sa.event.listen(prune_engine, "after_cursor_execute", worker_between)
    deleted = sp.prune_archive(prune_engine, older_than=MONTH, clock=FakeClock(T0))

    assert ran == [True], "the worker ran the job between the batch's SELECT and DELETE"
    assert deleted == 1
    assert archived_ids(engine) == {job_id}
    with Session(engine) as session:
        row = session.get(sp.ArchivedJob, job_id)
        assert row is not None and row.status == "success"
    assert other not in archived_ids(engine)


# --- refusals -----------------------------------------------------------------------------

BAD_ARGUMENTS: list[tuple[dict[str, Any], str]] = [
    ({"older_than": 3600}, "give a datetime.timedelta"),
    ({"older_than": 30.0}, "give a datetime.timedelta"),
    ({"older_than": "30 days"}, "give a datetime.timedelta"),
    ({"older_than": None}, "give a datetime.timedelta"),
    ({"older_than": T0}, "give a datetime.timedelta"),
    ({"older_than": timedelta(seconds=-1)}, "is negative"),
    ({"older_than": timedelta.max}, "give a shorter span"),
    ({"older_than": MONTH, "status": "failed"}, "give 'success' or 'failure'"),
    ({"older_than": MONTH, "status": "SUCCESS"}, "give 'success' or 'failure'"),
    ({"older_than": MONTH, "status": ""}, "give 'success' or 'failure'"),
    ({"older_than": MONTH, "batch_size": 0}, "from 1 to 10000"),
    ({"older_than": MONTH, "batch_size": -5}, "from 1 to 10000"),
    ({"older_than": MONTH, "batch_size": 10_001}, "from 1 to 10000"),
    ({"older_than": MONTH, "batch_size": 2.5}, "from 1 to 10000"),
    ({"older_than": MONTH, "batch_size": True}, "from 1 to 10000"),
    ({"older_than": MONTH, "batch_size": "100"}, "from 1 to 10000"),
    ({"older_than": MONTH, "clock": lambda: T0.replace(tzinfo=None)}, "aware datetime"),
]


def test_bad_arguments_are_refused_before_anything_is_deleted(engine: sa.Engine) -> None:
    ids = archive(engine, *[(OLD, "success"), (OLD, "failure")] * 3)
    transactions = Transactions(engine)
    for kwargs, hint in BAD_ARGUMENTS:
        with pytest.raises(sp.ConfigurationError, match=hint):
            sp.prune_archive(engine, **{"clock": FakeClock(T0), **kwargs})
    with pytest.raises(TypeError, match="older_than"):
        sp.prune_archive(engine)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        sp.prune_archive(engine, timedelta(days=1))  # type: ignore[misc]
    assert transactions.commits == 0 and transactions.deletes == []
    assert archived_ids(engine) == set(ids)


def test_a_session_or_a_connection_is_refused_it_needs_the_engine(engine: sa.Engine) -> None:
    """It commits each batch itself, so it cannot run inside the caller's transaction."""
    ids = archive(engine, (OLD, "success"))
    refused = sp.ConfigurationError
    with Session(engine) as session, pytest.raises(refused, match="Engine, not Session"):
        sp.prune_archive(session, older_than=MONTH)  # type: ignore[arg-type]
    with engine.connect() as conn, pytest.raises(refused, match=r"not Connection.*get_bind"):
        sp.prune_archive(conn, older_than=MONTH)  # type: ignore[arg-type]
    assert archived_ids(engine) == set(ids)


# --- beside running workers ---------------------------------------------------------------

#: Seconds each batch holds its DELETE's locks before committing, and the session setting that
#: makes a worker statement that waits for a lock longer than a second fail (and be logged).
HOLD = {"postgresql": 1.5, "mariadb": 1.5, "sqlite": 0.0}
WORKER_LOCK_TIMEOUT = {
    "postgresql": {"options": "-c lock_timeout=1000"},
    "mariadb": {"init_command": "SET SESSION innodb_lock_wait_timeout = 1"},
    "sqlite": {},
}
JOBS = 200
BATCH = 3
#: Seconds between the pruner's rounds. SQLite's one writer is shared: the workers' claims rest
#: to let the pruner in, and a pruner writing without pause would slow their drain.
ROUND_PAUSE = {"postgresql": 0.01, "mariadb": 0.01, "sqlite": 0.1}


def test_workers_keep_archiving_while_the_archive_is_pruned(
    database: Database, caplog: pytest.LogCaptureFixture
) -> None:
    """Worker threads drain a queue while prune_archive runs in a loop, each of its batches
    holding its locks for 1.5 s before it commits, and workers failing any lock wait over a
    second: every job is archived, some while a batch held its locks, all the old rows are
    deleted and nothing is logged at WARNING or above.

    The worker starts while the first short batch holds its locks, before any newer row is
    archived: a range delete at REPEATABLE READ would hold the gap at the end of the
    finished_at index then, where every archive insert goes. (SQLite has one writer at a
    time: there the two take turns, and batches hold nothing extra.)
    """
    backend = database.backend
    worker_engine = database.engine(connect_args=WORKER_LOCK_TIMEOUT[backend])
    prune_engine = database.engine()
    holds: list[tuple[datetime, datetime]] = []
    short_batch = threading.Event()

    @sa.event.listens_for(prune_engine, "after_cursor_execute")
    def hold_the_batch(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if not statement.lstrip().upper().startswith("DELETE"):
            return
        if cursor.rowcount < BATCH:
            short_batch.set()
        start = sp.utc_now()
        time.sleep(HOLD[backend])
        holds.append((start, sp.utc_now()))

    with Session(worker_engine) as session:
        for n in range(JOBS):
            sp.enqueue(session, "work", {"n": n})
        session.commit()
    caplog.set_level(logging.WARNING, logger="sqla_proletarian")
    drained = threading.Event()
    pruned: list[int] = []
    old_rows = 0
    errors: list[BaseException] = []

    def prune_in_a_loop() -> None:
        nonlocal old_rows
        try:
            while not drained.is_set():
                archive(prune_engine, *[(sp.utc_now() - timedelta(days=2), "success")] * 5)
                old_rows += 5
                pruned.append(
                    sp.prune_archive(prune_engine, older_than=timedelta(days=1), batch_size=BATCH)
                )
                time.sleep(ROUND_PAUSE[backend])
        except BaseException as exc:
            errors.append(exc)
            short_batch.set()

    pruner = threading.Thread(target=prune_in_a_loop, name="pruner")
    pruner.start()
    worker = sp.create_queue_worker(
        worker_engine,
        lambda job_type, payload: time.sleep(0.01),
        worker_threads=3,
        polling_interval=0.01,
    )
    try:
        assert short_batch.wait(timeout=30)
        with worker:
            deadline = time.monotonic() + 60
            while worker.summary()["succeeded"] < JOBS and time.monotonic() < deadline:
                time.sleep(0.02)
    finally:
        drained.set()
        pruner.join(timeout=60)

    assert not errors, errors
    assert worker.summary() == {"succeeded": JOBS, "retried": 0, "failed": 0}
    assert count(worker_engine, sp.Job) == 0
    assert pruned and sum(pruned) == old_rows, "every old row was deleted"
    with worker_engine.connect() as conn:
        finished = list(conn.scalars(sa.select(statements.ARCHIVE.c.finished_at)))
    assert len(finished) == JOBS, "every job is archived, and only the old rows were deleted"
    if HOLD[backend]:
        during = [at for at in finished if any(start <= at <= end for start, end in holds)]
        assert during, f"no job was archived while a batch held its locks: {holds}"
    bad = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not bad, [r.getMessage() for r in bad]


# --- privileges ---------------------------------------------------------------------------

SERVER_BACKENDS = [
    name
    for name in ("postgresql", "mariadb")
    if name in os.environ.get("SP_TEST_BACKENDS", "postgresql,mariadb").split(",")
]


@pytest.fixture
def roles(database: Database) -> Iterator[Roles]:
    """Roles on the test database, which PUBLIC may not use unless granted."""
    admin = database.engine(isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    if database.backend == "postgresql":
        with admin.connect() as conn:
            conn.exec_driver_sql(f"REVOKE ALL ON DATABASE {database.url.database} FROM PUBLIC")
            conn.exec_driver_sql("REVOKE ALL ON SCHEMA public FROM PUBLIC")
    made = Roles(database, admin)
    try:
        yield made
    finally:
        made.drop_all()


@pytest.mark.parametrize("empty_database", SERVER_BACKENDS, indirect=True)
def test_pruning_needs_the_documented_grants_and_each_of_them(
    roles: Roles, engine: sa.Engine
) -> None:
    """docs/privileges.md: a role with SELECT and DELETE on proletarian_archived_job,
    proletarian_job_history and proletarian_dependency (the history and the dependency rows
    of the jobs it prunes go with them, and the jobs a queued job depends on are kept),
    SELECT (job_id) and DELETE on proletarian_progress and SELECT (job_id) on
    proletarian_job prunes; without any one of them the server refuses it."""
    grants = [
        ("SELECT", "proletarian_archived_job"),
        ("DELETE", "proletarian_archived_job"),
        ("SELECT", "proletarian_job_history"),
        ("DELETE", "proletarian_job_history"),
        ("SELECT (job_id)", "proletarian_job"),
        ("SELECT", "proletarian_dependency"),
        ("DELETE", "proletarian_dependency"),
        ("SELECT (job_id)", "proletarian_progress"),
        ("DELETE", "proletarian_progress"),
    ]
    for missing in grants:
        archive(engine, (OLD, "success"))
        role = roles.make("pruner", [grant for grant in grants if grant != missing])
        with pytest.raises(sa.exc.DBAPIError) as info:
            sp.prune_archive(role.engine, older_than=MONTH, clock=FakeClock(T0))
        assert permission_denied(info.value), (missing, info.value)
    recent = archive(engine, (T0, "success"))
    role = roles.make("pruner", grants)
    assert sp.prune_archive(role.engine, older_than=MONTH, clock=FakeClock(T0)) == len(grants)
    assert archived_ids(engine) == set(recent)
