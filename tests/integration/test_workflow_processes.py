"""Workflows run by real worker processes, proved from the handlers' own start and end times
(``programs/flow_tasks.py`` notes them): joins whose parts end at about the same moment in
three processes run once each, after their last part; and when the worker running a
dependency is SIGKILLed, the dependency runs again elsewhere and its dependents run once,
after that rerun succeeded. On every backend, in transaction and lease mode."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import sqlalchemy as sa
from helpers import archived, jobs, wait_for
from process_helpers import DRAIN_TIMEOUT, MODES, QUEUE, Workers

import sqla_proletarian as sp

if TYPE_CHECKING:
    from conftest import Database


@pytest.fixture(params=list(MODES))
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def workers(database: Database, tmp_path: Path) -> Iterator[Workers]:
    started = Workers(database, tmp_path)
    try:
        yield started
    finally:
        started.kill_all()


def notes_of(workers: Workers) -> list[tuple[str, uuid.UUID, str, float, int]]:
    """Every note: start or end, job id, key, time, pid."""
    return [
        (what, uuid.UUID(job_id), key, float(at), int(pid))
        for what, job_id, key, at, pid in workers.notes()
    ]


def test_joins_in_three_processes_run_once_each_after_their_last_part(
    database: Database, workers: Workers, mode: str
) -> None:
    engine = database.engine()
    groups: dict[uuid.UUID, list[uuid.UUID]] = {}
    with engine.begin() as conn:
        for group in range(5):
            parts = sp.enqueue_many(
                conn, [("sleep", {"seconds": 0.3, "key": f"part{group}"})] * 6, queue=QUEUE
            )
            join = sp.enqueue(
                conn, "sleep", {"seconds": 0, "key": "join"}, queue=QUEUE, depends_on=parts
            )
            groups[join] = parts
    for _ in range(3):
        workers.start("--threads", "3", *MODES[mode])
    assert wait_for(lambda: len(archived(engine)) == 35, DRAIN_TIMEOUT, 0.1), (
        f"{len(archived(engine))} of 35 jobs archived"
    )
    assert workers.stop() == 35
    runs = {run.job_id: run for run in workers.runs()}
    assert len(workers.runs()) == 35, "every job ran exactly once"
    for join, parts in groups.items():
        last_end = max(runs[part].end for part in parts)
        assert runs[join].start >= last_end, (runs[join], last_end)
    assert {row.status for row in archived(engine)} == {"success"}


def test_dependents_of_a_job_whose_worker_is_killed_run_once_after_its_rerun(
    database: Database, workers: Workers, mode: str, tmp_path: Path
) -> None:
    engine = database.engine()
    with engine.begin() as conn:
        first = sp.enqueue(conn, "sleep", {"seconds": 2.0, "key": "first"}, queue=QUEUE)
        second = sp.enqueue(
            conn, "sleep", {"seconds": 0, "key": "second"}, queue=QUEUE, depends_on=[first]
        )
        third = sp.enqueue(
            conn, "sleep", {"seconds": 0, "key": "third"}, queue=QUEUE, depends_on=[second]
        )
    doomed = workers.start("--threads", "1", *MODES[mode])
    assert wait_for(lambda: workers.started(doomed) == [first], 30), workers.notes()
    os.kill(doomed.pid, signal.SIGKILL)
    doomed.wait(10)
    survivor = workers.start("--threads", "2", *MODES[mode])
    assert wait_for(lambda: len(archived(engine)) == 3, DRAIN_TIMEOUT, 0.1), (
        f"{len(archived(engine))} of 3 archived; notes: {workers.notes()}"
    )
    notes = notes_of(workers)
    starts = [(job_id, pid) for what, job_id, _, _, pid in notes if what == "start"]
    ends = {job_id: at for what, job_id, _, at, pid in notes if what == "end"}
    begun = {job_id: at for what, job_id, _, at, _ in notes if what == "start"}
    assert starts == [
        (first, doomed.pid),
        (first, survivor.pid),
        (second, survivor.pid),
        (third, survivor.pid),
    ], notes
    assert ends[first] <= begun[second] and ends[second] <= begun[third]
    rows = {row.job_id: row for row in archived(engine)}
    assert [rows[job_id].status for job_id in (first, second, third)] == ["success"] * 3
    assert rows[first].attempts == 2
    assert jobs(engine) == []
    with engine.connect() as conn:
        pending = conn.execute(
            sa.select(sa.func.count())
            .select_from(sp.models.Dependency)
            .where(sp.models.Dependency.pending.is_(True))
        ).scalar_one()
    assert pending == 0
