"""Lease mode's threaded worker at full speed: one poller claims for all its threads and
alone waits on a drained queue (woken by an enqueue, never past the next due job), and the
successes of handlers that did not use ``job.session`` are completed together, in few
transactions, by the time the worker's stop returns."""

from __future__ import annotations

import re
import threading
import time
import uuid
from collections import Counter
from datetime import UTC
from typing import Any

import pytest
import sqlalchemy as sa
from helpers import archived, count, enqueue_committed, jobs, running, wait_for
from lease_helpers import Base, Note, job_row, kill_session, notes
from sqlalchemy.orm import Session

import sqla_proletarian as sp

#: Long enough that no lease expires and no heartbeat runs while a test looks.
LONG_LEASE = {"lease_seconds": 60.0, "polling_interval": 0.02}
#: A polling interval no test waits for: whatever runs a job sooner was woken or scheduled.
NEVER = 30.0


@pytest.fixture
def engine(database: Any) -> sa.Engine:
    """An engine on a fresh database with the library's tables and the notes table."""
    engine = database.engine()
    Base.metadata.create_all(engine)
    return engine


#: A statement that deletes jobs (an end of a run): plain, MySQL's multi-table form, in a CTE.
DELETES_JOBS = re.compile(r"DELETE (\w+ )?FROM proletarian_job\b")


class Statements:
    """What a worker's engine runs: its polls by thread, and its completion transactions
    (those that deleted jobs) with the notes each inserted."""

    def __init__(self, engine: sa.Engine) -> None:
        self.polls: Counter[str] = Counter()
        self.completions: list[int] = []
        self._lock = threading.Lock()
        sa.event.listen(engine, "before_cursor_execute", self._executed)
        sa.event.listen(engine, "commit", self._committed)
        sa.event.listen(engine, "rollback", self._rolled_back)

    def _executed(self, conn: sa.Connection, cursor: Any, statement: str, *args: Any) -> None:
        text = " ".join(statement.split())
        if (
            text.startswith(("SELECT", "WITH"))
            and "FROM proletarian_job" in text
            and (
                "<=" in text
                or "FORCE INDEX (ix_proletarian_job_poll)" in text
                or "UNION ALL" in text
            )
        ):
            # A poll for due jobs (after one that took nothing, the read of the queues' ends
            # first, which reads no due time; MySQL and MariaDB: their read of the queue's
            # priorities, which with no job reads none either).
            with self._lock:
                self.polls[threading.current_thread().name] += 1
        if DELETES_JOBS.search(text):
            conn.info["sp-test-deleted"] = True
        if "INSERT INTO lease_notes" in text:
            conn.info["sp-test-notes"] = conn.info.get("sp-test-notes", 0) + 1

    def _committed(self, conn: sa.Connection) -> None:
        if conn.info.pop("sp-test-deleted", False):
            with self._lock:
                self.completions.append(conn.info.get("sp-test-notes", 0))
        conn.info.pop("sp-test-notes", None)

    def _rolled_back(self, conn: sa.Connection) -> None:
        conn.info.pop("sp-test-deleted", None)
        conn.info.pop("sp-test-notes", None)

    def pollers(self) -> set[str]:
        with self._lock:
            return set(self.polls)

    def total_polls(self) -> int:
        with self._lock:
            return sum(self.polls.values())


def test_successes_that_wrote_nothing_complete_together_in_few_transactions(
    database: Any, engine: sa.Engine
) -> None:
    """50 no-op jobs on 4 threads at batch_size 1: their completions are grouped, so fewer
    than 25 transactions delete and archive them (one per job before), each job once."""
    with Session(engine) as session:
        sp.enqueue_many(session, [("noop", n) for n in range(50)])
        session.commit()
    worker_engine = database.engine()
    statements = Statements(worker_engine)
    worker = sp.create_queue_worker(
        worker_engine, lambda job_type, payload: None, worker_threads=4, **LONG_LEASE
    )
    with running(worker):
        assert wait_for(lambda: count(engine, sp.ArchivedJob) == 50)
    assert len(statements.completions) < 25, statements.completions
    assert sorted(row.status for row in archived(engine)) == ["success"] * 50
    assert worker.summary() == {"succeeded": 50, "retried": 0, "failed": 0}
    assert jobs(engine) == []


class Completions:
    """The statements of each of a worker's transactions that deleted jobs (its completions)."""

    def __init__(self, engine: sa.Engine) -> None:
        self.sent: list[list[str]] = []
        self._lock = threading.Lock()
        sa.event.listen(engine, "before_cursor_execute", self._executed)
        sa.event.listen(engine, "commit", self._committed)
        sa.event.listen(engine, "rollback", self._rolled_back)

    def _executed(self, conn: sa.Connection, cursor: Any, statement: str, *args: Any) -> None:
        conn.info.setdefault("sp-test-sent", []).append(" ".join(statement.split()))

    def _committed(self, conn: sa.Connection) -> None:
        sent = conn.info.pop("sp-test-sent", [])
        if any(DELETES_JOBS.search(text) for text in sent):
            with self._lock:
                self.sent.append(sent)

    def _rolled_back(self, conn: sa.Connection) -> None:
        conn.info.pop("sp-test-sent", None)


def test_a_group_ends_with_its_results_and_a_cancel_in_one_statement_on_postgresql(
    database: Any, engine: sa.Engine
) -> None:
    """40 jobs on 4 threads whose handlers return without using job.session, most with a
    result, one cancelled while it runs: each is archived once, with its result (the
    cancelled one as cancelled, with none); on PostgreSQL each grouped completion is one
    statement (it locked the group's rows first, then archived them, then stored the
    results), elsewhere the lock, the copy and the delete."""
    with Session(engine) as session:
        ids = sp.enqueue_many(session, [("result", n) for n in range(40)])
        session.commit()
    cancelled = ids[7]

    def handler(job: sp.JobContext) -> Any:
        if job.job_id == cancelled:
            with engine.begin() as conn:
                assert sp.cancel_job(conn, job.job_id) is True
        return None if job.payload % 4 == 0 else {"double": job.payload * 2}

    worker_engine = database.engine()
    completions = Completions(worker_engine)
    worker = sp.create_queue_worker(
        worker_engine, handler, handler_mode="advanced", worker_threads=4, **LONG_LEASE
    )
    with running(worker):
        assert wait_for(lambda: count(engine, sp.ArchivedJob) == 40)
    rows = {row.job_id: row for row in archived(engine)}
    assert (rows[cancelled].status, rows[cancelled].result) == ("cancelled", None)
    for n, job_id in enumerate(ids):
        if job_id != cancelled:
            row = rows[job_id]
            result = None if n % 4 == 0 else {"double": n * 2}
            assert (row.status, row.attempts) == ("success", 1), n
            with Session(engine) as session:
                assert sp.get_result(session, job_id) == result, n
    assert worker.summary() == {"succeeded": 39, "retried": 0, "failed": 0}
    assert jobs(engine) == []
    assert completions.sent, "no completion seen"
    if engine.dialect.name == "postgresql":
        assert all(len(sent) == 1 for sent in completions.sent), completions.sent


#: Lease mode's lease of the jobs a claim locked, as a statement of its own.
SEPARATE_LEASE = re.compile(r"^UPDATE proletarian_job SET unclean_ends=")


def test_a_claim_on_postgresql_leases_the_jobs_its_poll_locks_in_the_same_statement(
    database: Any, engine: sa.Engine
) -> None:
    """30 jobs, claimed 10 at a time: on PostgreSQL no claim sends the lease apart from its
    poll (the poll leases what it locks); elsewhere each claim does. Each job runs once,
    leased (its attempt counted once), and is archived once."""
    with Session(engine) as session:
        sp.enqueue_many(session, [("claimed", n) for n in range(30)])
        session.commit()
    sent: list[str] = []

    def executed(conn: sa.Connection, cursor: Any, statement: str, *args: Any) -> None:
        sent.append(" ".join(statement.split()))

    attempts: Counter[int] = Counter()

    def handler(job: sp.JobContext) -> None:
        attempts[job.payload] += job.attempts

    worker_engine = database.engine()
    sa.event.listen(worker_engine, "before_cursor_execute", executed)
    worker = sp.create_queue_worker(
        worker_engine, handler, handler_mode="advanced", batch_size=10, **LONG_LEASE
    )
    with running(worker):
        assert wait_for(lambda: count(engine, sp.ArchivedJob) == 30)
    leases = [text for text in sent if SEPARATE_LEASE.search(text)]
    if engine.dialect.name == "postgresql":
        assert leases == []
    else:
        assert leases, "a claim leases the jobs it locked in a statement of its own"
    assert attempts == Counter(dict.fromkeys(range(30), 1))
    assert {(row.status, row.attempts) for row in archived(engine)} == {("success", 1)}
    assert worker.summary() == {"succeeded": 30, "retried": 0, "failed": 0}
    assert jobs(engine) == []


def test_a_handler_that_wrote_through_its_session_completes_alone_with_its_writes(
    database: Any, engine: sa.Engine
) -> None:
    """Beside 40 no-op jobs, 10 whose handlers write a note through job.session: each of
    those completes in a transaction of its own that holds its note (10 such), while the
    no-op ones share fewer (30 at most); every note and every job is there once."""
    with Session(engine) as session:
        sp.enqueue_many(session, [("write" if n % 5 == 0 else "noop", n) for n in range(50)])
        session.commit()

    def handler(job: sp.JobContext) -> None:
        if job.job_type == "write":
            job.session.add(Note(text=f"note {job.payload}"))

    worker_engine = database.engine()
    statements = Statements(worker_engine)
    worker = sp.create_queue_worker(
        worker_engine, handler, handler_mode="advanced", worker_threads=4, **LONG_LEASE
    )
    with running(worker):
        assert wait_for(lambda: count(engine, sp.ArchivedJob) == 50)
    with_notes = [n for n in statements.completions if n]
    assert with_notes == [1] * 10, statements.completions
    assert len(statements.completions) - len(with_notes) < 30, statements.completions
    assert sorted(notes(engine)) == sorted(f"note {n}" for n in range(0, 50, 5))
    assert jobs(engine) == []


def test_a_worker_stopped_with_completions_queued_archives_them_together_before_stop_returns(
    database: Any, engine: sa.Engine
) -> None:
    """Four handlers return only once the worker is stopping (the first one stops it):
    when stop() returns their four jobs are archived, by fewer than four transactions (the
    completions were grouped)."""
    for n in range(4):
        enqueue_committed(engine, "held", n)
    started = threading.Barrier(4)
    release = threading.Event()

    def handler(job_type: str, payload: Any) -> None:
        started.wait(10)
        if payload == 0:
            worker.stop()  # from a handler: asks for the stop and returns at once
            release.set()
        assert release.wait(10)

    worker_engine = database.engine()
    statements = Statements(worker_engine)
    worker = sp.create_queue_worker(worker_engine, handler, worker_threads=4, **LONG_LEASE)
    worker.start()
    assert release.wait(10)
    worker.stop()
    assert count(engine, sp.ArchivedJob) == 4, "archived before stop() returned"
    assert worker.summary() == {"succeeded": 4, "retried": 0, "failed": 0}
    assert len(statements.completions) < 4, statements.completions


def test_with_four_threads_and_an_empty_queue_only_the_poller_polls(
    database: Any, engine: sa.Engine
) -> None:
    """An idle worker of four threads polls from one thread only (each thread polled for
    itself before)."""
    worker_engine = database.engine()
    statements = Statements(worker_engine)
    worker = sp.create_queue_worker(
        worker_engine,
        lambda job_type, payload: None,
        worker_threads=4,
        poll_only=True,
        **LONG_LEASE,
    )
    with running(worker):
        assert wait_for(lambda: statements.total_polls() >= 20)
    assert len(statements.pollers()) == 1, statements.polls


def test_while_claims_come_back_full_claimers_claim_beside_the_poller(
    database: Any, engine: sa.Engine
) -> None:
    """120 jobs of a few milliseconds on 4 threads: while claims come back full, claimers
    claim beside the poller (each on its own connection), so claims overlap as transaction
    mode's threads' do; SQLite, whose claims take turns, keeps its poller alone. Every job
    runs once."""
    with Session(engine) as session:
        sp.enqueue_many(session, [("busy", n) for n in range(120)])
        session.commit()
    ran: Counter[int] = Counter()
    lock = threading.Lock()

    def handler(job_type: str, payload: Any) -> None:
        time.sleep(0.003)
        with lock:
            ran[payload] += 1

    worker_engine = database.engine()
    statements = Statements(worker_engine)
    worker = sp.create_queue_worker(worker_engine, handler, worker_threads=4, **LONG_LEASE)
    with running(worker):
        assert wait_for(lambda: count(engine, sp.ArchivedJob) == 120)
    claimers = {name for name in statements.pollers() if "-claimer-" in name}
    if database.backend == "sqlite":
        assert not claimers, statements.polls
    else:
        assert claimers, statements.polls
    assert ran == Counter(range(120))
    assert worker.summary() == {"succeeded": 120, "retried": 0, "failed": 0}


def test_an_enqueue_wakes_the_poller_alone_and_its_job_runs_at_once(
    database: Any, engine: sa.Engine
) -> None:
    """With a polling interval no test waits for, an enqueue in this process (and NOTIFY on
    PostgreSQL) wakes the poller: the job runs at once, and the poller is the only thread
    that polled (woken threads each polled before)."""
    worker_engine = database.engine()
    statements = Statements(worker_engine)
    ran = threading.Event()
    worker = sp.create_queue_worker(
        worker_engine,
        lambda job_type, payload: ran.set(),
        worker_threads=4,
        lease_seconds=60.0,
        polling_interval=NEVER,
    )
    with running(worker):
        assert wait_for(lambda: statements.total_polls() >= 1)
        enqueue_committed(engine, "wake")
        assert ran.wait(10)
        assert wait_for(lambda: count(engine, sp.ArchivedJob) == 1)
    assert len(statements.pollers()) == 1, statements.polls


def test_a_scheduled_job_starts_on_time_while_the_poller_waits_long(
    database: Any, engine: sa.Engine
) -> None:
    """A job due in a second, enqueued before the worker started (so nothing wakes it): the
    drained poller waits until the job's due time, not its polling interval (nor, with
    LISTEN, its safety poll), and the job starts at its time."""
    job_id: uuid.UUID = enqueue_committed(engine, "later", process_in=1)
    with Session(engine) as session:
        due = session.get_one(sp.Job, job_id).process_at
    started: list[Any] = []
    ran = threading.Event()

    def handler(job_type: str, payload: Any) -> None:
        started.append(sp.utc_now())
        ran.set()

    worker = sp.create_queue_worker(
        database.engine(), handler, worker_threads=4, lease_seconds=60.0, polling_interval=NEVER
    )
    with running(worker):
        assert ran.wait(10), "the job waited for the polling interval"
    assert started[0] >= (due if due.tzinfo else due.replace(tzinfo=UTC))


def test_a_stop_gives_queued_unstarted_leases_back_at_once_uncharged(
    database: Any, engine: sa.Engine
) -> None:
    """One thread at batch_size 3: while the first job runs, the two claimed behind it wait
    in the worker's queue; a stop gives their leases back at once (no token, no attempt
    counted), before the running job ends, and they never run in this worker."""
    first, *queued = (enqueue_committed(engine, "queued", n) for n in range(3))
    started, release = threading.Event(), threading.Event()
    ran: list[int] = []

    def handler(job_type: str, payload: Any) -> None:
        ran.append(payload)
        started.set()
        assert release.wait(10)

    worker = sp.create_queue_worker(database.engine(), handler, batch_size=3, **LONG_LEASE)
    worker.start()
    stopper = threading.Thread(target=worker.stop)
    try:
        assert started.wait(10)
        assert all(job_row(engine, job_id).lease_token is not None for job_id in queued)
        stopper.start()

        def given_back() -> bool:
            rows = [job_row(engine, job_id) for job_id in queued]
            return all(row.lease_token is None and row.attempts == 0 for row in rows)

        assert wait_for(given_back), "the queued leases were given back while a job ran"
    finally:
        release.set()
        if stopper.ident is not None:
            stopper.join(30)
        worker.stop()
    assert ran == [0]
    assert [row.job_id for row in archived(engine)] == [first]


@pytest.mark.parametrize(
    "failures", [("kill",), ("kill", "kill"), ("kill", "refuse")], ids="-".join
)
def test_a_grouped_completion_whose_session_is_lost_is_tried_again_else_given_back(
    database: Any, engine: sa.Engine, failures: tuple[str, ...]
) -> None:
    """The server ends the completer's session as it deletes a group (once: the flush is
    tried again at once on a fresh connection and archives the group; twice: tried again
    after a pause, as long as the lease lasts, and archives it: a failover or a restart ends
    sessions this way, and the jobs need not run again). A retry that fails for another
    reason gives the leases back and the jobs run again. Either way every job is archived
    once, as a success, its attempts counting each run."""
    if database.backend == "sqlite":
        pytest.skip("SQLite has no server session to end")
    with Session(engine) as session:
        ids = sp.enqueue_many(session, [("noop", n) for n in range(8)])
        session.commit()
    payloads = dict(zip(ids, range(8), strict=True))
    worker_engine = database.engine()
    ran: Counter[int] = Counter()
    lock = threading.Lock()
    failed: list[str] = []

    def fail_grouped_delete(conn: sa.Connection, cursor: Any, statement: str, *args: Any) -> None:
        text = " ".join(statement.split())
        grouped = " IN " in text or "= ANY" in text  # a list of ids, or an array
        if DELETES_JOBS.search(text) and grouped and len(failed) < len(failures):
            failed.append(failures[len(failed)])
            if failed[-1] == "refuse":
                raise RuntimeError("the completion is refused")
            kill_session(engine, conn.connection.dbapi_connection)

    sa.event.listen(worker_engine, "before_cursor_execute", fail_grouped_delete)

    def handler(job_type: str, payload: Any) -> None:
        with lock:
            ran[payload] += 1

    worker = sp.create_queue_worker(worker_engine, handler, worker_threads=4, **LONG_LEASE)
    with running(worker):
        assert wait_for(lambda: count(engine, sp.ArchivedJob) == 8)
    assert failed == list(failures)
    assert sorted(row.status for row in archived(engine)) == ["success"] * 8
    # A group given back ran again: each archive row counts every run of its job.
    assert {row.job_id: row.attempts for row in archived(engine)} == {
        job_id: ran[payload] for job_id, payload in payloads.items()
    }
    assert worker.summary()["succeeded"] == 8
    assert jobs(engine) == []
    assert set(ran) == set(range(8))
    assert (max(ran.values()) > 1) == ("refuse" in failures), ran
