"""Bulk enqueue: ``sp.enqueue_many`` and ``session.add_all([sp.Job(...)])`` write many jobs in
few statements, in the caller's transaction, all or nothing."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from helpers import FakeClock, jobs
from sqlalchemy.orm import Session, scoped_session, sessionmaker

import sqla_proletarian as sp


def job_inserts(engine: sa.Engine) -> list[int]:
    """A list that collects the number of rows of each INSERT into the job table."""
    seen: list[int] = []

    @sa.event.listens_for(engine, "before_cursor_execute")
    def count(conn: Any, cursor: Any, statement: str, params: Any, context: Any, many: bool):
        if statement.lstrip().upper().startswith("INSERT INTO PROLETARIAN_JOB "):
            if isinstance(params, dict):  # one row, or rows as job_id__0, job_id__1...
                seen.append(sum(1 for key in params if key.split("__")[0] == "job_id") or 1)
            else:
                seen.append(len(params) if many else 1)

    return seen


def test_enqueue_many_returns_ids_in_order_and_the_worker_runs_them_in_that_order(
    engine: sa.Engine,
) -> None:
    clock = FakeClock()
    with engine.begin() as conn:
        ids = sp.enqueue_many(conn, [("n", n) for n in range(25)], clock=clock)
    assert len(set(ids)) == 25
    queued = jobs(engine)
    assert [job.job_id for job in queued] == ids
    ran: list[int] = []
    while sp.process_next_job(engine, lambda job_type, n: ran.append(n), clock=clock):
        pass
    assert ran == list(range(25))


@pytest.mark.parametrize("how", ["session", "scoped_session", "connection"])
def test_enqueue_many_joins_the_callers_transaction_and_never_commits(
    engine: sa.Engine, how: str
) -> None:
    """Commit: every job exists; roll back: none does, through a Session, a scoped_session
    or a Connection."""
    for commit in (False, True):
        if how == "connection":
            with engine.connect() as conn:
                sp.enqueue_many(conn, [("a", 1), ("b", 2)])
                conn.commit() if commit else conn.rollback()
        else:
            factory = sessionmaker(engine)
            session: Any = scoped_session(factory) if how == "scoped_session" else factory()
            sp.enqueue_many(session, [("a", 1), ("b", 2)])
            session.commit() if commit else session.rollback()
            session.close() if how == "session" else session.remove()
        assert len(jobs(engine)) == (2 if commit else 0)


def test_enqueue_many_validates_every_job_first_and_names_the_bad_one(engine: sa.Engine) -> None:
    batch = [("ok", 1), ("ok", 2), ("", 3), ("ok", 4)]
    with engine.begin() as conn:
        with pytest.raises(sp.InvalidJobError, match=r"jobs\[2\]") as info:
            sp.enqueue_many(conn, batch)
        assert info.value.field == "jobs[2]"
        with pytest.raises(sp.PayloadSerializationError, match=r"jobs\[1\]: payload"):
            sp.enqueue_many(conn, [("ok", 1), ("bad", {1, 2})])
        with pytest.raises(sp.InvalidJobError, match=r"jobs\[0\]"):
            sp.enqueue_many(conn, ["not-a-pair"])  # type: ignore[list-item]
        with pytest.raises(sp.InvalidJobError, match="job_id_strategy"):
            sp.enqueue_many(conn, [("ok", 1)], job_id=sp.uuid4())
    assert jobs(engine) == []
    with pytest.raises(sp.NotATransactionError, match="Engine"):
        sp.enqueue_many(engine, [("ok", 1)])  # type: ignore[arg-type]


def test_enqueue_many_writes_its_jobs_in_a_few_statements_not_one_per_job(
    engine: sa.Engine,
) -> None:
    """At most one INSERT per 1,000 jobs (an executemany counts once; psycopg 3's COPY is
    not an INSERT)."""
    inserts = job_inserts(engine)
    with engine.begin() as conn:
        sp.enqueue_many(conn, [("n", n) for n in range(2500)])
    assert len(inserts) <= 3
    assert len(jobs(engine)) == 2500


def test_enqueue_many_applies_queue_and_schedule_to_every_job(engine: sa.Engine) -> None:
    clock = FakeClock()
    with engine.begin() as conn:
        sp.enqueue_many(conn, [("a", None), ("b", None)], queue="later", process_in=60, clock=clock)
    queued = jobs(engine)
    assert {job.queue for job in queued} == {"later"}
    assert {job.process_at for job in queued} == {clock.now + timedelta(seconds=60)}
    assert not sp.process_next_job(engine, lambda t, p: None, queue="later", clock=clock)


def test_session_add_all_of_many_jobs_is_one_insert_per_flush(engine: sa.Engine) -> None:
    """No INSERT (and no nextval() round trip) per job: one executemany per flush."""
    inserts = job_inserts(engine)
    with Session(engine) as session:
        session.add_all([sp.Job(job_type="n", payload=n) for n in range(50)])
        session.commit()
    assert inserts == [50]
    assert len(jobs(engine)) == 50


def test_one_job_through_a_session_or_a_connection_is_one_statement(engine: sa.Engine) -> None:
    statements: list[str] = []
    sa.event.listen(
        engine,
        "before_cursor_execute",
        lambda conn, cursor, statement, *args: statements.append(statement),
    )
    with Session(engine) as session:
        sp.enqueue(session, "one", 1)
        session.flush()
        flushed = list(statements)
        session.commit()
    with engine.begin() as conn:
        statements.clear()
        sp.enqueue(conn, "one", 2)
        direct = list(statements)
    assert [s.split()[0].upper() for s in flushed] == ["INSERT"]
    assert [s.split()[0].upper() for s in direct] == ["INSERT"]
