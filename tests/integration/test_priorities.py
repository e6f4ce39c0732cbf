"""Priorities: higher runs first, then earlier due time, then enqueue order; batches too; the
archive keeps the priority; out-of-range priorities are refused before anything is written."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from helpers import FakeClock, archived_job, enqueue_committed, jobs, running
from sqlalchemy.orm import Session

import sqla_proletarian as sp


def run_all(engine: sa.Engine, clock: FakeClock) -> list[str]:
    """Run every due job, one at a time; the job types in the order they ran."""
    ran: list[str] = []
    while sp.process_next_job(engine, lambda job_type, payload: ran.append(job_type), clock=clock):
        pass
    return ran


def test_higher_priority_runs_first_then_earlier_due_time_then_enqueue_order(
    engine: sa.Engine,
) -> None:
    clock = FakeClock()
    now = clock.now
    for job_type, priority, due_ago in [
        ("a", 0, 3),
        ("b", 5, 1),
        ("c", 5, 2),
        ("d", -1, 5),
        ("e", 5, 1),  # due with b, enqueued after it
        ("f", sp.MAX_PRIORITY, 0),
        ("g", sp.MIN_PRIORITY, 9),
    ]:
        enqueue_committed(
            engine,
            job_type,
            priority=priority,
            process_at=now - timedelta(seconds=due_ago),
            clock=lambda: now - timedelta(seconds=10),
        )
    assert run_all(engine, clock) == ["f", "c", "b", "e", "a", "d", "g"]


def test_a_higher_priority_job_not_yet_due_does_not_hold_up_due_ones(engine: sa.Engine) -> None:
    clock = FakeClock()
    enqueue_committed(engine, "later", priority=100, process_in=60, clock=clock)
    enqueue_committed(engine, "now", clock=clock)
    assert run_all(engine, clock) == ["now"]
    clock.advance(60)
    assert run_all(engine, clock) == ["later"]


def test_every_enqueue_path_keeps_the_priority_and_the_archive_keeps_it_too(
    engine: sa.Engine,
) -> None:
    """Session, ``session.add(Job(...))``, Connection and enqueue_many; success and failure."""
    with Session(engine) as session:
        by_session = sp.enqueue(session, "ok", priority=7)
        added = sp.Job(job_type="fail", priority=-3)
        session.add(added)
        session.commit()
        added_id = added.job_id
    with engine.begin() as conn:
        by_conn = sp.enqueue(conn, "ok", priority=2)
        many = sp.enqueue_many(conn, [("ok", 1), ("ok", 2)], priority=-9)
    assert sorted(job.priority for job in jobs(engine)) == [-9, -9, -3, 2, 7]

    def handler(job_type: str, payload: Any) -> None:
        if job_type == "fail":
            raise ValueError("no")

    while sp.process_next_job(engine, handler):
        pass
    expected = {by_session: 7, added_id: -3, by_conn: 2, many[0]: -9, many[1]: -9}
    for job_id, priority in expected.items():
        archived = archived_job(engine, job_id)
        assert archived is not None and archived.priority == priority
    failed = archived_job(engine, added_id)
    assert failed is not None and failed.status == "failure"


@pytest.mark.parametrize("batch_size", [1, 4])
def test_a_worker_never_runs_a_lower_priority_job_while_a_higher_one_is_due(
    engine: sa.Engine, batch_size: int
) -> None:
    """With the worker stopped, 12 jobs of mixed priorities are queued; started, it runs them
    in priority order, also claiming 4 at a time (SQLite claims one at a time anyway)."""
    priorities = [3, -1, 0, 9, 3, 0, -5, 9, 1, 0, 2, -1]
    with engine.begin() as conn:
        for index, priority in enumerate(priorities):
            sp.enqueue(conn, "job", {"index": index}, priority=priority)
    ran: list[int] = []
    done = threading.Event()

    def handler(job_type: str, payload: Any) -> None:
        ran.append(priorities[payload["index"]])
        if len(ran) == len(priorities):
            done.set()

    worker = sp.create_queue_worker(
        engine, handler, batch_size=batch_size, polling_interval=0.02, poll_only=True
    )
    with running(worker):
        assert done.wait(10)
    assert ran == sorted(priorities, reverse=True)


def test_a_running_job_of_a_higher_priority_does_not_hold_up_a_due_one_of_a_lower_priority(
    engine: sa.Engine, backend: str
) -> None:
    """The poll tries the next priority when every due job of a higher one is locked by a
    running claim (SQLite runs one claim at a time: a running job holds the database)."""
    if backend == "sqlite":
        pytest.skip("SQLite runs one claim at a time per database file")
    enqueue_committed(engine, "high", priority=5)
    enqueue_committed(engine, "low", priority=-5)
    started, release = threading.Event(), threading.Event()

    def hold(job_type: str, payload: Any) -> None:
        started.set()
        assert release.wait(10)

    holder = threading.Thread(target=sp.process_next_job, args=(engine, hold))
    holder.start()
    try:
        assert started.wait(10)
        ran: list[str] = []
        assert sp.process_next_job(engine, lambda job_type, payload: ran.append(job_type))
        assert ran == ["low"]
    finally:
        release.set()
        holder.join(10)
    assert jobs(engine) == []  # the held job finished once released


BAD_PRIORITIES = [sp.MAX_PRIORITY + 1, sp.MIN_PRIORITY - 1, True, 1.0, "1", None]


def test_a_priority_out_of_range_or_not_a_whole_number_is_refused_and_nothing_is_written(
    engine: sa.Engine,
) -> None:
    for bad in BAD_PRIORITIES:
        with Session(engine) as session:
            with pytest.raises(sp.InvalidJobError, match="priority") as info:
                sp.enqueue(session, "t", priority=bad)
            assert info.value.field == "priority"
            with pytest.raises(sp.InvalidJobError, match="priority"):
                sp.Job(job_type="t", priority=bad)
            with pytest.raises(sp.InvalidJobError, match="priority"):
                sp.enqueue(session, "t", priority=bad, unique_key="k")
            session.commit()
        with engine.begin() as conn:
            with pytest.raises(sp.InvalidJobError, match="priority"):
                sp.enqueue(conn, "t", priority=bad)
            with pytest.raises(sp.InvalidJobError, match="priority"):
                sp.enqueue_many(conn, [("t", None)], priority=bad)
    assert jobs(engine) == []


def test_the_error_says_which_priorities_are_allowed() -> None:
    with pytest.raises(sp.InvalidJobError, match=r"-32767 to 32767"):
        sp.Job(job_type="t", priority=40000)
    with pytest.raises(sp.InvalidJobError, match="not a whole number"):
        sp.Job(job_type="t", priority=False)
