"""``worker --burst`` through the console script on every backend, the threaded and the
asyncio worker: in lease mode it waits for the jobs it runs (a leased job is not due, yet
not done) however much longer they take than ``--shutdown-timeout``; it says in one line
how many jobs it leaves scheduled for later (retries waiting); and a burst whose stop gave
up on a job exits 4."""

from __future__ import annotations

import argparse
import re
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from cli_support import archived, cli, events, url_of, wait_until, write_tasks
from test_cli_async import assert_clean, async_url, write_async_tasks

import sqla_proletarian as sp
from sqla_proletarian.cli.worker import _ended
from sqla_proletarian.exits import EXIT_JOBS_UNFINISHED

if TYPE_CHECKING:
    from conftest import Database

#: The threaded worker (tasks.py) and the asyncio worker (atasks.py, on an async URL).
WORKERS = ("threaded", "asyncio")


def burst(database: Database, directory: Path, worker: str, *args: str) -> Any:
    """Run ``worker --burst`` of the test handlers to its end."""
    if worker == "asyncio":
        url, handlers = async_url(database), "atasks:handlers"
        write_async_tasks(directory)
    else:
        url, handlers = url_of(database), "tasks:handlers"
        write_tasks(directory)
    return cli("worker", handlers, "--handler-mode", "advanced", "--burst", *args,
               "--url", url, cwd=directory, timeout=90)  # fmt: skip


@pytest.mark.parametrize("worker", WORKERS)
def test_a_lease_mode_burst_waits_for_its_jobs_past_the_shutdown_timeout(
    database: Database, tmp_path: Path, worker: str
) -> None:
    """Two jobs of 1.5 s under leases, a shutdown timeout of 0.2 s: the burst runs both to
    success and exits 0, instead of stopping while they run and giving them up."""
    engine = database.engine()
    with engine.begin() as conn:
        jobs = sp.enqueue_many(conn, [("slow", {"seconds": 1.5})] * 2)

    done = burst(database, tmp_path, worker, "--lease-seconds", "30", "--shutdown-timeout", "0.2")

    assert_clean(done)
    assert "stopped: 2 succeeded, 0 retried, 0 failed" in done.stderr
    assert "did not finish" not in done.stderr
    assert {job: row.status for job, row in archived(engine).items()} == dict.fromkeys(
        jobs, "success"
    )
    assert sorted(what for what, _, _ in events(tmp_path)) == ["end", "end", "start", "start"]
    engine.dispose()


@pytest.mark.parametrize("worker", WORKERS)
@pytest.mark.parametrize("mode", [(), ("--lease-seconds", "30")], ids=["transaction", "lease"])
def test_a_burst_says_how_many_jobs_it_leaves_scheduled_for_later(
    database: Database, tmp_path: Path, worker: str, mode: tuple[str, ...]
) -> None:
    """A failing job retried an hour later, and another scheduled in 2 hours: the burst ends
    (exit 0) with one line that counts both and says when the next is due."""
    engine = database.engine()
    with engine.begin() as conn:
        sp.enqueue(conn, "fails", None)
        sp.enqueue(conn, "ok", None, process_in=timedelta(hours=2))

    done = burst(database, tmp_path, worker, "--retries", "1", "--retry-delays", "3600", *mode)

    assert_clean(done)
    lines = [line for line in done.stderr.splitlines() if "burst-done" in line]
    assert len(lines) == 1, done.stderr
    assert "scheduled_later=2 " in lines[0]
    due = re.search(r"next_due_in=(\d+)s", lines[0])
    assert due is not None and 3500 < int(due[1]) <= 3600, lines[0]
    assert "run the worker again once they are due, or without --burst" in lines[0]
    engine.dispose()


def test_a_burst_with_nothing_scheduled_later_says_nothing_of_it(
    database: Database, tmp_path: Path
) -> None:
    engine = database.engine()
    with engine.begin() as conn:
        sp.enqueue(conn, "ok", None)
    done = burst(database, tmp_path, "threaded")
    assert_clean(done)
    assert "burst-done" not in done.stderr
    engine.dispose()


def test_a_burst_whose_stop_gave_up_on_a_job_exits_4(
    database: Database, capsys: pytest.CaptureFixture[str]
) -> None:
    """What the command makes of a stopped worker whose stop gave up on a running job (a
    job claimed once the burst had found its queues drained): status 4, saying so."""
    engine = database.engine()
    with engine.begin() as conn:
        sp.enqueue(conn, "t", None)
    started, release = threading.Event(), threading.Event()

    def handler(job_type: str, payload: object) -> None:
        started.set()
        release.wait(30)

    worker = sp.create_queue_worker(
        engine, handler, lease_seconds=30, await_termination_timeout=0.2
    ).start()
    try:
        wait_until(started.is_set, "the job to start")
        worker.stop()
    finally:
        release.set()
    time.sleep(0.1)

    status = _ended(argparse.Namespace(burst=True), worker)

    assert status == EXIT_JOBS_UNFINISHED == 4
    err = capsys.readouterr().err
    assert "1 running job did not finish within the shutdown timeout (0.2 s)" in err
    engine.dispose()
