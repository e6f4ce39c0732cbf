"""A second SIGINT/SIGTERM in lease mode, through the console script on every backend, the
threaded and the asyncio worker: the process ends at once, as before, but first gives the
running job's lease back, so the job is due again now (not when its lease expires) and no
unclean end is charged to it."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from cli_support import CLI, PACKAGE_ENV, events, rows, url_of, wait_until, write_tasks
from test_cli_async import async_url, write_async_tasks

import sqla_proletarian as sp
from sqla_proletarian import statements

if TYPE_CHECKING:
    from conftest import Database


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
@pytest.mark.parametrize("worker", ["threaded", "asyncio"])
def test_a_second_signal_gives_the_running_jobs_lease_back_before_the_process_ends(
    database: Database, tmp_path: Path, worker: str, signum: signal.Signals
) -> None:
    if worker == "asyncio":
        url, handlers = async_url(database), "atasks:handlers"
        write_async_tasks(tmp_path)
    else:
        url, handlers = url_of(database), "tasks:handlers"
        write_tasks(tmp_path)
    engine = database.engine()
    with engine.begin() as conn:
        job = sp.enqueue(conn, "slow", {"seconds": 60})
    stderr = tmp_path / "stderr.log"
    with stderr.open("w") as log:
        process = subprocess.Popen(
            [CLI, "worker", handlers, "--handler-mode", "advanced", "--lease-seconds", "300",
             "--shutdown-timeout", "60"],
            cwd=tmp_path,
            env={"PATH": "/usr/bin:/bin", "DATABASE_URL": url, **PACKAGE_ENV},
            stderr=log,
        )  # fmt: skip
    try:
        wait_until(lambda: events(tmp_path), "the job to start", 60)
        process.send_signal(signum)
        wait_until(lambda: "finishing running jobs" in stderr.read_text(), "the first signal")
        process.send_signal(signum)
        status = process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()

    said = stderr.read_text()
    assert status == -signum, said
    [row] = rows(engine, statements.JOB)
    assert (row.job_id, row.lease_token, row.unclean_ends) == (job, None, 0), said
    assert f"{signum.name} again, giving the running jobs back and exiting at once" in said
    ran: list[object] = []
    deadline = time.monotonic() + 10  # well short of the 300 s lease
    while not ran and time.monotonic() < deadline:
        sp.process_next_job(engine, lambda job: ran.append(job.job_id), handler_mode="advanced")
    assert ran == [job]
    engine.dispose()
