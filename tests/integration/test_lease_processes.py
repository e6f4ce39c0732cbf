"""Lease-mode worker processes killed or frozen mid-job: once the lease expires another
worker takes the job (counting one unclean end), a frozen worker that wakes up commits
nothing, and each job is archived once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from helpers import archived, archived_job, enqueue_committed, jobs, wait_for
from lease_helpers import Base, Note, job_row, notes

import sqla_proletarian as sp

PROGRAM = Path(__file__).parent / "programs" / "lease_worker.py"
LEASE = ("--lease-seconds", "1", "--heartbeat-interval", "0.2")


class Workers:
    """Starts lease-mode worker processes; kills (and resumes) any left when the test ends."""

    def __init__(self, url: str, events_file: Path) -> None:
        self.url = url
        self.events_file = events_file
        self.processes: list[subprocess.Popen[str]] = []

    def start(self, *args: str) -> subprocess.Popen[str]:
        process = subprocess.Popen(
            [sys.executable, str(PROGRAM), self.url, str(self.events_file), *LEASE, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.processes.append(process)
        return process

    def events(self) -> list[list[str]]:
        if not self.events_file.exists():
            return []
        return [line.split() for line in self.events_file.read_text().splitlines()]

    def started(self, job_id: uuid.UUID, process: subprocess.Popen[str]) -> list[str] | None:
        """The ``start`` event of the job in that process, once it is there."""
        for event in self.events():
            if event[:2] == ["start", str(job_id)] and event[3] == str(process.pid):
                return event
        return None

    def ended(self, job_id: uuid.UUID, process: subprocess.Popen[str]) -> bool:
        return ["end", str(job_id), str(process.pid)] in self.events()

    def kill_all(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
                process.kill()
            process.communicate(timeout=10)


@pytest.fixture
def engine(database: Any) -> sa.Engine:
    engine = database.engine()
    Base.metadata.create_all(engine)
    return engine


@pytest.fixture
def workers(database: Any, engine: sa.Engine, tmp_path: Path) -> Iterator[Workers]:
    url = database.url.render_as_string(hide_password=False)
    started = Workers(url, tmp_path / "events.log")
    try:
        yield started
    finally:
        started.kill_all()


def finish(process: subprocess.Popen[str]) -> None:
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == 0, stderr


def test_a_sigkilled_workers_job_runs_again_once_its_lease_expires_with_one_unclean_end(
    engine: sa.Engine, workers: Workers, tmp_path: Path
) -> None:
    """The kill leaves the job leased; once the 1 s lease expires a second worker's ordinary
    poll takes it, with unclean_ends 1 and the attempts column counting both runs, while the
    handler sees its first attempt again (runs that ended uncleanly are not counted there, as
    in transaction mode); it is archived once, counting both runs, with the second run's
    write only."""
    hold = tmp_path / "hold"
    job_id = enqueue_committed(engine, "hang")
    first = workers.start("--hang-type", "hang")
    assert wait_for(lambda: workers.started(job_id, first) is not None, 30)
    os.kill(first.pid, signal.SIGKILL)
    assert first.wait(10) == -signal.SIGKILL
    left = job_row(engine, job_id)
    assert left.lease_token is not None and left.attempts == 1
    # Once the lease has expired, the job shows as ready again, its lease expired.
    assert wait_for(lambda: sp.get_job(engine, job_id).state == "ready", 30)
    assert sp.get_job(engine, job_id).lease_expired
    [status] = sp.queue_status(engine)
    assert (status.ready, status.running, status.expired_leases) == (1, 0, 1)

    second = workers.start("--hang-type", "hang", "--hold-file", str(hold), "--exit-after", "1")
    assert wait_for(lambda: workers.started(job_id, second) is not None, 30)
    assert workers.started(job_id, second) == ["start", str(job_id), "1", str(second.pid)]
    running = job_row(engine, job_id)
    assert (running.unclean_ends, running.attempts) == (1, 2)
    assert running.lease_token not in (None, left.lease_token)
    hold.touch()
    finish(second)

    [done] = archived(engine)
    assert (done.job_id, done.status, done.attempts) == (job_id, "success", 2)
    assert notes(engine) == [f"{job_id} {second.pid}"]
    assert jobs(engine) == []


def test_a_job_whose_lease_expired_max_unclean_ends_times_is_archived_as_crashed(
    engine: sa.Engine, workers: Workers
) -> None:
    """With max_unclean_ends 1, one expired lease is enough: the next worker archives the job
    as failed with JobCrashedError, without running it."""
    job_id = enqueue_committed(engine, "hang")
    first = workers.start("--hang-type", "hang", "--max-unclean-ends", "1")
    assert wait_for(lambda: workers.started(job_id, first) is not None, 30)
    os.kill(first.pid, signal.SIGKILL)
    assert first.wait(10) == -signal.SIGKILL

    second = workers.start("--max-unclean-ends", "1")
    assert wait_for(lambda: archived_job(engine, job_id) is not None, 30)
    done = archived_job(engine, job_id)
    assert done is not None and (done.status, done.attempts) == ("failure", 1)
    assert done.error is not None and "JobCrashedError" in done.error
    assert workers.started(job_id, second) is None, "the crashed job did not run again"
    assert notes(engine) == []
    assert jobs(engine) == []


def test_a_worker_frozen_past_its_lease_commits_nothing_once_it_wakes_up(
    engine: sa.Engine, workers: Workers, tmp_path: Path
) -> None:
    """SIGSTOP a worker mid-job past its lease; another worker takes the job and finishes it;
    SIGCONT: the frozen worker's heartbeat finds the lease lost and sets the handler's
    cancel_requested; the handler returns, but its completion finds the lease gone and its
    write never commits. The archive has one row, the second run's."""
    hold = tmp_path / "hold"
    job_id = enqueue_committed(engine, "hang")
    frozen = workers.start(
        *("--hang-type", "hang", "--hold-file", str(hold), "--await-cancel", "10", "--signals")
    )
    assert wait_for(lambda: workers.started(job_id, frozen) is not None, 30)
    freeze_outside_its_heartbeat(frozen, engine, job_id)
    try:
        taker = workers.start("--exit-after", "1")
        finish(taker)
        assert [row.status for row in archived(engine)] == ["success"]
        assert notes(engine) == [f"{job_id} {taker.pid}"]
        hold.touch()
    finally:
        os.kill(frozen.pid, signal.SIGCONT)
    assert wait_for(lambda: workers.ended(job_id, frozen), 30), "the frozen run went on"
    assert ["cancel", str(job_id), str(frozen.pid), "True"] in workers.events()
    frozen.send_signal(signal.SIGTERM)  # a graceful stop: the run's completion ends first
    _, stderr = frozen.communicate(timeout=30)
    assert frozen.returncode == -signal.SIGTERM, stderr

    assert notes(engine) == [f"{job_id} {taker.pid}"], "the frozen run's write never committed"
    [done] = archived(engine)
    assert (done.job_id, done.status, done.attempts) == (job_id, "success", 2)
    assert jobs(engine) == []


def freeze_outside_its_heartbeat(
    process: subprocess.Popen[str], engine: sa.Engine, job_id: uuid.UUID
) -> None:
    """SIGSTOP ``process`` at a moment when it holds no lock on the job's row. A heartbeat
    locks the row for the few milliseconds of its transaction; a worker frozen inside one
    keeps the row locked, and other workers' claims skip it, until it wakes or the server ends
    its session: that is not the freeze this scenario is about. Frozen there, it is woken and
    frozen again a moment later."""
    locked = (
        sa.select(sp.Job.job_id).where(sp.Job.job_id == job_id).with_for_update(skip_locked=True)
    )
    for _ in range(100):
        os.kill(process.pid, signal.SIGSTOP)
        with engine.begin() as conn:
            if conn.execute(locked).first() is not None:
                return
        os.kill(process.pid, signal.SIGCONT)
        time.sleep(0.03)
    pytest.fail("the worker held the job's row at each of 100 freezes")


def test_a_transaction_mode_worker_takes_over_an_expired_lease_counting_the_killed_run(
    engine: sa.Engine, workers: Workers
) -> None:
    """Any worker's ordinary poll rescues an expired lease, a transaction-mode one too: the
    killed run counts as one unclean end, which the handler's attempts leave out (it sees 1,
    then 2 on its retry); a retry after it clears the lease, so with max_unclean_ends 2 the
    job is not taken for crashed, and the archive counts the three runs."""
    job_id = enqueue_committed(engine, "hang")
    first = workers.start("--hang-type", "hang")
    assert wait_for(lambda: workers.started(job_id, first) is not None, 30)
    os.kill(first.pid, signal.SIGKILL)
    assert first.wait(10) == -signal.SIGKILL
    runs: list[int] = []

    def handler(job: sp.JobContext) -> None:
        runs.append(job.attempts)
        job.session.execute(sa.insert(Note).values(text=f"run {len(runs)}"))
        if len(runs) == 1:
            raise RuntimeError("fails once")

    options: dict[str, Any] = {
        "handler_mode": "advanced",
        "max_unclean_ends": 2,
        "retry_strategy": lambda job, exc: sp.RetryStrategy(retries=2, delays=[0]),
    }
    assert wait_for(lambda: sp.process_next_job(engine, handler, **options), 30)
    retried = job_row(engine, job_id)
    assert retried is not None, (runs, archived(engine))
    assert retried.lease_token is None
    assert sp.process_next_job(engine, handler, **options)
    assert runs == [1, 2]
    done = archived_job(engine, job_id)
    assert done is not None and (done.status, done.attempts) == ("success", 3)
    assert notes(engine) == ["run 2"]
    assert jobs(engine) == []
