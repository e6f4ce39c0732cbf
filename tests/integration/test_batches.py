"""Batched claims (``batch_size``): one transaction claims several jobs and runs their handlers
one after another; each job keeps its own outcome, savepoint and crash accounting."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import threading
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import sqlalchemy as sa
from helpers import (
    archived,
    archived_job,
    count,
    enqueue_committed,
    events,
    jobs,
    run_records,
    running,
    wait_for,
)

import sqla_proletarian as sp

if TYPE_CHECKING:
    from conftest import Database

NOTES = sa.Table(
    "batch_note",
    sa.MetaData(),
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
    mysql_engine="InnoDB",
)


def batch_of(engine: sa.Engine) -> int:
    """How many jobs one claim takes on this backend (SQLite claims one at a time)."""
    return 1 if engine.dialect.name == "sqlite" else 5


def test_one_claim_runs_a_batch_of_jobs_in_order_and_commits_them_together(
    engine: sa.Engine,
) -> None:
    with engine.begin() as conn:
        sp.enqueue_many(conn, [("n", n) for n in range(12)])
    ran: list[int] = []
    assert sp.process_next_job(engine, lambda job_type, n: ran.append(n), batch_size=5)
    assert ran == list(range(batch_of(engine)))
    assert count(engine, sp.ArchivedJob) == len(ran)
    while sp.process_next_job(engine, lambda job_type, n: ran.append(n), batch_size=5):
        pass
    assert ran == list(range(12))
    assert {(row.status, row.attempts) for row in archived(engine)} == {("success", 1)}
    assert run_records(engine) == 0


def test_each_job_of_a_batch_keeps_its_own_outcome_and_only_a_raising_one_loses_its_writes(
    engine: sa.Engine,
) -> None:
    """Success, retry and failure in one batch; each handler writes a note through its own
    session, and only the notes of the jobs that raised roll back."""
    NOTES.create(engine)
    kinds = ["ok", "flaky", "doomed", "ok", "ok"]
    with engine.begin() as conn:
        ids = sp.enqueue_many(conn, [(kind, n) for n, kind in enumerate(kinds)])
    failed: list[str] = []

    def handler(job: sp.JobContext) -> None:
        job.session.execute(sa.insert(NOTES).values(id=job.payload * 10 + job.attempts))
        if job.job_type == "doomed" or (job.job_type == "flaky" and job.attempts == 1):
            raise RuntimeError(job.job_type)

    options: dict[str, Any] = {
        "handler_mode": "advanced",
        "batch_size": 5,
        "retry_strategy": lambda job, exc: sp.RetryStrategy(1) if job.job_type == "flaky" else None,
        "failed_job_handler": lambda job, exc: failed.append(job.job_type),
    }
    while sp.process_next_job(engine, handler, **options):
        pass
    rows = {row.job_id: row for row in archived(engine)}
    assert [(rows[i].status, rows[i].attempts) for i in ids] == [
        ("success", 1),
        ("success", 2),
        ("failure", 1),
        ("success", 1),
        ("success", 1),
    ]
    assert failed == ["doomed"]
    with engine.connect() as conn:
        notes = sorted(conn.execute(sa.select(NOTES.c.id)).scalars())
    assert notes == [1, 12, 31, 41], "the raising runs' writes rolled back, the others stayed"
    assert run_records(engine) == 0


def test_stop_between_jobs_of_a_batch_commits_the_finished_ones_and_releases_the_rest(
    engine: sa.Engine, backend: str
) -> None:
    """stop() is called while the batch's second handler runs (here by the handler itself):
    the two finished jobs commit, the three not started are released untouched."""
    if backend == "sqlite":
        pytest.skip("SQLite claims one job at a time")
    with engine.begin() as conn:
        sp.enqueue_many(conn, [("n", n) for n in range(5)])
    ran: list[int] = []
    workers: list[sp.QueueWorker] = []

    def handler(job_type: str, n: int) -> None:
        ran.append(n)
        if n == 1:
            workers[0].stop()

    worker = sp.create_queue_worker(engine, handler, batch_size=5, polling_interval=0.02)
    workers.append(worker)
    worker.start()
    assert worker.wait(15)
    assert ran == [0, 1], "no handler starts after stop()"
    assert wait_for(lambda: count(engine, sp.ArchivedJob) == 2)
    assert sorted(job.attempts for job in jobs(engine)) == [0, 0, 0]
    assert run_records(engine) == 0


CRASHING_BATCH = textwrap.dedent(
    """
    import os, sys
    import sqlalchemy as sa
    import sqla_proletarian as sp

    def handler(job_type, n):
        print(n, flush=True)
        if job_type == "crash":
            os._exit(9)  # the worker dies in the middle of its claim

    engine = sa.create_engine(sys.argv[1])
    sp.process_next_job(engine, handler, batch_size=5, max_unclean_ends=1, reconnect_grace=0)
    """
)


def test_a_crash_in_a_batch_is_charged_to_no_batch_mate_and_its_job_then_runs_alone(
    database: Database, engine: sa.Engine, backend: str
) -> None:
    """Jobs 0 and 1 finished, 2 crashed the process, 3 and 4 had not started: nothing is
    charged, since which handler was running is not known; each of the five then runs alone,
    where job 2's next crash is charged (max_unclean_ends=1: archived as crashed) and the
    others succeed at their first counted attempt."""
    if backend == "sqlite":
        pytest.skip("SQLite claims one job at a time")
    with engine.begin() as conn:
        ids = sp.enqueue_many(conn, [("ok", 0), ("ok", 1), ("crash", 2), ("ok", 3), ("ok", 4)])
    url = database.url.render_as_string(hide_password=False)
    rounds: list[tuple[int, list[int]]] = []
    while count(engine, sp.Job) and len(rounds) < 10:
        result = subprocess.run(
            [sys.executable, "-c", CRASHING_BATCH, url], capture_output=True, text=True, timeout=60
        )
        rounds.append((result.returncode, [int(n) for n in result.stdout.split()]))
    assert rounds == [
        (9, [0, 1, 2]),  # the batch dies with its worker
        (0, [0]),  # then each job alone, in order
        (0, [1]),
        (9, [2]),  # a crash alone: charged
        (0, []),  # archived as crashed without running
        (0, [3]),
        (0, [4]),
    ]
    rows = {row.job_id: row for row in archived(engine)}
    assert rows[ids[2]].status == "failure" and "JobCrashedError" in (rows[ids[2]].error or "")
    assert [(rows[i].status, rows[i].attempts) for i in ids if i != ids[2]] == [("success", 1)] * 4
    assert run_records(engine) == 0


def test_batch_size_is_checked(engine: sa.Engine) -> None:
    for bad in (0, -1, 1001, 2.5, True):
        with pytest.raises(sp.ConfigurationError, match="batch_size"):
            sp.create_queue_worker(engine, lambda t, p: None, batch_size=bad)


def test_a_job_already_archived_in_a_batch_is_replaced_and_the_batch_goes_on(
    engine: sa.Engine, tmp_path: Path
) -> None:
    job_id = enqueue_committed(engine, "again", 1)
    assert sp.process_next_job(engine, lambda t, p: None)
    enqueue_committed(engine, "again", 2, job_id=job_id)
    enqueue_committed(engine, "other", 3)
    assert sp.process_next_job(engine, lambda t, p: None, batch_size=5)
    while sp.process_next_job(engine, lambda t, p: None, batch_size=5):
        pass
    row = archived_job(engine, job_id)
    assert row is not None and row.payload == "2"
    assert count(engine, sp.ArchivedJob) == 2


#: A trigger that makes the archive row of a "poison" job too long for its status column:
#: the server refuses the batch's archive insert (a DataError), as a real constraint would.
REFUSE_POISON = {
    "postgresql": (
        "CREATE FUNCTION refuse_poison() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        "IF NEW.job_type = 'poison' THEN NEW.status := repeat('x', 20); END IF; "
        "RETURN NEW; END $$",
        "CREATE TRIGGER refuse_poison BEFORE INSERT ON proletarian_archived_job "
        "FOR EACH ROW EXECUTE FUNCTION refuse_poison()",
    ),
    "mariadb": (
        "CREATE TRIGGER refuse_poison BEFORE INSERT ON proletarian_archived_job "
        "FOR EACH ROW BEGIN IF NEW.job_type = 'poison' THEN "
        "SET NEW.status = REPEAT('x', 20); END IF; END",
    ),
}
ALLOW_POISON = {
    "postgresql": ("DROP TRIGGER refuse_poison ON proletarian_archived_job",),
    "mariadb": ("DROP TRIGGER refuse_poison",),
}


def test_a_batch_whose_outcomes_cannot_be_written_ends_without_any_and_runs_again(
    engine: sa.Engine, backend: str
) -> None:
    """Three jobs succeed, but the server refuses the archive row of the second: the claim
    ends with no outcome at all (none archived as failed, every job still queued with no
    attempt counted, no run record left) and the error reaches the caller; once the server
    takes the rows, each job runs again and is archived once, as a success."""
    if backend == "sqlite":
        pytest.skip("SQLite claims one job at a time")
    with engine.begin() as conn:
        ids = sp.enqueue_many(conn, [("ok", 0), ("poison", 1), ("ok", 2)])
        for statement in REFUSE_POISON[backend]:
            conn.exec_driver_sql(statement)
    ran: list[int] = []

    def handler(job_type: str, n: int) -> None:
        ran.append(n)

    with pytest.raises(sa.exc.DataError):
        sp.process_next_job(engine, handler, batch_size=5)
    assert ran == [0, 1, 2]
    assert archived(engine) == []
    assert sorted((job.job_id, job.attempts) for job in jobs(engine)) == sorted(
        (job_id, 0) for job_id in ids
    )
    assert run_records(engine) == 0

    with engine.begin() as conn:
        for statement in ALLOW_POISON[backend]:
            conn.exec_driver_sql(statement)
    assert sp.process_next_job(engine, handler, batch_size=5)
    assert ran == [0, 1, 2, 0, 1, 2]
    rows = {row.job_id: row for row in archived(engine)}
    assert [(rows[i].status, rows[i].attempts) for i in ids] == [("success", 1)] * 3
    assert jobs(engine) == []
    assert run_records(engine) == 0


#: A trigger that makes the retry of a "poison" job too long for its job_type column.
REFUSE_RETRY = {
    "postgresql": (
        "CREATE FUNCTION refuse_retry() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        "IF NEW.job_type = 'poison' THEN NEW.job_type := repeat('x', 300); END IF; "
        "RETURN NEW; END $$",
        "CREATE TRIGGER refuse_retry BEFORE UPDATE ON proletarian_job "
        "FOR EACH ROW EXECUTE FUNCTION refuse_retry()",
    ),
    "mariadb": (
        "CREATE TRIGGER refuse_retry BEFORE UPDATE ON proletarian_job "
        "FOR EACH ROW BEGIN IF NEW.job_type = 'poison' THEN "
        "SET NEW.job_type = REPEAT('x', 300); END IF; END",
    ),
}


def test_a_job_whose_retry_cannot_be_written_fails_alone_and_its_batch_mates_run_again(
    engine: sa.Engine, backend: str
) -> None:
    """The second job of a batch raises and its retry is refused by the server: it is
    archived as failed on its own, the others' outcomes roll back with the claim, no run
    record of theirs is left behind, and they then run again and succeed once."""
    if backend == "sqlite":
        pytest.skip("SQLite claims one job at a time")
    with engine.begin() as conn:
        ids = sp.enqueue_many(conn, [("ok", 0), ("poison", 1), ("ok", 2)])
        for statement in REFUSE_RETRY[backend]:
            conn.exec_driver_sql(statement)
    ran: list[int] = []

    def handler(job_type: str, n: int) -> None:
        ran.append(n)
        if job_type == "poison":
            raise RuntimeError("poison")

    options: dict[str, Any] = {"batch_size": 5, "retry_strategy": lambda j, e: sp.RetryStrategy(1)}
    assert sp.process_next_job(engine, handler, **options)
    assert ran == [0, 1]
    [poisoned] = archived(engine)
    assert (poisoned.job_id, poisoned.status) == (ids[1], "failure")
    assert "could not be recorded" in (poisoned.error or "")
    assert run_records(engine) == 0
    assert sp.process_next_job(engine, handler, **options)
    assert ran == [0, 1, 0, 2]
    rows = {row.job_id: row for row in archived(engine)}
    assert [(rows[i].status, rows[i].attempts) for i in (ids[0], ids[2])] == [("success", 1)] * 2
    assert run_records(engine) == 0


def test_a_fault_free_batched_drain_by_four_threads_runs_every_handler_exactly_once(
    engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """Batches of four threads never deadlock each other: on MariaDB a multi-row delete that
    scanned the small job or run-record table locked rows other batches had claimed, and the
    victim batch ran again whole. (SQLite claims one job at a time: fewer jobs.)"""
    caplog.set_level(logging.DEBUG, logger="sqla_proletarian")
    total = 100 if engine.dialect.name == "sqlite" else 1000
    with engine.begin() as conn:
        sp.enqueue_many(conn, [("n", n) for n in range(total)])
    runs: Counter[int] = Counter()
    lock = threading.Lock()

    def handler(job_type: str, n: int) -> None:
        with lock:
            runs[n] += 1

    worker = sp.create_queue_worker(
        engine, handler, worker_threads=4, batch_size=20, polling_interval=0.01
    )
    with running(worker):
        assert wait_for(lambda: worker.summary()["succeeded"] >= total, timeout=60)
    assert sorted(runs) == list(range(total))
    assert {n: times for n, times in runs.items() if times != 1} == {}
    for name in ("job-transaction-lost", "run-record-cleanup-error"):
        assert events(caplog.records, name) == []
    assert count(engine, sp.ArchivedJob) == total
    assert run_records(engine) == 0
