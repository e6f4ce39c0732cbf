"""Unique jobs: while a job holding a key is queued or running in its queue, enqueueing the key
again adds nothing and returns that job's id, in the Session and the Connection path, within
one transaction and across racing ones; once archived, or rolled back, the key is free."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from helpers import archived_job, count, enqueue_committed, events, jobs, running
from sqlalchemy.orm import Session

import sqla_proletarian as sp
from sqla_proletarian.errors import is_serialization_failure

JOB = sp.Job.__table__


def noop(job_type: str, payload: Any) -> None:
    pass


def test_enqueueing_a_queued_jobs_key_again_adds_nothing_and_returns_its_id(
    engine: sa.Engine,
) -> None:
    first = enqueue_committed(engine, "sync", {"n": 1}, unique_key="user-7")
    with Session(engine) as session:
        assert sp.enqueue(session, "sync", {"n": 2}, unique_key="user-7") == first
        session.commit()
    with engine.begin() as conn:
        assert sp.enqueue(conn, "other-type", unique_key="user-7") == first
    (job,) = jobs(engine)
    assert (job.job_id, job.payload, job.unique_key) == (first, '{"n":1}', "user-7")


def test_the_same_key_twice_in_one_transaction_makes_one_job(engine: sa.Engine) -> None:
    with Session(engine) as session:
        first = sp.enqueue(session, "sync", unique_key="a")
        assert sp.enqueue(session, "sync", unique_key="a") == first
        session.commit()
    with engine.begin() as conn:
        second = sp.enqueue(conn, "sync", unique_key="b")
        assert sp.enqueue(conn, "sync", unique_key="b") == second
    assert {job.job_id for job in jobs(engine)} == {first, second}


def test_a_key_is_held_within_its_queue_only_and_jobs_without_keys_never_clash(
    engine: sa.Engine,
) -> None:
    with engine.begin() as conn:
        ids = {
            sp.enqueue(conn, "sync", unique_key="k", queue="one"),
            sp.enqueue(conn, "sync", unique_key="k", queue="two"),
            sp.enqueue(conn, "sync", unique_key="K", queue="one"),  # keys compare exactly
            sp.enqueue(conn, "sync", unique_key="k ", queue="one"),
            sp.enqueue(conn, "sync"),
            sp.enqueue(conn, "sync"),
        }
    assert len(ids) == 6 == count(engine, JOB)


def test_once_the_job_is_archived_its_key_is_free_again(engine: sa.Engine) -> None:
    first = enqueue_committed(engine, "sync", unique_key="k")
    assert sp.process_next_job(engine, noop)
    second = enqueue_committed(engine, "sync", unique_key="k")
    assert second != first
    assert [job.job_id for job in jobs(engine)] == [second]
    archived = archived_job(engine, first)
    assert archived is not None and archived.status == "success"


def test_a_key_taken_by_a_transaction_that_rolls_back_is_free_again(engine: sa.Engine) -> None:
    with Session(engine) as session:
        rolled_back = sp.enqueue(session, "sync", unique_key="k")
        session.rollback()
    with engine.connect() as conn:
        conn.begin()
        nested = conn.begin_nested()
        in_savepoint = sp.enqueue(conn, "sync", unique_key="k")
        nested.rollback()
        kept = sp.enqueue(conn, "sync", unique_key="k")
        conn.commit()
    assert len({rolled_back, in_savepoint, kept}) == 3
    assert [job.job_id for job in jobs(engine)] == [kept]


def test_a_running_jobs_key_returns_its_id_at_once(database: Any) -> None:
    """While a worker runs the job, an enqueue of its key neither waits nor adds a job.
    (On SQLite a running job holds the write lock, so any enqueue waits for it: skipped.)"""
    if database.backend == "sqlite":
        pytest.skip("SQLite: every write waits while a job runs")
    engine = database.engine()
    started, release = threading.Event(), threading.Event()

    def handler(job_type: str, payload: Any) -> None:
        started.set()
        release.wait(10)

    first = enqueue_committed(engine, "slow", unique_key="k")
    with running(sp.create_queue_worker(engine, handler, polling_interval=0.02)):
        assert started.wait(10)
        began = time.monotonic()
        with Session(engine) as session:
            assert sp.enqueue(session, "slow", unique_key="k") == first
            session.commit()
        assert time.monotonic() - began < 2
        release.set()
    assert jobs(engine) == []
    assert archived_job(engine, first) is not None


Enqueue = Callable[[sa.Engine, str, bool], uuid.UUID]


def racer(path: str, isolation: str | None, go: threading.Barrier) -> Enqueue:
    """Enqueue ``key`` in a transaction that has read the job table before (so a snapshot
    is taken where the isolation level keeps one), meets the other racer (``meet``), and
    commits a moment after its enqueue, while the other's enqueue may be waiting for it."""

    def enqueue(engine: sa.Engine, key: str, meet: bool) -> uuid.UUID:
        if isolation is not None:
            engine = engine.execution_options(isolation_level=isolation)
        read = sa.select(sa.func.count()).select_from(JOB)
        if path == "session":
            with Session(engine) as session:
                session.execute(read).scalar()
                if meet:
                    go.wait(10)
                job_id = sp.enqueue(session, "sync", unique_key=key)
                time.sleep(0.05)
                session.commit()
                return job_id
        with engine.connect() as conn:
            conn.execute(read).scalar()
            if meet:
                go.wait(10)
            job_id = sp.enqueue(conn, "sync", unique_key=key)
            time.sleep(0.05)
            conn.commit()
            return job_id

    return enqueue


def race(
    enqueue: Enqueue,
    engine: sa.Engine,
    key: str,
    isolation: str | None,
    results: list[uuid.UUID],
    errors: list[BaseException],
) -> None:
    """One racer's thread: its job id in ``results``, or what it raised in ``errors``."""
    try:
        try:
            results.append(enqueue(engine, key, True))
        except sa.exc.OperationalError as exc:
            if isolation != "SERIALIZABLE" or not is_serialization_failure(exc):
                raise
            results.append(enqueue(engine, key, False))
    except BaseException as exc:
        errors.append(exc)


ISOLATION_LEVELS = {
    "sqlite": [None],
    "postgresql": [None, "REPEATABLE READ", "SERIALIZABLE"],
    # None: REPEATABLE READ. (SERIALIZABLE InnoDB turns the racers' first read into a shared
    # lock of the range, so any two of them that then insert deadlock, keys or not.)
    "mariadb": [None, "READ COMMITTED"],
}


@pytest.mark.parametrize("isolation_index", [0, 1, 2], ids=["default", "level-2", "level-3"])
def test_two_transactions_racing_on_one_key_make_one_job_and_both_get_its_id(
    database: Any, isolation_index: int
) -> None:
    """Two threads on real connections enqueue the same key at the same moment, five keys
    over: one job each, both callers get its id, neither sees an error. At the isolation
    levels that keep a snapshot (PostgreSQL REPEATABLE READ and SERIALIZABLE; MariaDB's
    default REPEATABLE READ) the second meets a job its snapshot cannot see. PostgreSQL's
    SERIALIZABLE may still refuse a racer's whole transaction (a serialization failure, for
    its read of the table and its write, keys or not): that caller retries, as it must."""
    levels = ISOLATION_LEVELS[database.backend]
    if isolation_index >= len(levels):
        pytest.skip("no further isolation level to race at on this backend")
    isolation = levels[isolation_index]
    engine = database.engine()
    for round_ in range(5):
        key = f"key-{round_}"
        go = threading.Barrier(2)
        results: list[uuid.UUID] = []
        errors: list[BaseException] = []

        racers = [racer("session", isolation, go), racer("connection", isolation, go)]
        threads = [
            threading.Thread(target=race, args=(enqueue, engine, key, isolation, results, errors))
            for enqueue in racers
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert errors == []
        assert len(results) == 2 and results[0] == results[1]
        held = [job.job_id for job in jobs(engine) if job.unique_key == key]
        assert held == [results[0]]


def test_enqueue_many_returns_each_jobs_own_id_or_the_id_of_the_job_holding_its_key(
    engine: sa.Engine,
) -> None:
    held = enqueue_committed(engine, "sync", unique_key="held")
    with Session(engine) as session:
        ids = sp.enqueue_many(
            session,
            [
                ("sync", 1, "held"),
                ("plain", 2),
                ("sync", 3, "new"),
                ("sync", 4, "new"),
                ("plain", 5, None),
            ],
        )
        session.commit()
    assert ids[0] == held
    assert ids[2] == ids[3]
    assert len(set(ids)) == 4
    assert {job.job_id for job in jobs(engine)} == set(ids)
    new = next(job for job in jobs(engine) if job.job_id == ids[2])
    assert new.payload == "3"


def test_a_job_with_a_key_added_to_a_session_directly_is_refused_pointing_at_enqueue() -> None:
    with pytest.raises(sp.InvalidJobError, match=r"sp\.enqueue\(session") as info:
        sp.Job(job_type="sync", unique_key="k")
    assert info.value.field == "unique_key"
    assert sp.Job(job_type="sync", unique_key=None).unique_key is None


def test_a_bad_unique_key_is_refused_before_anything_is_written(engine: sa.Engine) -> None:
    for bad in ["", "x" * 256, 7, b"k", "a\x00b"]:
        with engine.begin() as conn:
            with pytest.raises(sp.InvalidJobError, match="unique_key") as info:
                sp.enqueue(conn, "sync", unique_key=bad)
            assert info.value.field == "unique_key"
            with pytest.raises(sp.InvalidJobError, match=r"jobs\[1\]: unique_key"):
                sp.enqueue_many(conn, [("sync", 1, "fine"), ("sync", 2, bad)])
    assert jobs(engine) == []


#: Session settings that turn a wait for a row lock into an error within two seconds.
LOCK_TIMEOUT = {
    "postgresql": {"options": "-c lock_timeout=2000"},
    "mariadb": {"init_command": "SET SESSION innodb_lock_wait_timeout = 2"},
}


def test_an_open_transaction_that_met_a_held_key_does_not_keep_a_worker_from_archiving_it(
    database: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Enqueue meets the key of a queued job in a transaction (Session and Connection, at the
    server's default isolation) that stays open, while a worker runs and archives the holder:
    on MariaDB the duplicate-key error of the insert share-locked the holder until the
    caller's commit, and the archive waited for it (lock wait timeout, the job ran again)."""
    if database.backend == "sqlite":
        pytest.skip("SQLite: an open transaction that wrote holds the database's write lock")
    caplog.set_level(logging.WARNING, logger="sqla_proletarian")
    engine = database.engine()
    holder = enqueue_committed(engine, "sync", unique_key="user-7")
    worker_engine = database.engine(connect_args=LOCK_TIMEOUT[database.backend])
    with Session(engine) as session, engine.connect() as conn:
        assert sp.enqueue(session, "sync", unique_key="user-7") == holder
        assert sp.enqueue(conn, "sync", unique_key="user-7") == holder
        assert sp.process_next_job(worker_engine, noop)
        session.commit()
        conn.commit()
    done = archived_job(engine, holder)
    assert done is not None and done.status == "success"
    assert events(caplog.records, "job-transaction-lost") == []
