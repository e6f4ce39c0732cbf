"""Jobs that run after other jobs (``depends_on``), on every backend and in both modes: a
graph enqueued in one transaction commits or rolls back whole; a dependent starts only after
its dependencies' success has committed (seen from the handler's own connection); a join
over several workers runs once, after the last of its dependencies; a failed or cancelled
dependency cancels its dependents down the graph, or lets an ``"run"`` dependent run;
unknown ids are refused with nothing written; and a dependent enqueued while its dependency
was ending still runs once (the workers' sweep)."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from helpers import archived, archived_job, count, enqueue_committed, jobs, running, wait_for
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import Session

import sqla_proletarian as sp
from sqla_proletarian.models import WAITING_AT

#: The worker options of each mode: the job's transaction, or a lease.
MODES = {"transaction": {}, "lease": {"lease_seconds": 30.0}}
EACH_MODE = pytest.mark.parametrize("mode", list(MODES))
ASYNC_DRIVERNAME = {
    "sqlite": "sqlite+aiosqlite",
    "postgresql": "postgresql+psycopg",
    "mariadb": "mysql+aiomysql",
}
NO_RETRY: dict[str, Any] = {"retry_strategy": lambda job, exc: None}
DEPENDENCY = sp.models.Dependency.__table__
JOB = sp.Job.__table__


def run_all(engine: sa.Engine, handler: Callable[..., Any], mode: str, **options: Any) -> int:
    """Run due jobs one at a time until none is due; how many ran."""
    ran = 0
    while sp.process_next_job(engine, handler, **MODES[mode], **NO_RETRY, **options):
        ran += 1
    return ran


def status_of(engine: sa.Engine, job_id: uuid.UUID) -> str | None:
    row = archived_job(engine, job_id)
    return None if row is None else row.status


def waiting_on(engine: sa.Engine, job_id: uuid.UUID) -> int | None:
    with engine.connect() as conn:
        row = conn.execute(
            sa.select(JOB.c.waiting_on, JOB.c.process_at).where(JOB.c.job_id == job_id)
        ).first()
    if row is None:
        return None
    if row.waiting_on > 0:
        assert row.process_at == WAITING_AT, "a waiting job is out of every poll's reach"
    return int(row.waiting_on)


class Log:
    """What handlers saw: each run's job type, its own start and end times, and whether its
    dependencies were archived as succeeded (read on a connection of its own) at its start."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.lock = threading.Lock()
        self.runs: list[tuple[str, float, float]] = []
        self.saw_unfinished: list[str] = []

    def handler(self, job: sp.JobContext) -> None:
        start = time.monotonic()
        needs = (job.payload or {}).get("after", [])
        with self.engine.connect() as conn:
            done = {
                row.job_id
                for row in conn.execute(
                    sa.select(sp.ArchivedJob.job_id).where(sp.ArchivedJob.status == "success")
                )
            }
        missing = [need for need in needs if uuid.UUID(need) not in done]
        if missing:
            with self.lock:
                self.saw_unfinished.append(f"{job.job_type} started before {missing}")
        time.sleep((job.payload or {}).get("seconds", 0))
        with self.lock:
            self.runs.append((job.job_type, start, time.monotonic()))

    def of(self, job_type: str) -> list[tuple[str, float, float]]:
        return [run for run in self.runs if run[0] == job_type]


# --- one transaction -----------------------------------------------------------------------


@pytest.mark.parametrize("through", ["session", "connection"])
def test_a_graph_rolled_back_leaves_nothing_and_committed_runs_whole(
    engine: sa.Engine, through: str
) -> None:
    """A chain and a join built in one unit of work: rolled back, no job, edge or archive row
    is left; committed, only the roots are due and the rest wait, counted."""

    def build(tx: Session | sa.Connection) -> dict[str, uuid.UUID]:
        a = sp.enqueue(tx, "a")
        b = sp.enqueue(tx, "b", depends_on=[a])
        c = sp.enqueue(tx, "c")
        join = sp.enqueue(tx, "join", depends_on=[b, c])
        return {"a": a, "b": b, "c": c, "join": join}

    for commit in (False, True):
        if through == "session":
            with Session(engine) as session:
                ids = build(session)
                session.commit() if commit else session.rollback()
        else:
            with engine.connect() as conn:
                ids = build(conn)
                conn.commit() if commit else conn.rollback()
        if not commit:
            assert (count(engine, JOB), count(engine, DEPENDENCY)) == (0, 0)
            assert archived(engine) == []
    assert {name: waiting_on(engine, job_id) for name, job_id in ids.items()} == {
        "a": 0,
        "b": 1,
        "c": 0,
        "join": 2,
    }
    assert count(engine, DEPENDENCY) == 3


def test_a_job_added_to_the_session_can_be_depended_on_before_the_flush(engine: sa.Engine) -> None:
    """``session.add(Job(...))`` then ``enqueue(session, depends_on=[its id])``: the Session
    is flushed first, so the dependency is found."""
    with Session(engine) as session:
        first = sp.Job(job_type="first")
        session.add(first)
        second = sp.enqueue(session, "second", depends_on=[first.job_id])
        session.commit()
    assert waiting_on(engine, second) == 1


# --- order ----------------------------------------------------------------------------------


@EACH_MODE
def test_a_chain_runs_in_order_each_after_its_dependencys_commit(
    engine: sa.Engine, mode: str
) -> None:
    """a -> b -> c with a worker of 3 threads: each starts after the one before it ended,
    and sees it archived as succeeded on a connection of its own (its commit came first)."""
    log = Log(engine)
    with Session(engine) as session:
        a = sp.enqueue(session, "a", {"seconds": 0.2})
        b = sp.enqueue(session, "b", {"after": [str(a)], "seconds": 0.1}, depends_on=[a])
        c = sp.enqueue(session, "c", {"after": [str(b)]}, depends_on=[b])
        unrelated = sp.enqueue(session, "unrelated")
        session.commit()
    worker = sp.create_queue_worker(
        engine,
        log.handler,
        handler_mode="advanced",
        worker_threads=3,
        polling_interval=0.05,
        **MODES[mode],
    )
    with running(worker):
        assert wait_for(lambda: len(archived(engine)) == 4, 30)
    assert log.saw_unfinished == []
    ((_, _, a_end),) = log.of("a")
    ((_, b_start, b_end),) = log.of("b")
    ((_, c_start, _),) = log.of("c")
    assert a_end <= b_start and b_end <= c_start
    assert len(log.of("unrelated")) == 1
    assert {status_of(engine, job_id) for job_id in (a, b, c, unrelated)} == {"success"}
    assert jobs(engine) == []


@EACH_MODE
def test_joins_over_three_workers_run_once_after_the_last_dependency(
    database: Any, engine: sa.Engine, mode: str
) -> None:
    """Four fan-outs of 6 parts each, every part ending at about the same moment on one of
    three workers: each join runs exactly once, after all 6 of its parts ended."""
    log = Log(engine)
    joins: dict[uuid.UUID, list[str]] = {}
    with Session(engine) as session:
        for group in range(4):
            parts = sp.enqueue_many(session, [(f"part-{group}", {"seconds": 0.15})] * 6)
            after = [str(part) for part in parts]
            join = sp.enqueue(session, f"join-{group}", {"after": after}, depends_on=parts)
            joins[join] = after
        session.commit()
    # A worker each with an engine of its own (its threads' connections, the handlers' reads).
    workers = [
        sp.create_queue_worker(
            database.engine(),
            log.handler,
            handler_mode="advanced",
            worker_threads=3,
            polling_interval=0.05,
            **MODES[mode],
        )
        for _ in range(3)
    ]
    with running(workers[0]), running(workers[1]), running(workers[2]):
        assert wait_for(lambda: len(archived(engine)) == 28, 60), f"{len(archived(engine))} of 28"
    assert log.saw_unfinished == []
    for group in range(4):
        parts = log.of(f"part-{group}")
        (join,) = log.of(f"join-{group}")
        assert len(parts) == 6
        assert join[1] >= max(end for _, _, end in parts)
    assert {row.status for row in archived(engine)} == {"success"}


# --- failure, cancel, "run" -----------------------------------------------------------------


@EACH_MODE
def test_a_failed_dependency_cancels_its_dependents_down_the_graph_and_run_runs(
    engine: sa.Engine, mode: str
) -> None:
    """bad fails: d (on bad and ok) is cancelled naming bad, e (on d) is cancelled naming d,
    and cleanup (``"run"``) runs; ok runs."""
    ran: list[str] = []

    def handler(job: sp.JobContext) -> None:
        ran.append(job.job_type)
        if job.job_type == "bad":
            raise ValueError("broken")

    with Session(engine) as session:
        bad = sp.enqueue(session, "bad")
        ok = sp.enqueue(session, "ok")
        d = sp.enqueue(session, "d", depends_on=[ok, bad])
        e = sp.enqueue(session, "e", depends_on=[d])
        cleanup = sp.enqueue(session, "cleanup", depends_on=[bad], on_dependency_failure="run")
        session.commit()
    run_all(engine, handler, mode, handler_mode="advanced")
    assert sorted(ran) == ["bad", "cleanup", "ok"]
    d_row, e_row = archived_job(engine, d), archived_job(engine, e)
    assert d_row is not None and e_row is not None
    assert (d_row.status, d_row.error) == ("cancelled", f"cancelled: its dependency {bad} failed")
    assert (e_row.status, e_row.error) == (
        "cancelled",
        f"cancelled: its dependency {d} was cancelled",
    )
    assert (status_of(engine, cleanup), status_of(engine, bad)) == ("success", "failure")
    assert jobs(engine) == []


def test_cancelling_a_job_cancels_its_dependents_and_cancelling_a_waiting_one_too(
    engine: sa.Engine,
) -> None:
    """cancel_job(a) cancels b (on a) and c (on b) in the caller's transaction; cancelling a
    waiting job (y, on x) cancels its dependent z but not x."""
    with Session(engine) as session:
        a = sp.enqueue(session, "a")
        b = sp.enqueue(session, "b", depends_on=[a])
        c = sp.enqueue(session, "c", depends_on=[b])
        x = sp.enqueue(session, "x")
        y = sp.enqueue(session, "y", depends_on=[x])
        z = sp.enqueue(session, "z", depends_on=[y])
        session.commit()
    with Session(engine) as session:
        assert sp.cancel_job(session, a)
        assert sp.cancel_job(session, y)
        session.commit()
    assert [status_of(engine, job_id) for job_id in (a, b, c, y, z)] == ["cancelled"] * 5
    assert [job.job_id for job in jobs(engine)] == [x]
    assert waiting_on(engine, x) == 0


@EACH_MODE
def test_dependencies_already_archived_count_at_the_enqueue(engine: sa.Engine, mode: str) -> None:
    """A dependency that succeeded earlier is no wait; one that failed cancels the new job at
    once (archived as cancelled, naming it), or, with ``"run"``, leaves it due."""
    good = enqueue_committed(engine, "good")
    bad = enqueue_committed(engine, "bad")

    def handler(job: sp.JobContext) -> None:
        if job.job_type == "bad":
            raise ValueError("broken")

    run_all(engine, handler, mode, handler_mode="advanced")
    with Session(engine) as session:
        after_good = sp.enqueue(session, "after-good", depends_on=[good])
        after_bad = sp.enqueue(session, "after-bad", depends_on=[good, bad])
        cleanup = sp.enqueue(session, "cleanup", depends_on=[bad], on_dependency_failure="run")
        session.commit()
    # Not waiting (-1: dependencies, all ended; 0 is a job without any).
    assert (waiting_on(engine, after_good), waiting_on(engine, cleanup)) == (-1, -1)
    row = archived_job(engine, after_bad)
    assert row is not None
    assert (row.status, row.error, row.attempts) == (
        "cancelled",
        f"cancelled: its dependency {bad} failed",
        0,
    )
    assert run_all(engine, handler, mode, handler_mode="advanced") == 2


# --- bad input --------------------------------------------------------------------------------


def test_an_unknown_or_bad_dependency_is_refused_and_nothing_is_written(
    engine: sa.Engine,
) -> None:
    known = enqueue_committed(engine, "known")
    unknown = uuid.uuid4()
    with Session(engine) as session:
        with pytest.raises(sp.InvalidJobError, match=f"depends_on: no job {unknown}"):
            sp.enqueue(session, "x", depends_on=[known, unknown])
        with pytest.raises(sp.InvalidJobError, match=f"no job {unknown}"):
            sp.enqueue_many(session, [("x", 1), ("y", 2)], depends_on=[unknown])
        with pytest.raises(sp.InvalidJobError, match="cannot depend on itself"):
            own = uuid.uuid4()
            sp.enqueue(session, "x", job_id=own, depends_on=[own])
        with pytest.raises(sp.InvalidJobError, match="item 1, 'nope', is not a job id"):
            sp.enqueue(session, "x", depends_on=[known, "nope"])
        with pytest.raises(sp.InvalidJobError, match="give a list of job ids"):
            sp.enqueue(session, "x", depends_on=known)  # type: ignore[arg-type]
        with pytest.raises(sp.InvalidJobError, match="on_dependency_failure: 'skip'"):
            sp.enqueue(session, "x", depends_on=[known], on_dependency_failure="skip")  # type: ignore[arg-type]
        session.commit()
    assert [job.job_id for job in jobs(engine)] == [known]
    assert count(engine, DEPENDENCY) == 0


# --- every enqueue path ---------------------------------------------------------------------


def test_enqueue_many_and_unique_keys_and_tasks_take_dependencies(engine: sa.Engine) -> None:
    """enqueue_many's jobs each wait for every dependency; a unique key already held gives
    the holder's id and adds no edge; a task's with_options(depends_on=...) waits too."""
    handlers = sp.JobHandlers()

    @handlers.task
    def step(n: int) -> int:
        return n

    with Session(engine) as session:
        a, b = sp.enqueue_many(session, [("a", 1), ("b", 2)])
        many = sp.enqueue_many(session, [("m", 1), ("m", 2), ("m", 3)], depends_on=[a, b])
        keyed = sp.enqueue(session, "k", unique_key="once", depends_on=[a])
        again = sp.enqueue(session, "k", unique_key="once", depends_on=[b])
        task_job = step.with_options(depends_on=[a]).enqueue(session, 5)
        session.commit()
    assert [waiting_on(engine, job_id) for job_id in many] == [2, 2, 2]
    assert again == keyed and waiting_on(engine, keyed) == 1
    assert waiting_on(engine, task_job) == 1
    assert count(engine, DEPENDENCY) == 6 + 1 + 1


def test_enqueue_async_takes_dependencies(database: Any) -> None:
    """enqueue_async and enqueue_many_async with an AsyncSession; the sync enqueue refuses
    an AsyncSession with depends_on (it must insert at once)."""
    from sqlalchemy.ext.asyncio import AsyncSession

    url = database.url.set(drivername=ASYNC_DRIVERNAME[database.backend])
    sync_engine = database.engine()
    sp.metadata.create_all(sync_engine)

    async def go() -> tuple[uuid.UUID, list[uuid.UUID]]:
        engine = create_async_engine(url)
        try:
            async with AsyncSession(engine) as session:
                first = await sp.enqueue_async(session, "first")
                with pytest.raises(sp.NotATransactionError, match="enqueue_async"):
                    sp.enqueue(session, "x", depends_on=[first])
                then = await sp.enqueue_async(session, "then", depends_on=[first])
                many = await sp.enqueue_many_async(session, [("m", 1)], depends_on=[then])
                await session.commit()
                return then, many
        finally:
            await engine.dispose()

    then, many = asyncio.run(go())
    assert (waiting_on(sync_engine, then), waiting_on(sync_engine, many[0])) == (1, 1)


# --- races ----------------------------------------------------------------------------------


@EACH_MODE
def test_a_dependent_enqueued_while_its_dependency_ends_still_runs_once(
    database: Any, mode: str
) -> None:
    """The enqueue reads the dependency as queued; its end commits before the enqueue does
    (its settle cannot see the new rows, or waits for them): the dependent runs once all the
    same, from a running worker (the end's settle, or the worker's sweep)."""
    if database.backend == "sqlite":
        pytest.skip("SQLite: the enqueue's transaction holds the write lock the end needs")
    engine = database.engine()
    sp.metadata.create_all(engine)
    first = enqueue_committed(engine, "first")
    ran: list[str] = []
    conn = engine.connect()
    try:
        dependent = sp.enqueue(conn, "dependent", depends_on=[first])
        ending = threading.Thread(
            target=lambda: sp.process_next_job(
                engine,
                lambda job: ran.append(job.job_type),
                handler_mode="advanced",
                **MODES[mode],
            )
        )
        ending.start()
        assert wait_for(lambda: ran == ["first"], 30)
        time.sleep(0.3)  # the end commits now, or waits for this transaction (MariaDB)
        conn.commit()
    finally:
        conn.close()
    ending.join(30)
    assert status_of(engine, first) == "success"
    worker = sp.create_queue_worker(
        engine,
        lambda job: ran.append(job.job_type),
        handler_mode="advanced",
        polling_interval=0.05,
        **MODES[mode],
    )
    with running(worker):
        assert wait_for(lambda: status_of(engine, dependent) == "success", 30)
    assert ran == ["first", "dependent"]


# --- the asyncio worker, other isolation levels ------------------------------------------------


@EACH_MODE
def test_the_asyncio_worker_runs_a_fan_out_and_its_join_in_order(database: Any, mode: str) -> None:
    """Three parts and a join, drained by the asyncio worker: the join starts last, once."""
    engine = database.engine()
    sp.metadata.create_all(engine)
    with Session(engine) as session:
        parts = sp.enqueue_many(session, [("part", 1), ("part", 2), ("part", 3)])
        join = sp.enqueue(session, "join", depends_on=parts)
        session.commit()
    seen: list[tuple[str, float]] = []

    async def handler(job: sp.AsyncJobContext) -> None:
        seen.append((job.job_type, time.monotonic()))
        await asyncio.sleep(0.05)
        seen.append((f"{job.job_type}-end", time.monotonic()))

    async def main() -> None:
        url = database.url.set(drivername=ASYNC_DRIVERNAME[database.backend])
        async_engine = create_async_engine(url)
        try:
            worker = sp.create_async_queue_worker(
                async_engine,
                handler,
                handler_mode="advanced",
                polling_interval=0.05,
                concurrency=3,
                **MODES[mode],
            )
            async with worker:
                deadline = time.monotonic() + 30
                while status_of(engine, join) != "success" and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
        finally:
            await async_engine.dispose()

    asyncio.run(main())
    assert status_of(engine, join) == "success"
    kinds = [kind for kind, _ in seen]
    assert kinds.count("join") == 1 and kinds.count("part") == 3
    join_start = next(at for kind, at in seen if kind == "join")
    assert join_start >= max(at for kind, at in seen if kind == "part-end")


@pytest.mark.parametrize("level", ["REPEATABLE READ", "SERIALIZABLE"])
def test_an_enqueue_at_a_snapshot_isolation_level_waits_and_runs(database: Any, level: str) -> None:
    """The caller's engine at REPEATABLE READ or SERIALIZABLE: the dependent is enqueued, waits,
    and runs after its dependency."""
    if database.backend == "sqlite":
        pytest.skip("SQLite has no isolation levels to set")
    engine = database.engine(isolation_level=level)
    sp.metadata.create_all(engine)
    with Session(engine) as session:
        first = sp.enqueue(session, "first")
        then = sp.enqueue(session, "then", depends_on=[first])
        session.commit()
    with Session(engine) as session:
        later = sp.enqueue(session, "later", depends_on=[first, then])
        session.commit()
    ran: list[str] = []
    run_all(engine, lambda job: ran.append(job.job_type), "transaction", handler_mode="advanced")
    assert ran == ["first", "then", "later"]
    assert status_of(engine, later) == "success"


def test_retry_failed_runs_the_dependency_again_and_leaves_its_cancelled_dependents(
    engine: sa.Engine,
) -> None:
    """A failed dependency put back by retry_failed runs and succeeds; the dependent its
    failure cancelled stays cancelled, and runs only when enqueued again after it."""
    attempts: list[str] = []

    def handler(job: sp.JobContext) -> None:
        attempts.append(job.job_type)
        if job.job_type == "flaky" and attempts.count("flaky") == 1:
            raise ValueError("first time")

    flaky = enqueue_committed(engine, "flaky")
    with Session(engine) as session:
        after = sp.enqueue(session, "after", depends_on=[flaky])
        session.commit()
    run_all(engine, handler, "transaction", handler_mode="advanced")
    assert (status_of(engine, flaky), status_of(engine, after)) == ("failure", "cancelled")
    with Session(engine) as session:
        assert sp.retry_failed(session, job_ids=[flaky]) == 1
        again = sp.enqueue(session, "after", depends_on=[flaky])
        session.commit()
    assert waiting_on(engine, again) == 1
    run_all(engine, handler, "transaction", handler_mode="advanced")
    assert attempts == ["flaky", "flaky", "after"]
    assert (status_of(engine, flaky), status_of(engine, after)) == ("success", "cancelled")
    assert status_of(engine, again) == "success"


@EACH_MODE
def test_a_dependent_put_back_by_retry_failed_still_reads_its_dependencies_results(
    engine: sa.Engine, mode: str
) -> None:
    """A join that failed once, put back by retry_failed, sees its dependencies' results on
    its second run (the claim knows it has dependencies)."""
    seen: list[dict[uuid.UUID, Any]] = []

    def handler(job: sp.JobContext) -> Any:
        if job.job_type == "part":
            return job.payload * 10
        seen.append(job.dependency_results)
        if len(seen) == 1:
            raise ValueError("first run fails")
        return None

    with Session(engine) as session:
        parts = sp.enqueue_many(session, [("part", 1), ("part", 2)])
        join = sp.enqueue(session, "join", depends_on=parts)
        session.commit()
    run_all(engine, handler, mode, handler_mode="advanced")
    assert status_of(engine, join) == "failure"
    with Session(engine) as session:
        assert sp.retry_failed(session, job_ids=[join]) == 1
        session.commit()
    run_all(engine, handler, mode, handler_mode="advanced")
    expected = {parts[0]: 10, parts[1]: 20}
    assert seen == [expected, expected]
    assert status_of(engine, join) == "success"
