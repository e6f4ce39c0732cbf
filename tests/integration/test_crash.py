"""A worker process killed with SIGKILL mid-job: the job runs again in a new worker process
and ends archived exactly once; no job is lost."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from helpers import enqueue_committed as enqueue

import sqla_proletarian as sp
from sqla_proletarian import statements

PROGRAM = Path(__file__).parent / "programs" / "worker.py"


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting until {what}")
        time.sleep(0.02)


def events(path: Path) -> list[list[str]]:
    if not path.exists():
        return []
    return [
        line.split() for line in path.read_text().splitlines() if line.endswith(tuple("0123456789"))
    ]


class Workers:
    """Starts worker processes and kills any still running when the test ends."""

    def __init__(self, url: str, events_file: Path) -> None:
        self.url = url
        self.events_file = events_file
        self.processes: list[subprocess.Popen[str]] = []

    def start(self, *args: str) -> subprocess.Popen[str]:
        process = subprocess.Popen(
            [sys.executable, str(PROGRAM), self.url, str(self.events_file), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.processes.append(process)
        return process

    def kill_all(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.communicate(timeout=10)


@pytest.fixture
def workers(database: Any, tmp_path: Path) -> Iterator[Workers]:
    url = database.url.render_as_string(hide_password=False)
    started = Workers(url, tmp_path / "events.log")
    try:
        yield started
    finally:
        started.kill_all()


def rows(engine: sa.Engine, table: sa.Table) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(sa.select(table)).all())


def test_a_job_whose_worker_is_killed_mid_run_runs_again_and_is_archived_once(
    engine: sa.Engine, workers: Workers
) -> None:
    victim = enqueue(engine, "hang")
    others = [enqueue(engine, "quick", {"n": n}) for n in range(3)]

    first = workers.start("--hang-type", "hang")
    wait_until(
        lambda: any(e[:2] == ["start", str(victim)] for e in events(workers.events_file)),
        "the first worker is running the job",
    )
    os.kill(first.pid, signal.SIGKILL)
    assert first.wait(10) == -signal.SIGKILL

    # The kill left the job queued, untouched, with its run on record as an unclean end.
    queued = {row.job_id: row for row in rows(engine, statements.JOB)}
    assert set(queued) == {victim, *others}
    assert queued[victim].attempts == 0
    assert [row.job_id for row in rows(engine, statements.RUN)] == [victim]
    assert rows(engine, statements.ARCHIVE) == []

    second = workers.start("--exit-after", "4")
    _, stderr = second.communicate(timeout=30)
    assert second.returncode == 0, stderr

    archived = rows(engine, statements.ARCHIVE)
    assert sorted(row.job_id for row in archived) == sorted([victim, *others])
    assert {row.status for row in archived} == {"success"}
    assert rows(engine, statements.JOB) == []
    assert rows(engine, statements.RUN) == [], "the crash ledger keeps rows of a finished job"

    starts = [e for e in events(workers.events_file) if e[0] == "start"]
    victim_runs = [e for e in starts if e[1] == str(victim)]
    assert [e[3] for e in victim_runs] == [str(first.pid), str(second.pid)]
    assert all(sum(e[1] == str(job) for e in starts) == 1 for job in others)


def test_the_archive_counts_a_run_that_ended_in_a_crash_among_the_runs(
    engine: sa.Engine,
) -> None:
    """``attempts`` in the archive counts the runs; a killed run leaves a crash-ledger row
    (see the test above), and that run is one of them."""
    job_id = enqueue(engine, "quick")
    with engine.begin() as conn:
        conn.execute(
            sa.insert(statements.RUN).values(
                run_id=uuid.uuid4(), job_id=job_id, worker_id="killed", started_at=sp.utc_now()
            )
        )
    assert sp.process_next_job(engine, lambda job_type, payload: None)
    (archived,) = rows(engine, statements.ARCHIVE)
    assert archived.status == "success"
    assert rows(engine, statements.RUN) == []
    assert archived.attempts == 2
