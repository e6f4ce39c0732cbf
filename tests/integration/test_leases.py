"""Lease mode (``lease_seconds``) in the threaded worker: a short claim writes the lease and
commits, the handler runs with no transaction, row lock or connection of the worker's, its
``job.session`` writes commit with the completion (only while the run still holds the
lease), and cancel, job_timeout and stop reach a running job through ``cancel_requested``."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from helpers import (
    archived,
    archived_job,
    count,
    enqueue_committed,
    events,
    jobs,
    running,
    wait_for,
)
from lease_helpers import JOB, Base, Note, held_by_others, job_row, notes
from sqlalchemy.orm import Session

import sqla_proletarian as sp

#: Long enough that no lease expires and no heartbeat runs while a test looks.
LONG_LEASE = {"lease_seconds": 60.0, "polling_interval": 0.02}
#: A lease that its heartbeats keep renewing several times a second.
SHORT_LEASE = {"lease_seconds": 1.0, "heartbeat_interval": 0.1, "polling_interval": 0.02}


@pytest.fixture
def engine(database: Any) -> sa.Engine:
    """An engine on a fresh database with the library's tables and the notes table."""
    engine = database.engine()
    Base.metadata.create_all(engine)
    return engine


def noop(job_type: str, payload: Any) -> None:
    pass


# --- what a running leased job holds -------------------------------------------------------


def test_leased_handlers_run_with_no_transaction_row_lock_or_connection_of_the_worker(
    database: Any, engine: sa.Engine
) -> None:
    """Four threads run four long jobs: meanwhile no session of the worker is in a
    transaction or holds a transaction id, every job's row can be locked at once (NOWAIT),
    SQLite's write lock is free, and the worker's pool has no connection checked out."""
    job_ids = [enqueue_committed(engine, "long", n) for n in range(4)]
    started: list[uuid.UUID] = []
    lock, release = threading.Lock(), threading.Event()

    def handler(job: sp.JobContext) -> None:
        with lock:
            started.append(job.job_id)
        release.wait(10)

    worker_engine = database.engine()
    worker = sp.create_queue_worker(
        worker_engine, handler, handler_mode="advanced", worker_threads=4, **LONG_LEASE
    )
    with running(worker):
        try:
            assert wait_for(lambda: len(started) == 4), started
            assert held_by_others(database.backend, engine, job_ids) == []
            assert worker_engine.pool.checkedout() == 0
        finally:
            release.set()
        assert wait_for(lambda: count(engine, sp.ArchivedJob) == 4)
    assert {row.status for row in archived(engine)} == {"success"}


def test_transaction_mode_holds_a_connection_for_each_running_job(
    database: Any, engine: sa.Engine
) -> None:
    """The contrast to the test above: without lease_seconds each of the four threads
    holds its connections while its job runs (on SQLite one job runs at a time)."""
    for n in range(4):
        enqueue_committed(engine, "long", n)
    started, release = threading.Event(), threading.Event()

    def handler(job_type: str, payload: Any) -> None:
        started.set()
        release.wait(10)

    worker_engine = database.engine(pool_size=10)
    worker = sp.create_queue_worker(worker_engine, handler, worker_threads=4, polling_interval=0.02)
    with running(worker):
        try:
            assert started.wait(10)
            assert wait_for(lambda: worker_engine.pool.checkedout() >= 4)
            if database.backend != "sqlite":
                assert held_by_others(database.backend, engine, []) != []
        finally:
            release.set()
        assert wait_for(lambda: count(engine, sp.ArchivedJob) == 4)


def test_a_leased_job_carries_its_lease_which_its_heartbeats_renew(
    engine: sa.Engine,
) -> None:
    """While it runs the row holds the lease (token, owner ``worker_id@host:pid/thread``,
    heartbeat, its own due time in due_at, process_at the lease's expiry, attempts counting
    this run); heartbeats move the expiry on, so past the first expiry no other worker
    (lease or transaction mode) takes the job. queue_status and get_job show it running."""
    job_id = enqueue_committed(engine, "long")
    due = job_row(engine, job_id).process_at
    started, release = threading.Event(), threading.Event()
    seen: list[int] = []

    def handler(job: sp.JobContext) -> None:
        seen.append(job.attempts)
        started.set()
        release.wait(10)

    other: list[str] = []
    worker = sp.create_queue_worker(
        engine, handler, handler_mode="advanced", worker_id="leaser", **SHORT_LEASE
    )
    with running(worker):
        try:
            assert started.wait(10)
            first = job_row(engine, job_id)
            assert isinstance(first.lease_token, uuid.UUID)
            owner = f"leaser@{socket.gethostname()}:{os.getpid()}/"
            assert first.lease_owner.startswith(owner), first.lease_owner
            assert first.due_at == due
            assert first.attempts == 1 and seen == [1]
            assert first.unclean_ends == 0
            assert first.heartbeat_at is not None
            assert first.heartbeat_at <= sp.utc_now() < first.process_at
            assert first.process_at <= first.heartbeat_at + timedelta(seconds=1.5)
            [status] = sp.queue_status(engine)
            assert (status.ready, status.scheduled, status.running) == (0, 0, 1)
            shown = sp.get_job(engine, job_id)
            assert shown is not None
            assert (shown.state, shown.process_at, shown.owner) == (
                "running",
                due,
                first.lease_owner,
            )
            assert not shown.lease_expired

            def renewed() -> bool:
                row = job_row(engine, job_id)
                return row.heartbeat_at > first.heartbeat_at and row.process_at > first.process_at

            assert wait_for(renewed)
            assert wait_for(lambda: sp.utc_now() > first.process_at + timedelta(seconds=0.2))
            later = job_row(engine, job_id)
            assert later.lease_token == first.lease_token
            assert later.process_at > sp.utc_now()
            assert not sp.process_next_job(engine, lambda *a: other.append("lease"), **LONG_LEASE)
            assert not sp.process_next_job(engine, lambda *a: other.append("transaction"))
        finally:
            release.set()
        assert wait_for(lambda: archived_job(engine, job_id) is not None)
    done = archived_job(engine, job_id)
    assert done is not None and (done.status, done.attempts) == ("success", 1)
    assert other == []


# --- the job's session -------------------------------------------------------------------

#: Each way a handler writes through ``job.session``.
IDIOMS = ("add", "add-commit", "flush", "execute", "nested", "connection-execute", "get")
#: The notes the ``get`` jobs change: their ids by payload.
SEEDED = {"keeps": 1001, "raises": 1002}


def write_note(session: Session, idiom: str, payload: str) -> None:
    """Write one note through the job's session, the way ``idiom`` says."""
    text = f"{idiom} {payload}"
    if idiom == "add":  # the worker flushes it
        session.add(Note(text=text))
    elif idiom == "add-commit":
        session.add(Note(text=text))
        session.commit()
    elif idiom == "flush":
        session.add(Note(text=text))
        session.flush()
    elif idiom == "execute":
        session.execute(sa.insert(Note).values(text=text))
    elif idiom == "nested":
        with session.begin_nested():
            session.add(Note(text=text))
    elif idiom == "connection-execute":
        session.connection().execute(sa.insert(Note).values(text=text))
    else:
        note = session.get(Note, SEEDED[payload])
        assert note is not None
        note.text = text


def test_job_session_writes_in_every_idiom_commit_with_the_completion_or_not_at_all(
    engine: sa.Engine,
) -> None:
    """process_next_job with lease_seconds: what a handler writes through job.session (add,
    commit, flush, execute, begin_nested, connection().execute, get) commits with the job's
    completion; ``commit()`` inside the handler only flushes (nobody else sees the row yet);
    a handler that raises afterwards leaves none of its writes."""
    with Session(engine) as session:
        session.add_all([Note(id=i, text="seed") for i in SEEDED.values()])
        for idiom in IDIOMS:
            sp.enqueue_many(session, [(idiom, "keeps"), (idiom, "raises")])
        session.commit()
    visible_after_commit: list[int] = []
    leased: list[bool] = []

    def handler(job: sp.JobContext) -> None:
        leased.append(job_row(engine, job.job_id).lease_token is not None)
        write_note(job.session, job.job_type, job.payload)
        if job.job_type == "add-commit":
            with engine.connect() as conn:
                visible_after_commit.append(
                    conn.execute(
                        sa.select(sa.func.count()).where(Note.text == f"add-commit {job.payload}")
                    ).scalar_one()
                )
        if job.payload == "raises":
            raise RuntimeError("after writing")

    ran = 0
    while sp.process_next_job(engine, handler, handler_mode="advanced", **LONG_LEASE):
        ran += 1
    assert ran == 2 * len(IDIOMS)
    assert leased == [True] * ran, "each job ran under a lease"
    expected = sorted([*(f"{idiom} keeps" for idiom in IDIOMS), "seed"])
    assert notes(engine) == expected
    outcomes = {(a.job_type, a.status) for a in archived(engine)}
    assert outcomes == {(i, s) for i in IDIOMS for s in ("success", "failure")}
    assert visible_after_commit == [0, 0], "commit() inside the handler only flushed"
    assert jobs(engine) == []


# --- fencing ----------------------------------------------------------------------------


def test_a_run_whose_lease_another_worker_took_commits_nothing_and_the_job_is_archived_once(
    engine: sa.Engine,
) -> None:
    """Worker A's handler blocks; its lease is made to expire (process_at moved into the
    past, no heartbeat due for a while); B takes the job and finishes it. A's handler then
    writes and returns: its completion finds the token changed and rolls back, so the
    archive has one row (B's, counting both runs) and the handler's write is B's only."""
    job_id = enqueue_committed(engine, "fenced")
    a_started, release = threading.Event(), threading.Event()
    runs: list[str] = []

    def handler(job: sp.JobContext) -> None:
        runs.append(threading.current_thread().name)
        if len(runs) == 1:
            a_started.set()
            release.wait(10)
            job.session.add(Note(text="A"))
        else:
            job.session.add(Note(text="B"))

    worker = sp.create_queue_worker(
        engine,
        handler,
        handler_mode="advanced",
        lease_seconds=30.0,
        heartbeat_interval=20.0,
        polling_interval=0.02,
    )
    with running(worker):
        try:
            assert a_started.wait(10)
            token = job_row(engine, job_id).lease_token
            with engine.begin() as conn:
                conn.execute(
                    sa.update(JOB)
                    .where(JOB.c.job_id == job_id)
                    .values(process_at=sp.utc_now() - timedelta(seconds=1))
                )
            assert sp.process_next_job(engine, handler, handler_mode="advanced", **LONG_LEASE)
            assert notes(engine) == ["B"]
        finally:
            release.set()
    # stop() waited for A's run to end, its completion included.
    assert len(runs) == 2 and token is not None
    assert notes(engine) == ["B"], "the stale run's write never committed"
    [done] = archived(engine)
    assert (done.job_id, done.status, done.attempts) == (job_id, "success", 2)
    assert jobs(engine) == []


# --- cancel, job_timeout --------------------------------------------------------------------


def test_cancel_job_on_a_running_leased_job_cancels_it_and_rolls_back_its_writes(
    engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """cancel_job returns True for a job under a live lease; the next heartbeat sets the
    handler's cancel_requested; whatever the handler then returns, the job is archived as
    cancelled, its session's writes roll back, and it never runs again. The worker logs
    the cancel, not a lost lease."""
    caplog.set_level(logging.INFO, logger="sqla_proletarian")
    job_id = enqueue_committed(engine, "cancel-me")
    started = threading.Event()
    seen: list[bool] = []

    def handler(job: sp.JobContext) -> None:
        started.set()
        seen.append(job.cancel_requested.wait(10))
        job.session.add(Note(text="after the cancel"))
        job.session.flush()

    worker = sp.create_queue_worker(
        engine, handler, handler_mode="advanced", lease_seconds=2.0, heartbeat_interval=0.1
    )
    with running(worker):
        assert started.wait(10)
        with engine.begin() as conn:
            assert sp.cancel_job(conn, job_id) is True
        assert wait_for(lambda: archived_job(engine, job_id) is not None)
        assert wait_for(lambda: len(seen) == 1)
    assert seen == [True]
    done = archived_job(engine, job_id)
    assert done is not None and done.status == "cancelled"
    assert jobs(engine) == []
    assert notes(engine) == []
    assert not sp.process_next_job(engine, handler, handler_mode="advanced", **LONG_LEASE)
    assert [r.job_id for r in events(caplog.records, "job-cancelled")] == [job_id]
    assert events(caplog.records, "lease-lost") == [], "a cancel is no lost lease"


def test_job_timeout_fails_the_run_which_is_retried_then_reaches_the_failed_job_handler(
    engine: sa.Engine,
) -> None:
    """A handler still running after job_timeout sees cancel_requested; the run fails with
    JobTimeoutError, is retried as the retry strategy says, and when no retry is left the
    failed-job handler gets the JobTimeoutError; the handler's later writes are discarded."""
    job_id = enqueue_committed(engine, "slow")
    attempts: list[int] = []
    seen: list[bool] = []
    failed: list[tuple[uuid.UUID, Exception]] = []
    strategies: list[str] = []

    def handler(job: sp.JobContext) -> None:
        attempts.append(job.attempts)
        seen.append(job.cancel_requested.wait(10))
        job.session.add(Note(text=f"run {job.attempts}"))

    def retry_strategy(job: sp.JobContext, exc: Exception) -> sp.RetryStrategy:
        strategies.append(type(exc).__name__)
        return sp.RetryStrategy(retries=1, delays=[0])

    worker = sp.create_queue_worker(
        engine,
        handler,
        handler_mode="advanced",
        job_timeout=0.3,
        retry_strategy=retry_strategy,
        failed_job_handler=lambda job, exc: failed.append((job.job_id, exc)),
        **SHORT_LEASE,
    )
    with running(worker):
        assert wait_for(lambda: archived_job(engine, job_id) is not None)
        assert wait_for(lambda: len(seen) == 2)
    assert attempts == [1, 2] and seen == [True, True]
    assert strategies[:1] == ["JobTimeoutError"]
    [(failed_id, exc)] = failed
    assert failed_id == job_id
    assert isinstance(exc, sp.JobTimeoutError) and "timed out" in str(exc)
    done = archived_job(engine, job_id)
    assert done is not None and (done.status, done.attempts) == ("failure", 2)
    assert done.error is not None and "JobTimeoutError" in done.error
    assert notes(engine) == []
    assert jobs(engine) == []


def test_process_next_job_times_out_a_leased_job_in_the_calling_thread(
    engine: sa.Engine,
) -> None:
    """process_next_job with job_timeout keeps a heartbeat while the handler runs: past the
    timeout the handler's cancel_requested is set and the job fails with JobTimeoutError."""
    job_id = enqueue_committed(engine, "slow")
    seen: list[bool] = []

    def handler(job: sp.JobContext) -> None:
        seen.append(job.cancel_requested.wait(10))

    assert sp.process_next_job(
        engine, handler, handler_mode="advanced", job_timeout=0.2, **SHORT_LEASE
    )
    assert seen == [True]
    done = archived_job(engine, job_id)
    assert done is not None and done.status == "failure"
    assert done.error is not None and "JobTimeoutError" in done.error


def test_job_timeout_without_lease_seconds_is_refused_naming_lease_seconds(
    engine: sa.Engine,
) -> None:
    """job_timeout is a lease-mode option: without lease_seconds the worker is refused
    with a message that says to give lease_seconds (not as an unknown option)."""
    for make in (sp.create_queue_worker, sp.process_next_job):
        with pytest.raises(sp.ConfigurationError, match="lease_seconds") as refused:
            make(engine, noop, job_timeout=5.0)
        assert "unknown" not in str(refused.value)
    assert jobs(engine) == []


# --- stop ----------------------------------------------------------------------------------


@pytest.mark.parametrize("writes", ["after", "before"])
def test_stop_past_its_timeout_releases_the_lease_for_another_worker_at_once(
    engine: sa.Engine, writes: str
) -> None:
    """stop() gives up on a job still running: its cancel_requested is set, its lease is
    released at once (no token, process_at back to the job's due time, no unclean end), so
    another worker takes it now, not after the 60 s lease; the stuck run commits nothing,
    whether it writes through job.session after it was asked to stop or before it stuck
    (its transaction open then: on SQLite holding the write lock)."""
    job_id = enqueue_committed(engine, "stuck")
    due = job_row(engine, job_id).process_at
    started, release = threading.Event(), threading.Event()
    seen: list[bool] = []
    runs: list[str] = []

    def handler(job: sp.JobContext) -> None:
        runs.append(threading.current_thread().name)
        if len(runs) > 1:
            job.session.add(Note(text="second run"))
            return
        if writes == "before":
            job.session.add(Note(text="stuck run"))
            job.session.flush()
        started.set()
        seen.append(job.cancel_requested.wait(10))
        release.wait(10)
        job.session.add(Note(text="stuck run, asked to stop"))

    worker = sp.create_queue_worker(
        engine,
        handler,
        handler_mode="advanced",
        worker_id="stopper",
        await_termination_timeout=0.2,
        **LONG_LEASE,
    )
    # SQLite: the stuck run's session holds the database's one write lock, so nothing can be
    # written until its handler returns; then its end releases the lease (documented).
    locked = writes == "before" and engine.dialect.name == "sqlite"
    worker.start()
    try:
        assert started.wait(10)
        assert job_row(engine, job_id).lease_token is not None
        worker.stop()
        assert wait_for(lambda: len(seen) == 1) and seen == [True]
        if locked:
            release.set()
            assert wait_for(lambda: job_row(engine, job_id).lease_token is None)
        released = job_row(engine, job_id)
        assert (released.lease_token, released.process_at, released.unclean_ends) == (
            None,
            due,
            0,
        )
        assert sp.process_next_job(engine, handler, handler_mode="advanced", **LONG_LEASE)
    finally:
        release.set()
    assert wait_for(lambda: not any(t.name.startswith("stopper-") for t in threading.enumerate()))
    assert notes(engine) == ["second run"]
    [done] = archived(engine)
    assert (done.job_id, done.status) == (job_id, "success")


def test_stop_lets_a_leased_job_that_finishes_within_the_timeout_complete(
    engine: sa.Engine,
) -> None:
    """A job that ends while stop() waits completes as usual: its write commits with its
    archive row, and it is neither released nor asked to stop."""
    job_id = enqueue_committed(engine, "short")
    started, release = threading.Event(), threading.Event()
    seen: list[bool] = []

    def handler(job: sp.JobContext) -> None:
        started.set()
        release.wait(10)
        seen.append(job.cancel_requested.is_set())
        job.session.add(Note(text="finished"))

    worker = sp.create_queue_worker(engine, handler, handler_mode="advanced", **LONG_LEASE)
    worker.start()
    assert started.wait(10)
    stopping = threading.Thread(target=worker.stop)
    stopping.start()
    release.set()
    stopping.join(15)
    assert not stopping.is_alive() and not worker.running
    assert seen == [False]
    done = archived_job(engine, job_id)
    assert done is not None and (done.status, done.attempts) == ("success", 1)
    assert notes(engine) == ["finished"]
    assert jobs(engine) == []


# --- both modes on one queue ---------------------------------------------------------------


def test_a_transaction_mode_claim_never_takes_a_job_under_a_live_lease(
    engine: sa.Engine,
) -> None:
    job_id = enqueue_committed(engine, "leased")
    started, release = threading.Event(), threading.Event()
    other: list[Any] = []

    def handler(job_type: str, payload: Any) -> None:
        started.set()
        release.wait(10)

    with running(sp.create_queue_worker(engine, handler, **LONG_LEASE)):
        try:
            assert started.wait(10)
            assert not sp.process_next_job(engine, lambda *args: other.append(args))
        finally:
            release.set()
        assert wait_for(lambda: archived_job(engine, job_id) is not None)
    assert other == []


def test_a_transaction_mode_and_a_lease_mode_worker_on_one_queue_run_each_job_once(
    database: Any, engine: sa.Engine
) -> None:
    """200 jobs, two threads in each mode: every job's handler runs exactly once."""
    with Session(engine) as session:
        sp.enqueue_many(session, [("mixed", n) for n in range(200)])
        session.commit()
    calls: Counter[int] = Counter()
    lock = threading.Lock()

    def handler(job_type: str, payload: int) -> None:
        with lock:
            calls[payload] += 1

    transactional = sp.create_queue_worker(
        database.engine(), handler, worker_threads=2, polling_interval=0.02
    )
    leasing = sp.create_queue_worker(
        database.engine(), handler, worker_threads=2, lease_seconds=5.0, polling_interval=0.02
    )
    with running(transactional), running(leasing):
        assert wait_for(lambda: count(engine, sp.ArchivedJob) == 200, timeout=60)
    assert calls == Counter(range(200))
    assert {row.status for row in archived(engine)} == {"success"}
    assert sum(transactional.summary().values()) + sum(leasing.summary().values()) == 200


def test_a_batched_lease_claim_runs_each_job_once_each_completed_with_its_own_writes(
    database: Any, engine: sa.Engine
) -> None:
    """batch_size=5 claims five leases in one statement (SQLite: one); each job completes
    on its own, with its own write, and a failing one is retried alone."""
    with Session(engine) as session:
        sp.enqueue_many(session, [("batched", n) for n in range(60)])
        session.commit()
    calls: Counter[int] = Counter()
    lock = threading.Lock()

    def handler(job: sp.JobContext) -> None:
        with lock:
            calls[job.payload] += 1
        job.session.add(Note(text=f"job {job.payload} attempt {job.attempts}"))
        if job.payload == 7 and job.attempts == 1:
            raise RuntimeError("fails once")

    worker = sp.create_queue_worker(
        database.engine(),
        handler,
        handler_mode="advanced",
        worker_threads=3,
        batch_size=5,
        retry_strategy=lambda job, exc: sp.RetryStrategy(retries=1, delays=[0]),
        **LONG_LEASE,
    )
    with running(worker):
        assert wait_for(lambda: count(engine, sp.ArchivedJob) == 60, timeout=60)
    assert calls == Counter({**dict.fromkeys(range(60), 1), 7: 2})
    assert sorted(notes(engine)) == sorted(
        [f"job {n} attempt 1" for n in range(60) if n != 7] + ["job 7 attempt 2"]
    )
    assert worker.summary() == {"succeeded": 60, "retried": 1, "failed": 0}


def test_a_batched_lease_claim_runs_jobs_due_together_in_enqueue_order(
    engine: sa.Engine,
) -> None:
    """12 jobs enqueued in one statement (one due time) and claimed 5 at a time under leases
    (SQLite: one): they run in the order they were enqueued, each once."""
    with engine.begin() as conn:
        sp.enqueue_many(conn, [("ordered", n) for n in range(12)])
    ran: list[int] = []
    while sp.process_next_job(
        engine, lambda job_type, n: ran.append(n), batch_size=5, **LONG_LEASE
    ):
        pass
    assert ran == list(range(12))
    assert {(row.status, row.attempts) for row in archived(engine)} == {("success", 1)}


def test_successes_completed_together_are_fenced_one_by_one(
    database: Any, engine: sa.Engine
) -> None:
    """Successes that wrote nothing through their sessions are archived together, each only
    if it still carries its run's token: the first job's lease expires while its completion
    waits (the server is about to lock it), another worker runs and archives it, and the
    group's completion leaves it alone: each job is archived once."""
    if engine.dialect.name == "sqlite":
        pytest.skip("SQLite: the completion's transaction holds the write lock a takeover needs")
    first, second, third = (enqueue_committed(engine, "batched", n) for n in range(3))
    blocked, release, taken = threading.Event(), threading.Event(), threading.Event()
    runs: list[tuple[int, str]] = []
    fired: list[str] = []

    def handler(job: sp.JobContext) -> None:
        runs.append((job.payload, threading.current_thread().name))
        if job.payload == 1:
            blocked.set()
            release.wait(10)

    def take_over(conn: sa.Connection, cursor: Any, statement: str, *args: Any) -> None:
        """Before the first group's completion (the first job's alone, while the second
        runs: its lock, or PostgreSQL's one statement that deletes and archives): its lease
        expires and another worker runs the job to its end."""
        text = " ".join(statement.split())
        tokens = "lease_token IN" in text or "lease_token = ANY" in text  # a list, or an array
        grouped_lock = text.startswith("SELECT") and tokens and "SKIP LOCKED" not in text
        grouped_end = text.startswith("WITH ended AS")
        if not (grouped_lock or grouped_end) or fired:
            return
        fired.append(text)
        with engine.begin() as other:
            other.execute(
                sa.update(JOB).where(JOB.c.job_id == first).values(process_at=sp.utc_now())
            )
        assert sp.process_next_job(engine, handler, handler_mode="advanced", **LONG_LEASE)
        taken.set()

    worker_engine = database.engine()
    sa.event.listen(worker_engine, "before_cursor_execute", take_over)
    worker = sp.create_queue_worker(
        worker_engine, handler, handler_mode="advanced", batch_size=3, **LONG_LEASE
    )
    with running(worker):
        assert blocked.wait(10)
        assert taken.wait(10)
        release.set()
        assert wait_for(lambda: count(engine, sp.ArchivedJob) == 3)
        assert wait_for(lambda: sum(worker.summary().values()) == 2)
    assert [payload for payload, _ in runs] == [0, 1, 0, 2]
    assert sorted(row.job_id for row in archived(engine)) == sorted([first, second, third])
    assert archived_job(engine, first).attempts == 2, "archived by the run that took it"
    assert jobs(engine) == []
    assert worker.summary() == {"succeeded": 2, "retried": 0, "failed": 0}


def _idle_limited(database: Any, engine: sa.Engine) -> sa.Engine:
    """An engine whose sessions the server ends after 1 s idle in a transaction."""
    if engine.dialect.name == "postgresql":
        args = {"options": "-c idle_in_transaction_session_timeout=1000"}
    else:
        args = {"init_command": "SET SESSION idle_transaction_timeout = 1"}
    return database.engine(connect_args=args)  # type: ignore[no-any-return]


def test_an_idle_transaction_limit_spares_a_leased_handler_until_it_uses_its_session(
    database: Any, engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """With the server ending sessions idle in a transaction for 1 s: a leased handler that
    computes for 1.5 s and then writes succeeds (no transaction was open meanwhile); one that
    writes first and then computes loses its session every run, each counted as an unclean
    end, so it is archived as failed with JobCrashedError after max_unclean_ends runs, never
    looping."""
    if engine.dialect.name == "sqlite":
        pytest.skip("SQLite has no idle-transaction limit")
    limited = _idle_limited(database, engine)
    late, early = enqueue_committed(engine, "late"), enqueue_committed(engine, "early")
    runs: Counter[str] = Counter()

    def handler(job: sp.JobContext) -> None:
        runs[job.job_type] += 1
        if job.job_type == "early":
            job.session.add(Note(text="early"))
            job.session.flush()
        time.sleep(1.5)
        job.session.add(Note(text=job.job_type))

    caplog.set_level(logging.WARNING, logger="sqla_proletarian")
    worker = sp.create_queue_worker(
        limited, handler, handler_mode="advanced", max_unclean_ends=2, **LONG_LEASE
    )
    with running(worker):
        assert wait_for(lambda: count(engine, sp.ArchivedJob) == 2, timeout=30)
    done = {row.job_id: row for row in archived(engine)}
    assert done[late].status == "success"
    assert done[early].status == "failure" and done[early].error is not None
    assert "JobCrashedError" in done[early].error
    assert runs == Counter({"late": 1, "early": 2})
    assert notes(engine) == ["late"]
    assert len(events(caplog.records, "job-connection-lost")) == 2
    limited.dispose()
