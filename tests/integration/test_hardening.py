"""The job's transaction and row lock, and crash accounting, in the setups users run.

Each test names a promise the README makes and a way 0.1.0 broke it: deadlocks that roll
back InnoDB's whole transaction, handlers that use their session in any idiomatic way,
engines with other isolation levels, connections killed under a live worker, shutdowns
that give up on a job, and run records of workers that are still alive.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import sqlalchemy as sa
from helpers import (
    FakeClock,
    archived,
    archived_job,
    count,
    enqueue_committed,
    events,
    job_row,
    run_records,
    wait_for,
)
from sqlalchemy.orm import Session

import sqla_proletarian as sp
from sqla_proletarian import ledger
from sqla_proletarian.dialects import dialect_of

if TYPE_CHECKING:
    from conftest import Database

ACCOUNTS = sa.Table(
    "hardening_account",
    sa.MetaData(),
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("balance", sa.Integer, nullable=False),
    mysql_engine="InnoDB",
)


@pytest.fixture
def accounts(engine: sa.Engine) -> sa.Table:
    """An application table with rows 1 and 2, balance 0."""
    ACCOUNTS.create(engine)
    with engine.begin() as conn:
        conn.execute(sa.insert(ACCOUNTS), [{"id": 1, "balance": 0}, {"id": 2, "balance": 0}])
    return ACCOUNTS


def balances(engine: sa.Engine) -> dict[int, int]:
    with engine.connect() as conn:
        return {
            row[0]: row[1] for row in conn.execute(sa.select(ACCOUNTS.c.id, ACCOUNTS.c.balance))
        }


def add(session: Session, account: int, amount: int) -> None:
    session.execute(
        sa.update(ACCOUNTS)
        .where(ACCOUNTS.c.id == account)
        .values(balance=ACCOUNTS.c.balance + amount)
    )


def no_handler(job_type: str, payload: Any) -> None:
    raise AssertionError("no handler may run here")


# --- 1. a deadlock inside the handler ------------------------------------------------------


@pytest.mark.parametrize("handler_swallows", [False, True], ids=["raises", "swallows"])
def test_an_innodb_deadlock_between_two_handlers_records_nothing_for_the_victim_and_runs_it_again(
    engine: sa.Engine, backend: str, accounts: sa.Table, handler_swallows: bool
) -> None:
    """Two handlers lock accounts 1 and 2 in opposite order through ``job.session``. On
    InnoDB the victim's whole transaction (its job's row lock included) is rolled back: the
    worker records no outcome for that run (the handler raised, or swallowed the error and
    returned), and the job runs again and succeeds. Elsewhere a deadlock inside the handler's
    savepoint is an ordinary handler error, and the retry strategy retries it."""
    if backend == "sqlite":
        pytest.skip("SQLite has no row locks: one claim holds the whole database")
    first = enqueue_committed(engine, "transfer", {"order": [1, 2]})
    second = enqueue_committed(engine, "transfer", {"order": [2, 1]})
    both_hold_one = threading.Barrier(2, timeout=10)
    runs: dict[uuid.UUID, int] = {first: 0, second: 0}

    def handler(job: sp.JobContext) -> None:
        runs[job.job_id] += 1
        one, other = job.payload["order"]
        add(job.session, one, 1)
        if runs[job.job_id] == 1:
            both_hold_one.wait()
        try:
            add(job.session, other, 10)
        except sa.exc.OperationalError:
            if not handler_swallows:
                raise

    worker = sp.create_queue_worker(
        engine,
        handler,
        handler_mode="advanced",
        worker_threads=2,
        polling_interval=0.02,
        retry_strategy=lambda job, exc: sp.RetryStrategy(1),
    )
    with worker:
        assert wait_for(lambda: count(engine, sp.ArchivedJob) == 2, timeout=20)
    rows = {row.job_id: row for row in archived(engine)}
    assert {row.status for row in rows.values()} == {"success"}
    assert balances(engine) == {1: 11, 2: 11}, "each job's writes committed exactly once"
    assert sorted(runs.values()) == [1, 2]
    victim = first if runs[first] == 2 else second
    if backend == "mariadb":
        assert rows[victim].attempts == 1, "the rolled-back run recorded nothing"
    elif not handler_swallows:
        assert rows[victim].attempts == 2, "a PostgreSQL deadlock is the handler's error"
    assert run_records(engine) == 0


def test_an_outcome_that_finds_the_job_row_gone_records_nothing_and_leaves_the_job_queued(
    engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """The job DELETE touching no row means the claim lost its row: the whole transaction
    rolls back, no archive row or attempt is written, and the job is left queued for the next
    run. (The handler removes the row through its own session, the one way to make that
    happen on demand; a handler that raises has its writes rolled back first.)"""
    job_id = enqueue_committed(engine, "vanish")

    def handler(job: sp.JobContext) -> None:
        job.session.execute(sa.delete(sp.Job).where(sp.Job.job_id == job.job_id))

    caplog.set_level(logging.WARNING, logger="sqla_proletarian")
    assert sp.process_next_job(
        engine,
        handler,
        handler_mode="advanced",
        retry_strategy=lambda job, exc: sp.RetryStrategy(3),
    )
    assert archived_job(engine, job_id) is None
    row = job_row(engine, job_id)
    assert row is not None and row.attempts == 0
    assert [r.job_id for r in events(caplog.records, "job-transaction-lost")] == [job_id]
    assert run_records(engine) == 0


# --- 2. the handler's session, used every idiomatic way ------------------------------------


def _begin_block(session: Session) -> None:
    with session.begin():
        add(session, 1, 1)


def _commit(session: Session) -> None:
    add(session, 1, 1)
    session.commit()


def _nested(session: Session) -> None:
    with session.begin_nested():
        add(session, 1, 1)
    session.commit()


def _rollback_then_write(session: Session) -> None:
    add(session, 2, 100)
    session.rollback()
    add(session, 1, 1)


def _orm_add(session: Session) -> None:
    session.execute(sa.update(ACCOUNTS).where(ACCOUNTS.c.id == 1).values(balance=1))
    session.flush()


def _job_connection(session: Session) -> sa.Connection:
    """The job's Connection, reached past the Session (``job.session.bind``)."""
    bind = session.bind
    assert isinstance(bind, sa.Connection)
    return bind


_CREDIT_ONE = sa.update(ACCOUNTS).where(ACCOUNTS.c.id == 1).values(balance=ACCOUNTS.c.balance + 1)


def _bind_execute(session: Session) -> None:
    _job_connection(session).execute(_CREDIT_ONE)


def _connection_execute(session: Session) -> None:
    session.connection().execute(_CREDIT_ONE)


def _bind_driver_sql(session: Session) -> None:
    _job_connection(session).exec_driver_sql(
        "UPDATE hardening_account SET balance = balance + 1 WHERE id = 1"
    )


def _bind_nested(session: Session) -> None:
    with _job_connection(session).begin_nested():
        _job_connection(session).execute(_CREDIT_ONE)


SESSION_IDIOMS = {
    "with-begin": _begin_block,
    "commit": _commit,
    "begin-nested": _nested,
    "rollback-then-write": _rollback_then_write,
    "flush": _orm_add,
    "bind-execute": _bind_execute,
    "connection-execute": _connection_execute,
    "bind-exec-driver-sql": _bind_driver_sql,
    "bind-begin-nested": _bind_nested,
}


@pytest.mark.parametrize("raises", [True, False], ids=["then-raises", "then-returns"])
@pytest.mark.parametrize("idiom", list(SESSION_IDIOMS))
def test_the_handlers_writes_roll_back_if_it_raises_whatever_it_did_with_its_session(
    engine: sa.Engine, accounts: sa.Table, idiom: str, raises: bool
) -> None:
    """``with job.session.begin():``, ``commit()``, ``begin_nested()``, ``rollback()``: the
    worker owns the savepoint around all of it, so a raise afterwards rolls the writes back
    beside the failure row, and a return commits them once, with the archive row."""
    job_id = enqueue_committed(engine, "idiom")

    def handler(job: sp.JobContext) -> None:
        SESSION_IDIOMS[idiom](job.session)
        if raises:
            raise RuntimeError("after the writes")

    assert sp.process_next_job(engine, handler, handler_mode="advanced")
    row = archived_job(engine, job_id)
    assert row is not None
    assert row.status == ("failure" if raises else "success")
    assert balances(engine) == ({1: 0, 2: 0} if raises else {1: 1, 2: 0})


def test_writes_past_the_session_roll_back_with_a_retried_run_and_commit_with_its_success(
    engine: sa.Engine, accounts: sa.Table
) -> None:
    """Through ``job.session.bind``: the first run writes and raises, and is retried with
    nothing written; the second run's write commits with its success."""
    job_id = enqueue_committed(engine, "retried")

    def handler(job: sp.JobContext) -> None:
        _bind_execute(job.session)
        if job.attempts == 1:
            raise RuntimeError("first run")

    options: dict[str, Any] = {"handler_mode": "advanced"}
    options["retry_strategy"] = lambda job, exc: sp.RetryStrategy(1, delays=[0])
    assert sp.process_next_job(engine, handler, **options)
    row = job_row(engine, job_id)
    assert row is not None and row.attempts == 1
    assert balances(engine) == {1: 0, 2: 0}
    assert sp.process_next_job(engine, handler, **options)
    assert archived_job(engine, job_id).status == "success"  # type: ignore[union-attr]
    assert balances(engine) == {1: 1, 2: 0}


def test_a_handler_that_executes_nothing_costs_no_savepoint(engine: sa.Engine) -> None:
    """The worker's savepoint opens at the handler's first statement, not before: none for
    a handler that never touches the job's connection, one for a handler that does."""
    statements: list[str] = []

    def seen(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement.split()[0].upper())

    sa.event.listen(engine, "before_cursor_execute", seen)
    savepoints = []
    for touch in (False, True):
        enqueue_committed(engine, "touch" if touch else "idle")
        statements.clear()

        def handler(job: sp.JobContext, touch: bool = touch) -> None:
            if touch:
                _job_connection(job.session).execute(sa.text("SELECT 1"))

        assert sp.process_next_job(engine, handler, handler_mode="advanced")
        savepoints.append(statements.count("SAVEPOINT"))
    assert savepoints == [0, 1]


# --- 3. engines with other isolation levels -------------------------------------------------

ISOLATION_LEVELS = ["AUTOCOMMIT", "REPEATABLE READ", "SERIALIZABLE"]


def isolation_level_of(backend: str, level: str) -> str:
    """The level, or on SQLite (which knows no REPEATABLE READ) its nearest one."""
    return "READ UNCOMMITTED" if backend == "sqlite" and level == "REPEATABLE READ" else level


@pytest.mark.parametrize("isolation_level", ISOLATION_LEVELS)
def test_the_job_row_stays_locked_while_its_handler_runs_whatever_the_engines_isolation_level(
    database: Database, backend: str, isolation_level: str
) -> None:
    """An AUTOCOMMIT engine would release ``FOR UPDATE`` when the poll returns: the worker's
    claim runs at READ COMMITTED in a transaction whatever the engine says, so while the
    handler runs no other claim can take the job, and the handler sees READ COMMITTED."""
    if backend == "sqlite":
        pytest.skip("SQLite has one isolation level and no row locks")
    engine = database.engine(isolation_level=isolation_level)
    observer = database.engine()
    job_id = enqueue_committed(observer, "look")
    seen: dict[str, Any] = {}

    def handler(job: sp.JobContext) -> None:
        with observer.begin() as other:
            query = sa.select(sp.Job.job_id).with_for_update(skip_locked=True)
            seen["claimable"] = other.execute(query).scalars().all()
        statement = (
            "SHOW transaction_isolation" if backend == "postgresql" else "SELECT @@tx_isolation"
        )
        seen["isolation"] = job.session.execute(sa.text(statement)).scalar()

    assert sp.process_next_job(engine, handler, handler_mode="advanced")
    assert seen["claimable"] == [], "another claim could take the running job"
    assert str(seen["isolation"]).lower().replace("-", " ") == "read committed"
    assert archived_job(observer, job_id) is not None


@pytest.mark.parametrize("isolation_level", ISOLATION_LEVELS)
def test_threads_drain_a_queue_without_serialization_failures_at_any_engine_isolation_level(
    database: Database, isolation_level: str, caplog: pytest.LogCaptureFixture
) -> None:
    """REPEATABLE READ and SERIALIZABLE engines gave streams of 40001; AUTOCOMMIT committed
    outcomes piecemeal. Four threads drain 40 jobs, each archived once, with no transient
    errors logged."""
    engine = database.engine(isolation_level=isolation_level_of(database.backend, isolation_level))
    with Session(engine) as session:
        for n in range(40):
            sp.enqueue(session, "n", n)
        session.commit()
    ran: list[int] = []
    caplog.set_level(logging.WARNING, logger="sqla_proletarian")
    with sp.create_queue_worker(
        engine, lambda job_type, n: ran.append(n), worker_threads=4, polling_interval=0.02
    ):
        assert wait_for(lambda: count(engine, sp.ArchivedJob) == 40, timeout=30)
    assert sorted(ran) == list(range(40))
    assert events(caplog.records, "transient-polling-error") == []
    assert count(engine, sp.Job) == 0


# --- 6, 7. only a dead worker's run is an unclean end --------------------------------------


class LiveOwner:
    """A run record written as a live worker writes it: its owner held by an open session
    (PostgreSQL, MariaDB) or by this process (SQLite)."""

    def __init__(self, engine: sa.Engine) -> None:
        self.dialect = dialect_of(engine)
        self.kind = self.dialect.owner_lock
        self.owner = ledger.new_owner(self.kind)
        self.conn: sa.Connection | None = engine.connect().execution_options(
            isolation_level="AUTOCOMMIT"
        )
        ledger.hold(self.kind, self.owner, self.conn)

    def record(self, job_id: uuid.UUID) -> None:
        assert self.conn is not None
        records = ledger.ClaimRecords(self.dialect, self.owner, "live", sp.utc_now)
        records.begin(self.conn, [job_id])

    def die(self) -> None:
        """The owner's session ends (the worker process is gone)."""
        assert self.conn is not None
        self.conn.invalidate()
        self.conn.close()
        self.conn = None


def test_a_job_whose_run_record_has_a_live_worker_is_left_alone_and_never_charged(
    engine: sa.Engine, backend: str
) -> None:
    """0.1 counted every leftover record, and 0.2 ran the job again at once: a record of a
    run whose connection was killed (or restarted away) under a live worker made a second
    worker start the job while the first handler still ran. Now the claim leaves the job
    alone while its record's worker lives, and runs it, uncharged, once the record is gone."""
    if backend == "sqlite":
        pytest.skip("SQLite's owner is the process: it cannot die inside this test")
    job_id = enqueue_committed(engine, "healthy")
    owner = LiveOwner(engine)
    owner.record(job_id)
    ran: list[str] = []

    def run_next() -> bool:
        return sp.process_next_job(
            engine, lambda job_type, payload: ran.append(job_type), max_unclean_ends=1
        )

    assert not run_next(), "the job's first run may still be going"
    assert ran == [] and job_row(engine, job_id) is not None
    with engine.begin() as conn:  # the live worker's run ends: it removes its record
        conn.execute(sa.delete(sp.JobRun))
    assert wait_for(run_next, timeout=5)
    row = archived_job(engine, job_id)
    assert row is not None and (row.status, row.attempts) == ("success", 1)
    assert ran == ["healthy"]
    owner.die()


def test_a_run_record_counts_as_an_unclean_end_once_its_worker_is_gone(
    engine: sa.Engine, backend: str
) -> None:
    """The same record, once its owner's session has ended, is an unclean end: with
    max_unclean_ends=1 the job is archived as crashed without running."""
    if backend == "sqlite":
        pytest.skip("SQLite's owner is the process: see the crash-loop tests")
    job_id = enqueue_committed(engine, "doomed")
    owner = LiveOwner(engine)
    owner.record(job_id)
    owner.die()
    assert sp.process_next_job(engine, no_handler, max_unclean_ends=1, reconnect_grace=0)
    row = archived_job(engine, job_id)
    assert row is not None and row.status == "failure"
    assert row.error is not None and "JobCrashedError" in row.error
    assert run_records(engine) == 0


def test_a_worker_whose_session_ended_counts_only_once_it_has_stayed_gone_for_the_grace(
    engine: sa.Engine, backend: str
) -> None:
    """A restart, failover or killed session ends a live worker's session; it takes its
    owner back within a second. So a record whose owner just vanished holds the job (no run,
    no charge) until the owner has stayed gone for reconnect_grace; then it counts."""
    if backend == "sqlite":
        pytest.skip("SQLite's owner is the process: it cannot die inside this test")
    job_id = enqueue_committed(engine, "doomed")
    owner = LiveOwner(engine)
    owner.record(job_id)
    owner.die()

    def run_next() -> bool:
        return sp.process_next_job(engine, no_handler, max_unclean_ends=1, reconnect_grace=1.5)

    started = time.monotonic()
    assert not run_next(), "the owner may be reconnecting: the job is left alone"
    assert job_row(engine, job_id) is not None and run_records(engine) == 1
    assert wait_for(run_next, timeout=10)
    assert time.monotonic() - started >= 1.5
    row = archived_job(engine, job_id)
    assert row is not None and row.status == "failure"
    assert row.error is not None and "crashed its worker" in row.error


def test_the_records_of_a_batch_whose_worker_died_charge_nobody_and_make_its_jobs_suspects(
    engine: sa.Engine, backend: str
) -> None:
    """Which handler of a batch was running when its worker died is not known, so a dead
    batch's records are no unclean end of any of its jobs; they mark the jobs to run alone."""
    if backend == "sqlite":
        pytest.skip("SQLite's owner is the process: it cannot die inside this test")
    finished = enqueue_committed(engine, "finished")
    running = enqueue_committed(engine, "running")
    owner = LiveOwner(engine)
    assert owner.conn is not None
    records = ledger.ClaimRecords(owner.dialect, owner.owner, "batch", sp.utc_now)
    records.begin(owner.conn, [finished, running])
    owner.die()
    dialect = dialect_of(engine)
    with engine.begin() as conn:
        for job_id in (finished, running):
            past = ledger.past_runs(dialect, conn, job_id, 1, grace=0)
            assert (past.unclean_ends, past.suspect) == (0, True)
    ran: list[str] = []
    assert sp.process_next_job(
        engine,
        lambda job_type, payload: ran.append(job_type),
        batch_size=5,
        max_unclean_ends=1,
        reconnect_grace=0,
    )
    assert ran == ["finished"], "a suspect runs alone"


def test_a_claim_that_checks_a_dead_owner_does_not_make_it_look_alive_to_other_claims(
    engine: sa.Engine, backend: str
) -> None:
    """Three jobs of a batch whose worker died: a first claim (of one job) runs one of them
    and holds its transaction open while the handler runs. A second claim meanwhile must still
    see the owner as dead (0.2 took the owner's lock to test it, until the first claim
    committed, so the second saw a live owner and ran the dead batch's jobs together)."""
    if backend == "sqlite":
        pytest.skip("SQLite's owner is the process: it cannot die inside this test")
    ids = [enqueue_committed(engine, f"job-{n}") for n in range(3)]
    owner = LiveOwner(engine)
    assert owner.conn is not None
    ledger.ClaimRecords(owner.dialect, owner.owner, "batch", sp.utc_now).begin(owner.conn, ids)
    owner.die()
    first_running, release = threading.Event(), threading.Event()
    ran: list[list[str]] = []

    def first(job_type: str, payload: Any) -> None:
        first_running.set()
        release.wait(10)

    options: dict[str, Any] = {"batch_size": 5, "max_unclean_ends": 3, "reconnect_grace": 0}
    one = {**options, "batch_size": 1}
    claim = threading.Thread(target=lambda: sp.process_next_job(engine, first, **one))
    claim.start()
    try:
        assert first_running.wait(10)
        batch: list[str] = []
        assert sp.process_next_job(engine, lambda job_type, p: batch.append(job_type), **options)
        ran.append(batch)
    finally:
        release.set()
        claim.join(10)
    assert ran == [["job-1"]], "a dead batch's job runs alone, whoever else checked its owner"


def test_a_job_whose_session_the_server_ends_while_its_handler_runs_is_charged_never_overlapped(
    engine: sa.Engine, backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The server ends the job's session (as an idle-transaction limit does, or a kill of
    that one session) while its handler runs, each run: the live worker's other sessions
    survive, so each loss counts as an unclean end; meanwhile the worker's second thread
    leaves the job alone. After max_unclean_ends such runs the job is archived as failed,
    naming the cause, instead of looping."""
    if backend == "sqlite":
        pytest.skip("SQLite has no server connections to kill")
    job_id = enqueue_committed(engine, "killed")
    admin = sa.create_engine(engine.url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    runs: list[int] = []
    running = threading.Semaphore(1)
    overlaps: list[int] = []

    def handler(job: sp.JobContext) -> None:
        if not running.acquire(blocking=False):
            overlaps.append(job.attempts)
            return
        try:
            runs.append(job.attempts)
            if backend == "postgresql":
                pid = job.session.execute(sa.text("SELECT pg_backend_pid()")).scalar()
                kill = f"SELECT pg_terminate_backend({int(pid or 0)})"
            else:
                pid = job.session.execute(sa.text("SELECT CONNECTION_ID()")).scalar()
                kill = f"KILL {int(pid or 0)}"
            with admin.connect() as conn:
                conn.exec_driver_sql(kill)
            time.sleep(0.5)  # the other thread polls meanwhile
        finally:
            running.release()

    caplog.set_level(logging.WARNING, logger="sqla_proletarian")
    try:
        with sp.create_queue_worker(
            engine,
            handler,
            handler_mode="advanced",
            worker_threads=2,
            polling_interval=0.02,
            max_unclean_ends=3,
        ) as worker:
            assert wait_for(lambda: archived_job(engine, job_id) is not None, timeout=30)
            assert worker.running
    finally:
        admin.dispose()
    row = archived_job(engine, job_id)
    assert row is not None and (row.status, row.attempts) == ("failure", 3)
    assert row.error is not None and "lost its database session while running" in row.error
    assert "idle_in_transaction_session_timeout" in row.error
    assert runs == [1, 1, 1], "a lost run is counted, not retried"
    assert overlaps == []
    assert len(events(caplog.records, "job-connection-lost")) == 3
    assert run_records(engine) == 0


def test_a_retry_time_past_what_a_date_holds_ends_as_a_recorded_failure_and_the_worker_goes_on(
    engine: sa.Engine,
) -> None:
    """A retry delay that overflows the date (0.1: logged as a lost connection, counted as
    an unclean end, worker stopped) is the job's failure; the next job runs. Delays over ten
    years are refused where the strategy is built."""
    with pytest.raises(sp.InvalidRetryStrategyError, match="ten years"):
        sp.RetryStrategy(1, [1e12])
    clock = FakeClock(datetime(9995, 1, 1, tzinfo=UTC))
    doomed = enqueue_committed(engine, "fails", clock=clock)
    after = enqueue_committed(engine, "ok", clock=clock)

    def handler(job_type: str, payload: Any) -> None:
        if job_type == "fails":
            raise RuntimeError("fails")

    with sp.create_queue_worker(
        engine,
        handler,
        clock=clock,
        polling_interval=0.02,
        retry_strategy=lambda job, exc: sp.RetryStrategy(1, [3600 * 24 * 3649]),
    ) as worker:
        assert wait_for(lambda: count(engine, sp.ArchivedJob) == 2)
        assert worker.running
    first, second = archived_job(engine, doomed), archived_job(engine, after)
    assert first is not None and first.status == "failure" and first.attempts == 1
    assert second is not None and second.status == "success"
    assert run_records(engine) == 0


# --- 8. a shutdown that gives up on a running job ------------------------------------------

ABANDONING_WORKER = textwrap.dedent(
    """
    import os, sys, threading
    import sqlalchemy as sa
    import sqla_proletarian as sp

    engine = sa.create_engine(sys.argv[1])
    started = threading.Event()

    def handler(job_type, payload):
        started.set()
        threading.Event().wait(60)

    worker = sp.create_queue_worker(engine, handler, await_termination_timeout=0.2)
    worker.start()
    assert started.wait(20)
    worker.stop()
    os._exit(0)  # the deploy's process exit, with the job still running
    """
)


def test_a_job_still_running_when_the_shutdown_gives_up_on_it_is_not_charged(
    database: Database, engine: sa.Engine, backend: str, tmp_path: Path
) -> None:
    """A job running past await_termination_timeout rolls back when the process exits, and
    runs again; the worker removed its run record first, so no deploy counts against it."""
    if backend == "sqlite":
        pytest.skip(
            "SQLite: the running job holds the database's write lock, so the record can "
            "only be removed by the next claim (documented)"
        )
    job_id = enqueue_committed(engine, "slow")
    url = database.url.render_as_string(hide_password=False)
    result = subprocess.run(
        [sys.executable, "-c", ABANDONING_WORKER, url], capture_output=True, timeout=60
    )
    assert result.returncode == 0, result.stderr.decode()
    assert run_records(engine) == 0
    assert sp.process_next_job(engine, lambda job_type, payload: None, max_unclean_ends=1)
    row = archived_job(engine, job_id)
    assert row is not None and (row.status, row.attempts) == ("success", 1)


# --- 9, 10. leftover records ---------------------------------------------------------------


def test_a_worker_without_crash_accounting_still_removes_a_jobs_leftover_run_records(
    engine: sa.Engine,
) -> None:
    """max_unclean_ends=None writes no records, but a job leaving the queue takes the
    records earlier runs left with it."""
    job_id = enqueue_committed(engine, "leftover")
    with engine.begin() as conn:
        conn.execute(
            sa.insert(sp.JobRun).values(
                run_id=uuid.uuid4(), job_id=job_id, worker_id="gone", started_at=sp.utc_now()
            )
        )
    assert sp.process_next_job(engine, lambda job_type, payload: None, max_unclean_ends=None)
    assert archived_job(engine, job_id) is not None
    assert run_records(engine) == 0


def test_a_busy_sqlite_reclaim_after_the_run_record_leaves_no_record_that_counts(
    database: Database, backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    """SQLite commits the run record, then claims the job again; if another writer takes
    the database in between, the record must not outlive the attempt as a false unclean end
    (0.1: a job-interrupted warning and 2 attempts for one run)."""
    if backend != "sqlite":
        pytest.skip("the re-claim after the run record is SQLite's (one connection)")
    engine = database.engine(connect_args={"timeout": 0.05})
    job_id = enqueue_committed(engine, "busy")
    blocker = database.engine(connect_args={"timeout": 5})
    blocked = threading.Event()
    release = threading.Event()

    def hold_the_write_lock() -> None:
        with blocker.connect() as conn:
            driver = conn.connection.driver_connection
            driver.isolation_level = None  # type: ignore[union-attr]
            conn.exec_driver_sql("BEGIN IMMEDIATE")
            blocked.set()
            release.wait(10)
            conn.exec_driver_sql("ROLLBACK")

    holder: list[threading.Thread] = []
    begins: list[str] = []

    @sa.event.listens_for(engine, "before_cursor_execute")
    def before_the_reclaim(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        # The second BEGIN IMMEDIATE of the claim is the re-claim after the committed record.
        if statement == "BEGIN IMMEDIATE":
            begins.append(statement)
            if len(begins) == 2 and not holder:
                thread = threading.Thread(target=hold_the_write_lock)
                holder.append(thread)
                thread.start()
                assert blocked.wait(10)

    caplog.set_level(logging.WARNING, logger="sqla_proletarian")
    with pytest.raises(sa.exc.OperationalError, match="locked"):
        sp.process_next_job(engine, no_handler)
    release.set()
    holder[0].join(10)
    assert sp.process_next_job(engine, lambda job_type, payload: None)
    row = archived_job(engine, job_id)
    assert row is not None and (row.status, row.attempts) == ("success", 1)
    assert events(caplog.records, "job-interrupted") == []
    assert run_records(engine) == 0


# --- 16. SQLite engines that share their connection ----------------------------------------


def test_a_sqlite_engine_with_a_static_pool_is_refused_by_the_worker(tmp_path: Path) -> None:
    """One shared DBAPI connection: the worker's transactions would be the application's."""
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'jobs.db'}", poolclass=sa.pool.StaticPool)
    try:
        with pytest.raises(sp.ConfigurationError, match="StaticPool"):
            sp.create_queue_worker(engine, no_handler)
    finally:
        engine.dispose()


def test_process_next_job_on_a_shared_sqlite_connection_never_touches_the_apps_transaction(
    tmp_path: Path,
) -> None:
    """With a StaticPool, process_next_job runs jobs between the application's transactions
    and refuses, touching nothing, while one is open; the app's rollback still works."""
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'jobs.db'}", poolclass=sa.pool.StaticPool)
    try:
        sp.metadata.create_all(engine)
        ACCOUNTS.create(engine)
        job_id = enqueue_committed(engine, "shared")
        with Session(engine) as session:
            session.execute(sa.insert(ACCOUNTS).values(id=1, balance=5))
            with pytest.raises(sp.ConfigurationError, match="inside the application"):
                sp.process_next_job(engine, lambda job_type, payload: None)
            session.rollback()
        with engine.connect() as conn:
            assert conn.execute(sa.select(sa.func.count()).select_from(ACCOUNTS)).scalar() == 0
        assert sp.process_next_job(engine, lambda job_type, payload: None)
        assert archived_job(engine, job_id) is not None
    finally:
        engine.dispose()


def test_a_lock_conflict_while_the_outcome_is_written_leaves_no_record_and_no_unclean_end(
    database: Database, engine: sa.Engine, backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Another transaction holds the archive row the outcome needs, until the worker's lock
    wait times out: the job's transaction rolls back, the worker removes its run record, and
    with max_unclean_ends=1 the job's next run is a plain success, not a crash."""
    if backend == "sqlite":
        pytest.skip("SQLite has no lock wait timeout on rows")
    short_waits: dict[str, Any] = (
        {"options": "-c lock_timeout=300"}
        if backend == "postgresql"
        else {"init_command": "SET innodb_lock_wait_timeout = 1"}
    )
    worker_engine = database.engine(connect_args=short_waits)
    job_id = enqueue_committed(engine, "contended")
    caplog.set_level(logging.WARNING, logger="sqla_proletarian")
    with engine.connect() as other:
        other.execute(
            sa.insert(sp.ArchivedJob).values(
                job_id=job_id,
                queue="default",
                job_type="other",
                payload="{}",
                attempts=1,
                enqueued_at=sp.utc_now(),
                process_at=sp.utc_now(),
                status="success",
                finished_at=sp.utc_now(),
            )
        )
        assert sp.process_next_job(
            worker_engine, lambda job_type, payload: None, max_unclean_ends=1
        )
        assert [r.job_id for r in events(caplog.records, "job-transaction-lost")] == [job_id]
        other.rollback()
    assert run_records(engine) == 0
    row = job_row(engine, job_id)
    assert row is not None and row.attempts == 0
    assert sp.process_next_job(worker_engine, lambda job_type, payload: None, max_unclean_ends=1)
    done = archived_job(engine, job_id)
    assert done is not None and (done.status, done.attempts) == ("success", 1)
