"""``cancel`` of a job running under a lease, through the console script on every backend:
the message says what a request means, and ``--wait`` waits for the job's end and tells
its final state by its exit status (0 cancelled, 3 success, 4 failure, 124 still running
when ``--timeout`` passed)."""

from __future__ import annotations

import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from cli_support import CLI, PACKAGE_ENV, archived, cli, events, url_of, wait_until, write_tasks

import sqla_proletarian as sp
from sqla_proletarian.cli.control import (
    EXIT_CANCEL_FAILED,
    EXIT_CANCEL_SUCCEEDED,
    EXIT_CANCEL_TIMEOUT,
    _wait_for_end,
)

if TYPE_CHECKING:
    from conftest import Database

#: A handler that runs until its job's cancel reaches it (``stops``), and the test module's
#: ``slow`` one, which never looks.
STOPPING_TASKS = """\
import time

from tasks import handlers, note


@handlers.register("stops")
def stops(job):
    note("start", job)
    deadline = time.monotonic() + 60
    while not job.cancel_requested.is_set() and time.monotonic() < deadline:
        time.sleep(0.05)
    note("end", job)
"""


@pytest.fixture
def lease_worker(database: Database, tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """A lease-mode worker (heartbeat every 0.5 s) of ``cancel_tasks``, stopped at the end."""
    write_tasks(tmp_path)
    (tmp_path / "cancel_tasks.py").write_text(STOPPING_TASKS)
    process = subprocess.Popen(
        [CLI, "worker", "cancel_tasks:handlers", "--handler-mode", "advanced",
         "--lease-seconds", "3", "--heartbeat-interval", "0.5", "--shutdown-timeout", "0.5"],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "DATABASE_URL": url_of(database), **PACKAGE_ENV},
        stderr=subprocess.DEVNULL,
        text=True,
    )  # fmt: skip
    yield process
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def enqueue_and_start(database: Database, directory: Path, job_type: str) -> uuid.UUID:
    engine = database.engine()
    with engine.begin() as conn:
        job = sp.enqueue(conn, job_type, {"seconds": 60})
    engine.dispose()
    wait_until(lambda: events(directory), "the job to start", 60)
    return job


def test_cancel_wait_reports_a_running_job_archived_as_cancelled(
    database: Database, tmp_path: Path, lease_worker: subprocess.Popen[str]
) -> None:
    """The request says the worker stops the job at its next heartbeat if it still runs;
    ``--wait`` then reports it archived as cancelled, exit 0."""
    job = enqueue_and_start(database, tmp_path, "stops")

    done = cli("cancel", str(job), "--wait", "--url", url_of(database), timeout=90)

    assert done.returncode == 0, (done.stdout, done.stderr)
    requested, ended = done.stdout.strip().splitlines()
    assert requested.startswith(f"job {job} cancel requested: it is running under a lease")
    assert "stops it at its next heartbeat if it is still running then" in requested
    assert ended == f"job {job} ended: archived as cancelled"
    assert archived(database.engine())[job].status == "cancelled"


def test_cancel_wait_says_when_the_job_has_not_ended_by_the_timeout(
    database: Database, tmp_path: Path, lease_worker: subprocess.Popen[str]
) -> None:
    """A handler that never looks at its cancel request is still running when ``--timeout``
    passes: exit 124, saying so."""
    job = enqueue_and_start(database, tmp_path, "slow")

    done = cli("cancel", str(job), "--wait", "--timeout", "1", "--url", url_of(database))

    assert done.returncode == EXIT_CANCEL_TIMEOUT == 124, (done.stdout, done.stderr)
    assert done.stdout.strip().splitlines()[-1] == (
        f"job {job} has not ended after 1 s (it is running); "
        "`sqla-proletarian jobs --state running` shows it"
    )


def test_cancel_without_wait_points_at_it(
    database: Database, tmp_path: Path, lease_worker: subprocess.Popen[str]
) -> None:
    job = enqueue_and_start(database, tmp_path, "stops")

    done = cli("cancel", str(job), "--url", url_of(database))

    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("(`sqla-proletarian cancel --wait` waits and says which)")


@pytest.mark.parametrize(
    ("handler_raises", "status", "word"),
    [(False, EXIT_CANCEL_SUCCEEDED, "success"), (True, EXIT_CANCEL_FAILED, "failure")],
)
def test_the_wait_tells_a_job_that_ended_another_way_by_its_exit_status(
    database: Database,
    capsys: pytest.CaptureFixture[str],
    handler_raises: bool,
    status: int,
    word: str,
) -> None:
    """A job whose handler finished before its worker stopped it: 3 for success, 4 for
    failure, each named."""
    engine = database.engine()
    with engine.begin() as conn:
        job = sp.enqueue(conn, "t", None)

    def handler(job_type: str, payload: object) -> None:
        if handler_raises:
            raise ValueError("no good")

    assert sp.process_next_job(engine, handler)
    assert _wait_for_end(engine, job, 5) == status
    assert capsys.readouterr().out == f"job {job} ended: archived as {word}\n"
    engine.dispose()
