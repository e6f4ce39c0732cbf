"""Jobs waiting for their dependencies, and job graphs, as inspection shows them: the
``waiting`` state in get_job, list_jobs and queue_status (apart from the scheduled jobs),
each job's ``depends_on`` and ``dependents`` before and after its dependencies end, its
``progress``; and prune_archive keeping an archived job that a queued job depends on."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import sqlalchemy as sa
from helpers import T0, FakeClock, count
from sqlalchemy.orm import Session

import sqla_proletarian as sp
from sqla_proletarian.models import Dependency, Progress

DEPENDENCY = Dependency.__table__
PROGRESS = Progress.__table__


def enqueue(engine: sa.Engine, job_type: str, clock: FakeClock, **kw: Any) -> uuid.UUID:
    with Session(engine) as session:
        job_id = sp.enqueue(session, job_type, clock=clock, **kw)
        session.commit()
    return job_id


def a_graph(engine: sa.Engine, clock: FakeClock) -> tuple[uuid.UUID, ...]:
    """first and second, due now; third depends on both (due in an hour of its own);
    fourth depends on third."""
    first = enqueue(engine, "first", clock)
    second = enqueue(engine, "second", clock)
    third = enqueue(engine, "third", clock, depends_on=[first, second], process_in=3600)
    fourth = enqueue(engine, "fourth", clock, depends_on=[third])
    return first, second, third, fourth


def test_a_waiting_job_is_in_state_waiting_with_its_own_due_time_and_its_graph(
    engine: sa.Engine,
) -> None:
    clock = FakeClock()
    first, second, third, fourth = a_graph(engine, clock)
    job = sp.get_job(engine, third, clock=clock)
    assert job is not None
    assert job.state == "waiting"
    assert job.process_at == T0 + timedelta(hours=1)  # its own, not WAITING_AT
    assert sorted(job.depends_on) == sorted([first, second])
    assert job.dependents == [fourth]
    assert (job.progress, job.progress_message) == (None, None)
    head = sp.get_job(engine, first, clock=clock)
    assert head is not None
    assert (head.state, head.depends_on, head.dependents) == ("ready", [], [third])

    waiting = sp.list_jobs(engine, "waiting", clock=clock).jobs
    assert {j.job_id for j in waiting} == {third, fourth}
    assert all(j.state == "waiting" for j in waiting)
    assert {j.job_id: j.depends_on for j in waiting}[fourth] == [third]
    assert sp.list_jobs(engine, "scheduled", clock=clock).jobs == ()
    assert {j.job_id for j in sp.list_jobs(engine, "ready", clock=clock).jobs} == {first, second}

    [status] = sp.queue_status(engine, clock=clock)
    assert (status.ready, status.scheduled, status.waiting_on_dependencies) == (2, 0, 2)
    assert status.waiting is None  # the queue has no limits: nothing held back by them


def test_once_its_dependencies_succeeded_a_job_is_due_and_its_graph_stays(
    engine: sa.Engine,
) -> None:
    clock = FakeClock()
    first, second, third, fourth = a_graph(engine, clock)
    done: list[str] = []

    def handler(job_type: str, payload: Any) -> None:
        done.append(job_type)
        sp.current_job().set_progress(0.5, f"{job_type} half done")

    assert sp.process_next_job(engine, handler, clock=clock)
    assert sp.process_next_job(engine, handler, clock=clock)
    assert sorted(done) == ["first", "second"]
    job = sp.get_job(engine, third, clock=clock)
    assert job is not None
    assert job.state == "scheduled"  # its own due time is an hour away
    assert sorted(job.depends_on) == sorted([first, second])
    archived = sp.get_job(engine, first, clock=clock)
    assert archived is not None
    assert (archived.state, archived.dependents) == ("succeeded", [third])
    assert (archived.progress, archived.progress_message) == (0.5, "first half done")
    [listed] = [j for j in sp.list_jobs(engine, "succeeded").jobs if j.job_id == first]
    assert (listed.progress, listed.dependents) == (0.5, [third])
    [status] = sp.queue_status(engine, clock=clock)
    assert (status.scheduled, status.waiting_on_dependencies) == (1, 1)
    assert sp.list_jobs(engine, "waiting", clock=clock).jobs[0].job_id == fourth


def test_prune_archive_keeps_a_job_a_queued_job_depends_on_and_forgets_pruned_graphs(
    engine: sa.Engine,
) -> None:
    clock = FakeClock()
    first, second, third, fourth = a_graph(engine, clock)
    alone = enqueue(engine, "alone", clock)
    with engine.begin() as conn:  # each job's progress, as set_progress leaves it
        conn.execute(
            sa.insert(PROGRESS),
            [
                {"job_id": job_id, "progress": 1.0, "message": "done", "updated_at": T0}
                for job_id in (first, second, third, fourth, alone)
            ],
        )

    def handler(job_type: str, payload: Any) -> None:
        pass

    for _ in range(3):  # first, second and alone
        assert sp.process_next_job(engine, handler, clock=clock)
    clock.advance(2 * 3600)
    assert sp.process_next_job(engine, handler, clock=clock)  # third; fourth waits on it
    clock.advance(60 * 86400)

    # first and second: fourth (queued) depends on third, not on them: they go, with
    # third's dependency rows kept (third is archived but not pruned: fourth needs it).
    assert sp.prune_archive(engine, older_than=timedelta(days=30), clock=clock) == 3
    assert sp.get_job(engine, third, clock=clock) is not None
    assert sp.get_job(engine, first, clock=clock) is None
    assert sp.get_job(engine, alone, clock=clock) is None
    with engine.connect() as conn:
        edges = {tuple(row) for row in conn.execute(sa.select(DEPENDENCY.c.job_id))}
        reports = set(conn.scalars(sa.select(PROGRESS.c.job_id)))
    # Pruned jobs' own rows are gone: third's edges (to first and second) and fourth's stay.
    assert edges == {(third,), (fourth,)}
    assert reports == {third, fourth}

    assert sp.process_next_job(engine, handler, clock=clock)  # fourth
    clock.advance(60 * 86400)
    assert sp.prune_archive(engine, older_than=timedelta(days=30), clock=clock) == 2
    assert count(engine, DEPENDENCY) == 0
    assert count(engine, PROGRESS) == 0
