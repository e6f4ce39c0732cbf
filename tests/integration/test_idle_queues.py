"""An idle worker of several queues costs what a worker of one queue does: after a claim that
took nothing, the next first reads the two ends of every queue's range of the poll index in
one statement (``statements.queue_ends``) and polls only the queues that may have a due job,
none when none may. So a worker of 5 queues, some empty and some holding jobs scheduled for
later, sends about one statement a polling interval, as a worker of 1 does (both modes, the
threaded and the asyncio worker, every backend); a job enqueued on the 4th queue still starts
promptly, in a queue with limits too; the first queue's jobs still go first; a paused queue's
jobs wait until it is resumed. The read itself goes through the poll index on PostgreSQL and
MariaDB, without fresh statistics, and reads a few entries beside thousands of jobs
scheduled for later."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from helpers import enqueue_committed, running, wait_for
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import Session
from test_idle import counted, elsewhere, require_listen, scaled
from test_query_plan import POLL_WORK, explain_as_sent, postgresql_plan, scans
from test_several_queues import ASYNC_DRIVER, MODE_IDS, MODES, PREFIX

import sqla_proletarian as sp
from sqla_proletarian import statements
from sqla_proletarian.running import QueueEnds
from sqla_proletarian.values import build_job_values

#: The workers' polling interval, and how long an idle worker's statements are counted.
POLL = 0.1
WINDOW = 2.0
#: Seconds a job enqueued on an idle worker's queue may take to start (a loaded CI machine).
PROMPTLY = 10.0


def queue_names(count: int) -> list[str]:
    return [f"q{n}" for n in range(count)]


def schedule_later(engine: sa.Engine, queues: list[str]) -> None:
    """A job scheduled an hour from now in every other queue (the 1st, 3rd, 5th): an idle
    worker's queues are empty or hold jobs not due yet."""
    with Session(engine) as session:
        for queue in queues[::2]:
            sp.enqueue(session, "later", None, queue=queue, process_in=timedelta(hours=1))
        session.commit()


def one_thread_worker(
    engine: sa.Engine, handler: Any, queues: list[str], mode: dict[str, Any], **options: Any
) -> sp.QueueWorker:
    """A worker of one thread serving ``queues``, polling every ``POLL`` seconds, no LISTEN."""
    return sp.create_queue_worker(
        engine,
        handler,
        queues=queues,
        worker_threads=1,
        polling_interval=POLL,
        poll_only=True,
        **options,
        **mode,
    )


def threaded_idle_statements(engine: sa.Engine, queues: list[str], mode: dict[str, Any]) -> int:
    """Statements a threaded worker of one thread serving ``queues``, idle, sends over
    ``WINDOW`` seconds, once its first polls are done."""
    worker = one_thread_worker(engine, lambda job_type, payload: None, queues, mode)
    with counted(engine) as statements, running(worker):
        assert wait_for(lambda: statements.count > 0)
        time.sleep(0.5)
        return statements.over(WINDOW)


def async_idle_statements(url: sa.URL, queues: list[str], mode: dict[str, Any]) -> int:
    """As ``threaded_idle_statements``, for the asyncio worker of one task."""

    async def handler(job_type: str, payload: Any) -> None:
        pass

    async def main() -> int:
        engine = create_async_engine(url)
        try:
            worker = sp.create_async_queue_worker(
                engine,
                handler,
                queues=queues,
                concurrency=1,
                polling_interval=POLL,
                poll_only=True,
                **mode,
            )
            with counted(engine.sync_engine) as statements:
                async with worker:
                    while statements.count == 0:
                        await asyncio.sleep(0.02)
                    await asyncio.sleep(0.5)
                    before, began = statements.count, time.monotonic()
                    await asyncio.sleep(WINDOW)
                    return scaled(statements.count - before, WINDOW, time.monotonic() - began)
        finally:
            await engine.dispose()

    return asyncio.run(main())


def async_url(database: Any) -> sa.URL:
    backend = database.backend
    return database.url.set(drivername=f"{PREFIX[backend]}+{ASYNC_DRIVER[backend]}")


@pytest.mark.parametrize("worker_kind", ["threaded", "asyncio"])
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_an_idle_worker_of_five_queues_sends_what_a_worker_of_one_queue_sends(
    database: Any, mode: dict[str, Any], worker_kind: str
) -> None:
    """Idle, with its queues empty or holding jobs scheduled for later, a worker of 5 queues
    sends about the statements a worker of 1 queue sends, about one a polling interval
    (before, each poll read each queue: 5 times the statements)."""
    engine = database.engine()
    five = queue_names(5)
    schedule_later(engine, five)

    def idle(queues: list[str]) -> int:
        if worker_kind == "asyncio":
            return async_idle_statements(async_url(database), queues, mode)
        return threaded_idle_statements(database.engine(), queues, mode)

    one = idle(five[:1])
    many = idle(five)
    assert one > 0 and many > 0, (one, many)
    assert many <= one * 1.5 + 3, (one, many)
    # One statement a polling interval, and the sweep's look now and then.
    assert many <= WINDOW / POLL + 3, many


@pytest.mark.parametrize("limited", [False, True], ids=["plain", "limited"])
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_a_job_enqueued_on_the_fourth_of_five_idle_queues_starts_promptly(
    database: Any, mode: dict[str, Any], limited: bool
) -> None:
    """An idle worker of 5 queues (empty or holding jobs scheduled for later) runs a job
    enqueued on its 4th queue within seconds, also when that queue has limits (claimed
    through them), and leaves the jobs scheduled for later alone."""
    engine = database.engine()
    queues = queue_names(5)
    schedule_later(engine, queues)
    if limited:
        with Session(engine) as session:
            sp.set_queue_limits(session, queues[3], max_running=1)
            session.commit()
    ran: list[tuple[str, str]] = []

    def handler(job: sp.JobContext) -> None:
        ran.append((job.queue, job.job_type))

    worker = one_thread_worker(engine, handler, queues, mode, handler_mode="advanced")
    with running(worker):
        time.sleep(0.5)  # idle: its claims read the queues' ends first
        enqueue_committed(database.engine(), "fourth", queue=queues[3])
        assert wait_for(lambda: bool(ran), timeout=PROMPTLY), ran
    assert ran == [(queues[3], "fourth")]


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_after_idling_the_first_queues_jobs_still_go_first(
    database: Any, mode: dict[str, Any]
) -> None:
    """Jobs committed at once to the 5th, 2nd and 1st queues of an idle worker run in the
    order of its queues (the 1st queue's first), whatever the order they were enqueued in."""
    engine = database.engine()
    queues = queue_names(5)
    schedule_later(engine, queues)
    ran: list[str] = []

    def handler(job: sp.JobContext) -> None:
        ran.append(job.job_type)

    worker = one_thread_worker(engine, handler, queues, mode, handler_mode="advanced")
    with running(worker):
        time.sleep(0.5)
        with Session(database.engine()) as session:
            for queue in (queues[4], queues[1], queues[0]):
                sp.enqueue_many(session, [(f"{queue}-{n}", None) for n in range(2)], queue=queue)
            session.commit()
        assert wait_for(lambda: len(ran) == 6, timeout=PROMPTLY), ran
    assert ran == ["q0-0", "q0-1", "q1-0", "q1-1", "q4-0", "q4-1"]


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_an_idle_worker_leaves_a_paused_queues_jobs_until_it_is_resumed(
    database: Any, mode: dict[str, Any]
) -> None:
    """A paused queue's due job is not run by an idle worker of 5 queues (its next queue's
    job is), and is run promptly once the queue is resumed."""
    engine = database.engine()
    queues = queue_names(5)
    schedule_later(engine, queues)
    with Session(engine) as session:
        sp.pause_queue(session, queues[2])
        session.commit()
    ran: list[str] = []

    def handler(job: sp.JobContext) -> None:
        ran.append(job.queue)

    worker = one_thread_worker(engine, handler, queues, mode, handler_mode="advanced")
    with running(worker):
        time.sleep(0.5)
        enqueue_committed(database.engine(), "paused", queue=queues[2])
        enqueue_committed(database.engine(), "next", queue=queues[3])
        assert wait_for(lambda: queues[3] in ran, timeout=PROMPTLY), ran
        time.sleep(10 * POLL)  # ten more polls
        assert queues[2] not in ran
        with Session(database.engine()) as session:
            sp.resume_queue(session, queues[2])
            session.commit()
        assert wait_for(lambda: queues[2] in ran, timeout=PROMPTLY), ran


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_with_listen_an_idle_worker_of_five_queues_sends_nothing_between_wake_ups(
    database: Any, backend: str, mode: dict[str, Any]
) -> None:
    """On PostgreSQL, where LISTEN/NOTIFY wakes it, an idle worker of 5 queues (some holding
    jobs scheduled for later) sends no statement for seconds on end, as a worker of one
    queue; a job committed through another engine to its 4th queue starts at once."""
    if backend != "postgresql":
        pytest.skip("LISTEN/NOTIFY is PostgreSQL's")
    engine = database.engine()
    require_listen(engine)
    queues = queue_names(5)
    schedule_later(engine, queues)
    started = threading.Event()
    worker = sp.create_queue_worker(
        engine, lambda job_type, payload: started.set(), queues=queues, worker_threads=4, **mode
    )
    with counted(engine) as statements, running(worker):
        assert statements.quiet(), "the idle worker kept polling"
        assert statements.over(WINDOW) == 0
        enqueue_committed(elsewhere(database), "work", queue=queues[3])
        assert started.wait(PROMPTLY), "the idle worker slept through a committed job"


def test_the_queue_ends_name_the_queues_that_may_have_a_due_job(engine: sa.Engine) -> None:
    """The one read of all the queues names, in claim order, the queues whose highest
    priority has a due job and those with several priorities (a lower one may have one); not
    those empty, paused, or whose only priority is due later. Its next due time is the
    earliest first entry, with the queues of several priorities left to read."""
    now = sp.utc_now()
    later = now + timedelta(hours=1)
    jobs = {
        "due": [(now - timedelta(seconds=1), 0)],
        "later": [(later, 0), (later + timedelta(hours=1), 0)],
        "priorities": [(later, 5), (now - timedelta(seconds=1), 0)],
        "paused": [(now - timedelta(seconds=1), 0)],
    }
    with Session(engine) as session:
        for queue, entries in jobs.items():
            for process_at, priority in entries:
                sp.enqueue(
                    session, "job", None, queue=queue, priority=priority, process_at=process_at
                )
        sp.pause_queue(session, "paused")
        session.commit()
    order = ("empty", "priorities", "paused", "later", "due")
    with engine.connect() as conn:
        ends = QueueEnds.read(conn, order)
        due_at = conn.scalar(sa.select(statements.JOB.c.process_at).filter_by(queue="due"))
        conn.rollback()
    now = sp.utc_now()  # an enqueue makes a time past its own now
    assert ends.to_poll(now) == ("priorities", "due")
    earliest, unseen = ends.next_due()
    assert earliest == due_at
    assert unseen == ("priorities",)
    assert ends.to_poll(later + timedelta(hours=3)) == ("priorities", "later", "due")


#: Jobs scheduled for later over the queues, in a new table never analyzed.
SCHEDULED = 8_000


def test_the_read_of_the_queues_ends_reads_the_poll_index_without_fresh_statistics(
    engine: sa.Engine, backend: str
) -> None:
    """Beside 8,000 jobs scheduled for later over 4 queues at three priorities (a new table,
    its statistics never refreshed), the read of 5 queues' ends (one empty, one paused) goes
    through the poll index with no sort on PostgreSQL and MariaDB, and reads a few entries
    on every backend, not the scheduled jobs."""
    queues = ("q0", "q1", "q2", "q3", "empty")
    now = sp.utc_now()
    rng = random.Random(3)
    rows = [
        build_job_values(
            "later",
            n,
            queue=queues[n % 4],
            process_at=now + timedelta(seconds=rng.uniform(60, 3600)),
            priority=rng.choice((0, 1, 5)),
        )
        for n in range(SCHEDULED)
    ]
    with engine.begin() as conn:
        conn.execute(sa.insert(statements.JOB), rows)
    with Session(engine) as session:
        sp.pause_queue(session, "q2")
        session.commit()
    statement = statements.queue_ends(queues)
    if backend == "postgresql":
        nodes = postgresql_plan(engine, statement)
        kinds = [node["Node Type"] for node in nodes]
        assert "Sort" not in kinds and "Incremental Sort" not in kinds, kinds
        job_scans = [index for table, index in scans(nodes) if table == statements.JOB.name]
        assert job_scans and set(job_scans) == {"ix_proletarian_job_poll"}, scans(nodes)
    elif backend == "mariadb":
        plan = explain_as_sent(engine, statement)
        job_rows = [row for row in plan if row["table"] and row["table"] == "proletarian_job"]
        assert job_rows, plan
        for row in plan:
            assert "filesort" not in (row["Extra"] or ""), plan
        for row in job_rows:
            assert row["key"] == "ix_proletarian_job_poll", plan
    measure, bound = POLL_WORK[backend]
    with engine.connect() as conn:
        ends = QueueEnds.read(conn, queues)  # the first read on a new table opens it
        conn.rollback()
        work = measure(conn, lambda c: QueueEnds.read(c, queues))
        conn.rollback()
    assert ends.to_poll(now) == ("q0", "q1", "q3")  # several priorities each, none paused
    assert 0 < work <= bound, work
