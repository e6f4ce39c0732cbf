"""A fan-in's parts ending at the same moment, on every backend (the row-lock races on
PostgreSQL and MariaDB): a part's end counts itself on its own dependency row and does not
wait for another part's end to commit; parts whose ends commit together leave the join's
count to after their commits, where the worker (or, were it lost, any worker's sweep) makes
the join due; and the join runs exactly once, after the last of its parts ended, by the
handlers' own start and end times, in transaction and lease mode."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from helpers import archived, running, wait_for
from sqlalchemy.orm import Session

import sqla_proletarian as sp
from sqla_proletarian import workflows
from sqla_proletarian.models import WAITING_AT

MODES = {"transaction": {}, "lease": {"lease_seconds": 30.0}}
EACH_MODE = pytest.mark.parametrize("mode", list(MODES))
DEPENDENCY = sp.models.Dependency.__table__
JOB = sp.Job.__table__
#: Seconds a test waits for what must happen at once: generous on a loaded machine.
PATIENCE = 30.0


def fan_in(engine: sa.Engine, parts: int) -> tuple[list[uuid.UUID], uuid.UUID]:
    """``parts`` parts and a join that runs whatever their ends (cancelled parts count)."""
    sp.metadata.create_all(engine)
    with Session(engine) as session:
        ids = sp.enqueue_many(session, [("part", {})] * parts)
        join = sp.enqueue(session, "join", depends_on=ids, on_dependency_failure="run")
        session.commit()
    return ids, join


def is_waiting(engine: sa.Engine, job_id: uuid.UUID) -> bool:
    with engine.connect() as conn:
        row = conn.execute(
            sa.select(JOB.c.waiting_on, JOB.c.process_at).where(JOB.c.job_id == job_id)
        ).one()
    assert (row.waiting_on > 0) == (row.process_at == WAITING_AT), row
    return bool(row.waiting_on > 0)


def pending(engine: sa.Engine, join: uuid.UUID) -> set[uuid.UUID]:
    """The parts whose end the join has not counted yet."""
    with engine.connect() as conn:
        return set(
            conn.execute(
                sa.select(DEPENDENCY.c.depends_on).where(
                    DEPENDENCY.c.job_id == join, DEPENDENCY.c.pending == sa.true()
                )
            ).scalars()
        )


def cancel_in_thread(engine: sa.Engine, job_id: uuid.UUID) -> threading.Thread:
    """End a part (cancel it) in a transaction of its own, committed, in a thread."""

    def cancel() -> None:
        with engine.begin() as conn:
            assert sp.cancel_job(conn, job_id)

    thread = threading.Thread(target=cancel)
    thread.start()
    return thread


def skip_sqlite(database: Any) -> None:
    if database.backend == "sqlite":
        pytest.skip("SQLite has one writer: its transactions take turns on the whole file")


def test_a_parts_end_does_not_wait_for_another_parts_end_to_commit(database: Any) -> None:
    """One part's end is not committed yet; another part's end commits meanwhile (on the
    join's row lock, it would wait for the first's commit); the last part's end then makes
    the join due in its own transaction."""
    skip_sqlite(database)
    engine = database.engine()
    (first, *others), join = fan_in(engine, 3)
    # The first end share-locks the other part's row that it reads first (the next key after
    # its own, else the lowest, in the server's order of ids): that part's end waits for its
    # commit, to see it. The other part's end does not.
    with engine.connect() as conn:
        in_order = list(
            conn.execute(
                sa.select(DEPENDENCY.c.depends_on, DEPENDENCY.c.depends_on > first)
                .where(DEPENDENCY.c.job_id == join, DEPENDENCY.c.depends_on.in_(others))
                .order_by(DEPENDENCY.c.depends_on)
            )
        )
    looked_at = next((part for part, after in in_order if after), in_order[0][0])
    (other,) = {part for part, _ in in_order} - {looked_at}
    held = engine.connect()
    try:
        with held.begin():
            assert sp.cancel_job(held, first)
            ending = cancel_in_thread(engine, other)
            ending.join(PATIENCE)
            assert not ending.is_alive(), "the second end waited for the first end's commit"
    finally:
        held.close()
        ending.join(PATIENCE)
    assert is_waiting(engine, join)
    assert pending(engine, join) == {looked_at}
    with engine.begin() as conn:
        assert sp.cancel_job(conn, looked_at)
    assert not is_waiting(engine, join), "the last end makes the join due as it commits"
    assert pending(engine, join) == set()


@pytest.mark.parametrize("counted_by", ["the ending worker", "a sweep"])
def test_parts_ending_together_leave_the_join_to_a_count_after_their_commits(
    database: Any, counted_by: str
) -> None:
    """An end that finds the join's other pending part being ended by a transaction not
    committed yet does not wait for it: its own row stays pending, and its end is counted
    after its commit: by the worker that ended it (its next poll; ``process_next_job``
    after the job), or, were that lost (a worker that stopped), by any worker's sweep. The
    join runs once, after both ends."""
    skip_sqlite(database)
    engine = database.engine()
    (first, second), join = fan_in(engine, 2)
    ending = engine.connect()
    try:
        with ending.begin():
            # The second part's end in progress: its row locked, not committed.
            ending.execute(
                sa.select(DEPENDENCY.c.job_id)
                .where(DEPENDENCY.c.job_id == join, DEPENDENCY.c.depends_on == second)
                .with_for_update()
            ).one()
            thread = cancel_in_thread(engine, first)
            thread.join(PATIENCE)
            assert not thread.is_alive(), "the first end waited for the second end's commit"
            assert pending(engine, join) == {first, second}
            assert sp.cancel_job(ending, second)
    finally:
        ending.close()
        thread.join(PATIENCE)
    # The second end read the first part's row pending, committed: the first end counts.
    assert is_waiting(engine, join)
    assert pending(engine, join) == {first}
    if counted_by == "a sweep":
        workflows._take_later(engine)  # as a worker that stopped before counting it
    else:
        # Another engine on the database: the count is the database's, not the engine's.
        assert workflows.count_later(database.engine(), sp.utc_now) == 1
        assert not is_waiting(engine, join)
    ran: list[str] = []
    worker = sp.create_queue_worker(
        database.engine(),
        lambda job: ran.append(job.job_type),
        handler_mode="advanced",
        polling_interval=0.05,
    )
    with running(worker):
        assert wait_for(lambda: ran == ["join"], PATIENCE), ran
        time.sleep(0.2)  # a second run of the join, were there one, would show
    assert ran == ["join"]
    assert pending(engine, join) == set()


@EACH_MODE
def test_parts_ending_at_the_same_moment_release_their_join_once_after_the_last(
    database: Any, mode: str
) -> None:
    """Rounds of a fan-in of 6 parts whose handlers all return at the same moment (they
    wait for each other), on 3 workers of 3 threads with engines of their own: each join
    runs exactly once, and starts after the last of its parts ended."""
    if database.backend == "sqlite" and mode == "transaction":
        pytest.skip("SQLite runs one transaction-mode handler at a time: no ends coincide")
    engine = database.engine()
    sp.metadata.create_all(engine)
    parts_per_join, rounds = 6, 3
    lock = threading.Lock()
    runs: list[tuple[str, uuid.UUID, float, float]] = []
    barriers = {n: threading.Barrier(parts_per_join) for n in range(rounds)}

    def handler(job: sp.JobContext) -> None:
        start = time.monotonic()
        if job.job_type.startswith("part"):
            barriers[job.payload["round"]].wait(PATIENCE)
        with lock:
            runs.append((job.job_type, job.job_id, start, time.monotonic()))

    workers = [
        sp.create_queue_worker(
            database.engine(),
            handler,
            handler_mode="advanced",
            worker_threads=3,
            polling_interval=0.05,
            **MODES[mode],
        )
        for _ in range(3)
    ]
    joins: dict[uuid.UUID, list[uuid.UUID]] = {}
    with running(workers[0]), running(workers[1]), running(workers[2]):
        for n in range(rounds):
            with Session(engine) as session:
                parts = sp.enqueue_many(session, [("part", {"round": n})] * parts_per_join)
                join = sp.enqueue(session, "join", depends_on=parts)
                session.commit()
            joins[join] = parts
            assert wait_for(lambda join=join: any(run[1] == join for run in runs), PATIENCE), (
                f"round {n}: the join did not run"
            )
        time.sleep(0.3)  # a second run of a join, were there one, would show
    assert len(runs) == rounds * (parts_per_join + 1), "every job ran exactly once"
    by_id = {job_id: (start, end) for _, job_id, start, end in runs}
    for join, parts in joins.items():
        last_end = max(by_id[part][1] for part in parts)
        assert by_id[join][0] >= last_end, "a join started before its last part ended"
    assert {row.status for row in archived(engine)} == {"success"}
