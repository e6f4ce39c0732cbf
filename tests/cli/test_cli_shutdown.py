"""A stop that gives up on running jobs says so in its exit status, through the installed
script on every backend: with ``--shutdown-timeout`` shorter than a running job, SIGTERM
ends the threaded worker, the asyncio worker (``async def`` handlers) and a supervisor of
several processes at the timeout with status 4 (EXIT_JOBS_UNFINISHED) and a line that says
how many jobs will run again, in both modes; the job stays queued and runs again. A stop
whose running jobs finish still ends by the signal."""

from __future__ import annotations

import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import sqlalchemy as sa
from cli_support import CLI, PACKAGE_ENV, archived, events, rows, url_of, wait_until, write_tasks
from test_cli_async import async_url, write_async_tasks

import sqla_proletarian as sp
from sqla_proletarian import statements
from sqla_proletarian.supervisor import EXIT_JOBS_UNFINISHED

if TYPE_CHECKING:
    from conftest import Database

MODES = {"transaction": [], "lease": ["--lease-seconds", "30"]}
UNFINISHED = "1 running job did not finish within the shutdown timeout"


def stop_mid_job(directory: Path, url: str, *args: str, started: int = 1) -> tuple[int, str, float]:
    """Run ``worker`` until ``started`` jobs have started, then SIGTERM it: its status, its
    standard error, and how long the stop took."""
    process = subprocess.Popen(
        [CLI, "worker", *args],
        cwd=directory,
        env={"PATH": "/usr/bin:/bin", "DATABASE_URL": url, **PACKAGE_ENV},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(lambda: len(events(directory)) >= started, "the jobs to start", 60)
        time.sleep(0.2)  # the handler is well inside its sleep
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=30)
        took = time.monotonic() - signalled
    finally:
        if process.poll() is None:
            process.kill()
    return process.returncode, stderr, took


def queued_ids(engine: sa.Engine) -> list[uuid.UUID]:
    return [row.job_id for row in rows(engine, statements.JOB)]


def runs_again(engine: sa.Engine, job_id: uuid.UUID) -> None:
    """The job given up on is still queued, due again, and runs to success once."""
    ran: list[uuid.UUID] = []
    deadline = time.monotonic() + 40  # a lease of 30 s, when its release did not land

    def handler(job: sp.JobContext) -> None:
        ran.append(job.job_id)

    while not ran and time.monotonic() < deadline:
        sp.process_next_job(engine, handler, handler_mode="advanced")
        time.sleep(0.1)
    assert ran == [job_id]
    assert archived(engine)[job_id].status == "success"


@pytest.mark.parametrize("mode", MODES)
def test_a_stop_that_gives_up_on_a_running_job_exits_4_and_the_job_runs_again(
    database: Database, tmp_path: Path, mode: str
) -> None:
    url = url_of(database)
    write_tasks(tmp_path)
    engine = database.engine()
    with engine.begin() as conn:
        job = sp.enqueue(conn, "slow", {"seconds": 60})

    status, stderr, took = stop_mid_job(
        tmp_path, url, "tasks:handlers", "--handler-mode", "advanced",
        "--shutdown-timeout", "0.5", *MODES[mode],
    )  # fmt: skip

    assert status == EXIT_JOBS_UNFINISHED == 4, stderr
    assert f"{UNFINISHED} (0.5 s) and will run again" in stderr
    assert "--shutdown-timeout" in stderr and "Traceback" not in stderr
    assert "queue-worker-shutdown-timeout" in stderr
    assert took < 20, took
    assert queued_ids(engine) == [job]
    runs_again(engine, job)
    engine.dispose()


def test_the_asyncio_worker_gives_up_alike(database: Database, tmp_path: Path) -> None:
    url = async_url(database)
    write_async_tasks(tmp_path)
    engine = database.engine()
    with engine.begin() as conn:
        job = sp.enqueue(conn, "slow", {"seconds": 60})

    status, stderr, _ = stop_mid_job(
        tmp_path, url, "atasks:handlers", "--handler-mode", "advanced",
        "--shutdown-timeout", "0.5",
    )  # fmt: skip

    assert status == EXIT_JOBS_UNFINISHED, stderr
    assert f"{UNFINISHED} (0.5 s)" in stderr and "Traceback" not in stderr
    assert queued_ids(engine) == [job]
    runs_again(engine, job)
    engine.dispose()


def test_a_supervisor_whose_processes_gave_up_on_jobs_exits_4(
    database: Database, tmp_path: Path
) -> None:
    if database.backend == "sqlite":
        pytest.skip("SQLite runs one job at a time per file: two slow jobs cannot both start")
    url = url_of(database)
    write_tasks(tmp_path)
    engine = database.engine()
    with engine.begin() as conn:
        jobs = sp.enqueue_many(conn, [("slow", {"seconds": 60})] * 2)

    status, stderr, _ = stop_mid_job(
        tmp_path, url, "tasks:handlers", "--handler-mode", "advanced",
        "--shutdown-timeout", "0.5", "--processes", "2", started=2,
    )  # fmt: skip

    assert status == EXIT_JOBS_UNFINISHED, stderr
    assert "2 running jobs did not finish within the shutdown timeout" in stderr
    assert sorted(queued_ids(engine)) == sorted(jobs)
    engine.dispose()


def test_a_stop_whose_running_job_finishes_still_ends_by_the_signal(
    database: Database, tmp_path: Path
) -> None:
    url = url_of(database)
    write_tasks(tmp_path)
    engine = database.engine()
    with engine.begin() as conn:
        job = sp.enqueue(conn, "slow", {"seconds": 1})

    status, stderr, _ = stop_mid_job(
        tmp_path, url, "tasks:handlers", "--handler-mode", "advanced", "--shutdown-timeout", "30"
    )

    assert status == -signal.SIGTERM, stderr
    assert "did not finish" not in stderr
    assert archived(engine)[job].status == "success"
    engine.dispose()
