"""What the worker records for each outcome: success, failure, retry, failed-job handler,
non-Exception interrupts, the job's own Session, and the log events that describe them."""

from __future__ import annotations

import logging
import re
import threading
import uuid
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from helpers import (
    T0,
    FakeClock,
    archived,
    archived_job,
    count,
    enqueue_committed,
    events,
    job_row,
    jobs,
    run_records,
    running,
    wait_for,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import sqla_proletarian as sp


class Boom(Exception):
    """The handler's failure in these tests."""


def _fail(job_type: str, payload: Any) -> None:
    raise Boom(f"cannot handle {job_type}")


def _ok(job_type: str, payload: Any) -> None:
    return None


# --- success and failure --------------------------------------------------------------------


def test_success_is_archived_with_one_attempt_and_leaves_the_job_table(
    engine: sa.Engine,
) -> None:
    clock = FakeClock()
    job_id = enqueue_committed(engine, "ok", {"k": "v"}, queue="q", clock=clock)
    clock.advance(3)
    assert sp.process_next_job(engine, _ok, queue="q", clock=clock)
    assert count(engine, sp.Job) == 0
    assert run_records(engine) == 0
    done = archived_job(engine, job_id)
    assert done is not None
    assert (done.status, done.attempts, done.error) == ("success", 1, None)
    assert (done.queue, done.job_type, done.enqueued_at, done.process_at) == ("q", "ok", T0, T0)
    assert done.finished_at == T0 + timedelta(seconds=3)
    assert sp.JsonSerializer().loads(done.payload) == {"k": "v"}


#: A statement that deletes run records (on MySQL the multi-table ``DELETE target FROM``).
RUN_RECORD_DELETE = re.compile(r"DELETE (?:\w+ )?FROM proletarian_job_run\b")


def test_a_one_job_claim_deletes_its_run_record_once(engine: sa.Engine) -> None:
    """The success removes the job's run records by job id, the claim's own among them, in
    one statement: not a second one by run id (on MariaDB, seven round trips for a claim of
    one job, not eight: the poll, the run record, the archive copy, the job's and its
    records' deletes, the look for its dependents, commit; on PostgreSQL the archive
    statement deletes them, by job id and by run id, each through its index)."""
    enqueue_committed(engine, "ok")
    sent: list[str] = []
    polled = threading.Event()

    @sa.event.listens_for(engine, "before_cursor_execute")
    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "FROM proletarian_job" in statement and "process_at <=" in statement:
            polled.set()
        if polled.is_set() and "proletarian_" in statement:
            sent.append(" ".join(statement.split()))

    assert sp.process_next_job(engine, _ok)
    sa.event.remove(engine, "before_cursor_execute", record)
    assert len([statement for statement in sent if RUN_RECORD_DELETE.search(statement)]) == 1
    if engine.dialect.name in ("mysql", "mariadb"):
        assert [statement.split()[0] for statement in sent] == [
            "SELECT",
            "INSERT",
            "INSERT",
            "DELETE",
            "DELETE",
            "SELECT",
        ]


def test_a_busy_claim_of_one_priority_polls_in_one_statement(engine: sa.Engine) -> None:
    """With due jobs of its first priority, a claim of one job locks it with one statement
    before recording its run (one round trip); MySQL and MariaDB read the due priorities
    first (``Dialect.poll_finds_priority``)."""
    for n in range(3):
        enqueue_committed(engine, "ok", n)
    sent: list[str] = []
    # SQLite first looks for a due job without its write lock: the claim starts after.
    claiming = threading.Event()
    if engine.dialect.name != "sqlite":
        claiming.set()
    recorded = threading.Event()

    @sa.event.listens_for(engine, "before_cursor_execute")
    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.startswith("BEGIN IMMEDIATE"):
            claiming.set()
        if statement.startswith("INSERT INTO proletarian_job_run"):
            recorded.set()
        if claiming.is_set() and not recorded.is_set() and "proletarian_" in statement:
            sent.append(statement)

    assert sp.process_next_job(engine, _ok)
    sa.event.remove(engine, "before_cursor_execute", record)
    assert recorded.is_set()
    # A runner's first claim also reads which of its queues have limits (once a runner).
    looks = [s for s in sent if s.startswith("SELECT proletarian_queue_limit.queue, ")]
    assert len(looks) == 1, sent
    sent = [statement for statement in sent if statement not in looks]
    expected = 1 if sp.dialects.dialect_of(engine).poll_finds_priority else 2
    assert len(sent) == expected, sent
    assert all(statement.lstrip().startswith(("SELECT", "WITH")) for statement in sent), sent


def test_an_exception_without_retry_strategy_archives_a_failure_with_its_error(
    engine: sa.Engine,
) -> None:
    job_id = enqueue_committed(engine, "bad", None)
    assert sp.process_next_job(engine, _fail)
    assert count(engine, sp.Job) == 0
    assert run_records(engine) == 0
    done = archived_job(engine, job_id)
    assert done is not None
    assert (done.status, done.attempts) == ("failure", 1)
    assert done.error is not None and "Boom" in done.error and "cannot handle bad" in done.error
    assert not sp.process_next_job(engine, _fail), "a failed job does not run again"


def test_retry_arithmetic_end_to_end(engine: sa.Engine) -> None:
    """RetryStrategy(2, [1, 5]): run 1 fails -> +1 s, run 2 -> +5 s, run 3 -> failure, 3 runs."""
    clock = FakeClock()
    job_id = enqueue_committed(engine, "flaky", {"n": 1}, clock=clock)
    seen: list[tuple[int, uuid.UUID, str]] = []

    def strategy(job: sp.JobContext, exc: Exception) -> sp.RetryStrategy:
        seen.append((job.attempts, job.job_id, str(exc)))
        return sp.RetryStrategy(2, [1, 5])

    options: dict[str, Any] = {"retry_strategy": strategy, "clock": clock}

    assert sp.process_next_job(engine, _fail, **options)
    row = job_row(engine, job_id)
    assert row is not None
    assert (row.attempts, row.process_at, row.enqueued_at) == (1, T0 + timedelta(seconds=1), T0)

    clock.set(T0 + timedelta(seconds=1) - timedelta(microseconds=1))
    assert not sp.process_next_job(engine, _fail, **options), "not due yet"
    clock.set(T0 + timedelta(seconds=1))
    assert sp.process_next_job(engine, _fail, **options)
    row = job_row(engine, job_id)
    assert row is not None
    assert (row.attempts, row.process_at) == (2, T0 + timedelta(seconds=6))

    clock.set(T0 + timedelta(seconds=6))
    assert sp.process_next_job(engine, _fail, **options)
    assert count(engine, sp.Job) == 0
    done = archived_job(engine, job_id)
    assert done is not None
    assert (done.status, done.attempts) == ("failure", 3)
    assert done.process_at == T0 + timedelta(seconds=6), "the archive keeps the last run's"
    assert [attempt for attempt, _, _ in seen] == [1, 2, 3]
    assert {jid for _, jid, _ in seen} == {job_id}
    assert all(message == "cannot handle flaky" for _, _, message in seen)


def test_retry_strategy_sees_the_handlers_exception_and_no_retry_means_failure(
    engine: sa.Engine,
) -> None:
    job_id = enqueue_committed(engine, "bad", None)
    got: list[tuple[sp.JobContext, Exception]] = []

    def strategy(job: sp.JobContext, exc: Exception) -> None:
        got.append((job, exc))

    assert sp.process_next_job(engine, _fail, retry_strategy=strategy)
    [(job, exc)] = got
    assert isinstance(exc, Boom) and job.job_id == job_id and job.attempts == 1
    done = archived_job(engine, job_id)
    assert done is not None and (done.status, done.attempts) == ("failure", 1)


def test_a_retry_strategy_that_raises_or_returns_garbage_does_not_kill_the_worker(
    engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sqla_proletarian")
    raises = enqueue_committed(engine, "bad", "raises")
    garbage = enqueue_committed(engine, "bad", "garbage")

    def strategy(job: sp.JobContext, exc: Exception) -> Any:
        if job.payload == "raises":
            return 1 / 0
        return {"retries": 3}

    worker = sp.create_queue_worker(engine, _fail, retry_strategy=strategy, polling_interval=0.05)
    with running(worker):
        assert wait_for(lambda: len(archived(engine)) == 2)
        assert worker.running
        expected = {"succeeded": 0, "retried": 0, "failed": 2}
        assert wait_for(lambda: worker.summary() == expected), worker.summary()
    for job_id in (raises, garbage):
        done = archived_job(engine, job_id)
        assert done is not None and (done.status, done.attempts) == ("failure", 1)
        assert done.error is not None and "Boom" in done.error
    errors = {r.job_id: r.error for r in events(caplog.records, "retry-strategy-error")}
    assert set(errors) == {raises, garbage}
    assert "ZeroDivisionError" in errors[raises]
    assert "RetryStrategy" in errors[garbage]


# --- failed-job handler ---------------------------------------------------------------------


def test_failed_job_handler_is_called_once_after_the_failure_is_recorded(
    engine: sa.Engine,
) -> None:
    job_id = enqueue_committed(engine, "bad", {"x": 1})
    calls: list[tuple[sp.JobContext, Exception, str | None, int]] = []

    def on_failed(job: sp.JobContext, exc: Exception) -> None:
        # Another connection already sees the archive row and an empty job table.
        done = archived_job(engine, job.job_id)
        calls.append((job, exc, done.status if done else None, count(engine, sp.Job)))

    options: dict[str, Any] = {
        "retry_strategy": lambda job, exc: sp.RetryStrategy(1),
        "failed_job_handler": on_failed,
    }
    assert sp.process_next_job(engine, _fail, **options)
    assert calls == [], "a retried job is not a failed one"
    assert sp.process_next_job(engine, _fail, **options)
    assert not sp.process_next_job(engine, _fail, **options)
    [(job, exc, status, remaining)] = calls
    assert isinstance(job, sp.JobContext)
    assert (job.job_id, job.attempts, job.payload) == (job_id, 2, {"x": 1})
    assert isinstance(exc, Boom)
    assert (status, remaining) == ("failure", 0)


def test_a_failed_job_handler_that_raises_is_logged_and_the_job_stays_failed(
    engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sqla_proletarian")
    job_id = enqueue_committed(engine, "bad", None)
    calls: list[uuid.UUID] = []

    def on_failed(job: sp.JobContext, exc: Exception) -> None:
        calls.append(job.job_id)
        raise RuntimeError("the failed-job handler is broken too")

    assert sp.process_next_job(engine, _fail, failed_job_handler=on_failed)
    assert not sp.process_next_job(engine, _fail, failed_job_handler=on_failed), "no loop"
    assert calls == [job_id]
    done = archived_job(engine, job_id)
    assert done is not None and (done.status, done.attempts) == ("failure", 1)
    assert count(engine, sp.Job) == 0
    [record] = events(caplog.records, "failed-job-handler-error")
    assert record.job_id == job_id
    assert record.levelno == logging.ERROR
    assert "the failed-job handler is broken too" in record.error


# --- BaseException --------------------------------------------------------------------------


def test_a_base_exception_propagates_and_rolls_the_job_back_untouched(
    engine: sa.Engine,
) -> None:
    """KeyboardInterrupt and SystemExit from a handler are not failures: the job is untouched.

    An operator's KeyboardInterrupt leaves no trace; a SystemExit raised by the handler keeps
    its run record (an unclean end), so a job that always exits its worker cannot loop.
    """
    clock = FakeClock()
    job_id = enqueue_committed(engine, "stop", None, clock=clock)
    retry_calls: list[Exception] = []
    failed_calls: list[Exception] = []
    for interrupt in (KeyboardInterrupt, SystemExit):

        def handler(job_type: str, payload: Any, interrupt: type = interrupt) -> None:
            raise interrupt()

        with pytest.raises(interrupt):
            sp.process_next_job(
                engine,
                handler,
                clock=clock,
                retry_strategy=lambda job, exc: retry_calls.append(exc),
                failed_job_handler=lambda job, exc: failed_calls.append(exc),
            )
        row = job_row(engine, job_id)
        assert row is not None, interrupt
        assert (row.attempts, row.process_at) == (0, T0), interrupt
        assert archived(engine) == [], interrupt
        expected_records = 1 if interrupt is SystemExit else 0
        assert run_records(engine) == expected_records, interrupt
    assert retry_calls == failed_calls == []
    assert sp.process_next_job(engine, _ok, clock=clock), "the job is still there to run"
    done = archived_job(engine, job_id)
    assert done is not None and (done.status, done.attempts) == ("success", 2)
    assert run_records(engine) == 0


def test_a_base_exception_stops_the_queue_worker_and_leaves_the_job_untouched(
    engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sqla_proletarian")
    job_id = enqueue_committed(engine, "stop", None)
    shutdowns: list[int] = []

    def handler(job_type: str, payload: Any) -> None:
        raise KeyboardInterrupt

    worker = sp.create_queue_worker(
        engine, handler, polling_interval=0.05, on_shutdown=lambda: shutdowns.append(1)
    )
    with running(worker):
        assert worker.wait(5), "the worker stopped itself"
        assert not worker.running
    row = job_row(engine, job_id)
    assert row is not None and row.attempts == 0
    assert archived(engine) == []
    assert run_records(engine) == 0
    assert shutdowns == [1]
    assert worker.summary() == {"succeeded": 0, "retried": 0, "failed": 0}
    assert events(caplog.records, "job-worker-error")


# --- the job's own Session ------------------------------------------------------------------


class UserBase(DeclarativeBase):
    """A user's own declarative base, unrelated to the library's."""


class Note(UserBase):
    __tablename__ = "sp_test_note"

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(sa.String(36))
    body: Mapped[str] = mapped_column(sa.String(100))


def _notes(engine: sa.Engine) -> list[tuple[str, str]]:
    with Session(engine) as session:
        return [(n.job_id, n.body) for n in session.scalars(sa.select(Note).order_by(Note.id))]


def test_writes_through_job_session_commit_together_with_the_archive_row(
    engine: sa.Engine,
) -> None:
    UserBase.metadata.create_all(engine)
    job_id = enqueue_committed(engine, "write", {"body": "hello"})
    seen_outside: list[tuple[int, int]] = []

    def handler(job: sp.JobContext) -> None:
        job.session.add(Note(job_id=str(job.job_id), body=job.payload["body"]))
        job.session.execute(sa.insert(Note).values(job_id=str(job.job_id), body="core"))
        job.session.flush()
        seen_outside.append((count(engine, Note), len(archived(engine))))

    assert sp.process_next_job(engine, handler, handler_mode="advanced")
    assert seen_outside == [(0, 0)], "nothing is visible before the job's transaction commits"
    assert _notes(engine) == [(str(job_id), "hello"), (str(job_id), "core")]
    done = archived_job(engine, job_id)
    assert done is not None and done.status == "success"


def test_job_session_is_the_claims_own_transaction_holding_the_jobs_lock(
    engine: sa.Engine,
) -> None:
    """job.session runs in the transaction that claimed the job, not beside it: it can take
    the job row's lock at once (NOWAIT), which any other transaction would be refused while
    the claim holds it. (SQLite has no row locks; there the statement just reads the row.)"""
    job_id = enqueue_committed(engine, "locked", None)
    seen: list[Any] = []
    job_table = sp.Job.__table__

    def handler(job: sp.JobContext) -> None:
        query = (
            sa.select(job_table.c.job_id)
            .where(job_table.c.job_id == job.job_id)
            .with_for_update(nowait=True)
        )
        seen.append(job.session.execute(query).scalar_one())

    assert sp.process_next_job(engine, handler, handler_mode="advanced")
    assert seen == [job_id]
    done = archived_job(engine, job_id)
    assert done is not None and (done.status, done.error) == ("success", None)


def test_writes_through_job_session_roll_back_when_the_handler_raises(engine: sa.Engine) -> None:
    """The handler's writes vanish, while the retry and then the failure are recorded."""
    UserBase.metadata.create_all(engine)
    clock = FakeClock()
    job_id = enqueue_committed(engine, "write", None, clock=clock)

    def handler(job: sp.JobContext) -> None:
        job.session.add(Note(job_id=str(job.job_id), body=f"run {job.attempts}"))
        job.session.flush()
        raise Boom("after writing")

    options: dict[str, Any] = {
        "handler_mode": "advanced",
        "clock": clock,
        "retry_strategy": lambda job, exc: sp.RetryStrategy(1, [2]),
    }
    assert sp.process_next_job(engine, handler, **options)
    row = job_row(engine, job_id)
    assert row is not None and (row.attempts, row.process_at) == (1, T0 + timedelta(seconds=2))
    assert _notes(engine) == []
    clock.advance(2)
    assert sp.process_next_job(engine, handler, **options)
    done = archived_job(engine, job_id)
    assert done is not None and (done.status, done.attempts) == ("failure", 2)
    assert _notes(engine) == []


def test_a_database_error_in_the_handler_does_not_poison_the_jobs_transaction(
    engine: sa.Engine,
) -> None:
    """A constraint violation through job.session: the retry is still recorded, no writes kept."""
    UserBase.metadata.create_all(engine)
    with Session(engine) as session:
        session.add(Note(id=1, job_id="taken", body="existing"))
        session.commit()
    clock = FakeClock()
    job_id = enqueue_committed(engine, "dup", None, clock=clock)
    errors: list[Exception] = []

    def handler(job: sp.JobContext) -> None:
        job.session.add(Note(id=2, job_id=str(job.job_id), body="kept?"))
        job.session.flush()
        job.session.add(Note(id=1, job_id=str(job.job_id), body="duplicate key"))
        job.session.flush()

    def strategy(job: sp.JobContext, exc: Exception) -> sp.RetryStrategy:
        errors.append(exc)
        return sp.RetryStrategy(1, [1])

    assert sp.process_next_job(
        engine, handler, handler_mode="advanced", clock=clock, retry_strategy=strategy
    )
    [error] = errors
    assert isinstance(error, sa.exc.IntegrityError)
    row = job_row(engine, job_id)
    assert row is not None and (row.attempts, row.process_at) == (1, T0 + timedelta(seconds=1))
    assert _notes(engine) == [("taken", "existing")]


def test_writes_committed_on_job_session_still_roll_back_when_the_handler_then_raises(
    engine: sa.Engine,
) -> None:
    """A handler that calls job.session.commit() and then raises leaves no writes behind:
    the job's transaction is the unit, not the handler's session."""
    UserBase.metadata.create_all(engine)
    job_id = enqueue_committed(engine, "write", None)

    def handler(job: sp.JobContext) -> None:
        job.session.add(Note(job_id=str(job.job_id), body="committed, then raised"))
        job.session.commit()
        raise Boom("after commit")

    assert sp.process_next_job(engine, handler, handler_mode="advanced")
    done = archived_job(engine, job_id)
    assert done is not None and done.status == "failure"
    assert _notes(engine) == []


def test_the_job_session_is_closed_for_good_once_the_outcome_is_recorded(
    engine: sa.Engine,
) -> None:
    """A handler that keeps job.session cannot write through it after its job: a later job,
    run by the same worker thread on the same connection, gets an error from it instead
    of a write slipped into its own transaction."""
    UserBase.metadata.create_all(engine)
    first = enqueue_committed(engine, "keep", None)
    second = enqueue_committed(engine, "reuse", None)
    kept: list[Session] = []
    errors: list[Exception] = []

    def handler(job: sp.JobContext) -> None:
        if job.job_type == "keep":
            kept.append(job.session)
            return
        try:
            kept[0].execute(sa.insert(Note).values(job_id=str(first), body="late write"))
        except Exception as exc:
            errors.append(exc)

    worker = sp.create_queue_worker(engine, handler, handler_mode="advanced")
    with running(worker):
        assert wait_for(lambda: archived_job(engine, second) is not None)
    [error] = errors
    assert isinstance(error, sa.exc.InvalidRequestError)
    assert "closed" in str(error)
    assert _notes(engine) == []


# --- logging --------------------------------------------------------------------------------


def test_log_events_have_stable_names_and_structured_fields(
    engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="sqla_proletarian")
    clock = FakeClock()
    ok_id = enqueue_committed(engine, "ok", None, queue="logs", clock=clock)
    bad_id = enqueue_committed(engine, "bad", None, queue="logs", clock=clock)
    options: dict[str, Any] = {
        "queue": "logs",
        "clock": clock,
        "worker_id": "logger-test",
        "retry_strategy": lambda job, exc: sp.RetryStrategy(1, [3]),
    }
    handler = sp.JobHandlers()
    handler.register("ok")(_ok)
    handler.register("bad")(_fail)
    assert sp.process_next_job(engine, handler, **options)
    assert sp.process_next_job(engine, handler, **options)
    clock.advance(3)
    assert sp.process_next_job(engine, handler, **options)

    for record in caplog.records:
        if record.name == "sqla_proletarian":
            assert isinstance(getattr(record, "event", None), str), record.getMessage()
    [handling_ok, *handling_bad] = events(caplog.records, "handling-job")
    assert [r.attempt for r in handling_bad] == [1, 2]
    for record in [handling_ok, *handling_bad]:
        assert record.worker_id == "logger-test"
        assert record.queue == "logs"
        assert isinstance(record.thread_name, str)
    assert (handling_ok.job_id, handling_ok.job_type, handling_ok.attempt) == (ok_id, "ok", 1)
    [finished] = events(caplog.records, "job-finished")
    assert finished.job_id == ok_id
    exceptions = events(caplog.records, "handle-job-exception")
    assert [(r.job_id, r.attempt) for r in exceptions] == [(bad_id, 1), (bad_id, 2)]
    assert all("Boom" in r.error for r in exceptions)
    [retrying] = events(caplog.records, "retrying")
    assert (retrying.job_id, retrying.retries_left) == (bad_id, 1)
    assert retrying.retry_at == (T0 + timedelta(seconds=3)).isoformat()
    [not_retrying] = events(caplog.records, "not-retrying")
    assert (not_retrying.job_id, not_retrying.attempt) == (bad_id, 2)
    assert ok_id in {j.job_id for j in archived(engine)}
    assert jobs(engine) == []


@pytest.mark.parametrize("mode", [{}, {"lease_seconds": 30.0}], ids=["transaction", "lease"])
def test_each_succeeded_job_is_logged_at_info_with_its_duration(
    engine: sa.Engine, caplog: pytest.LogCaptureFixture, mode: dict[str, Any]
) -> None:
    """At INFO, each succeeded job (a batch's too) logs ``job-finished`` with the seconds
    from its handler's start until its success committed (a batch's jobs commit together:
    the last one's are its own); the ``sqla_proletarian.finished`` logger at WARNING quiets
    just them."""
    caplog.set_level(logging.INFO, logger="sqla_proletarian")
    durations = {"quick": 0.0, "slow": 0.3}

    def handler(job_type: str, payload: Any) -> None:
        threading.Event().wait(durations[job_type])

    ids = [enqueue_committed(engine, name, None) for name in ("slow", "slow", "quick")]
    worker = sp.create_queue_worker(
        engine, handler, worker_threads=1, batch_size=3, polling_interval=0.02, **mode
    )
    with running(worker):
        assert wait_for(lambda: all(archived_job(engine, job_id) for job_id in ids))
        assert wait_for(lambda: len(events(caplog.records, "job-finished")) == 3)
    finished = {r.job_id: r for r in events(caplog.records, "job-finished")}
    assert set(finished) == set(ids)
    for job_id, record in finished.items():
        assert record.levelno == logging.INFO
        assert record.name == "sqla_proletarian.finished"
        assert f"job_id={job_id}" in record.getMessage()
        assert f"seconds={record.seconds}" in record.getMessage()
        assert durations[record.job_type] <= record.seconds < 30
    assert finished[ids[2]].seconds < 0.3

    caplog.clear()
    logging.getLogger("sqla_proletarian.finished").setLevel(logging.WARNING)
    try:
        quiet = sp.create_queue_worker(engine, handler, polling_interval=0.02, **mode)
        job_id = enqueue_committed(engine, "quick", None)
        with running(quiet):
            assert wait_for(lambda: archived_job(engine, job_id) is not None)
    finally:
        logging.getLogger("sqla_proletarian.finished").setLevel(logging.NOTSET)
    assert events(caplog.records, "job-finished") == []
    assert events(caplog.records, "queue-worker-starting")
