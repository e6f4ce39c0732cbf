"""``worker --processes 2``: a supervisor of two worker processes that stops them gracefully
on SIGTERM with one combined summary, and restarts one killed by SIGKILL, with every job
still run and archived once; on every backend."""

from __future__ import annotations

import re
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import sqlalchemy as sa
from cli_support import CLI, PACKAGE_ENV, archived, events, rows, url_of, wait_until, write_tasks

import sqla_proletarian as sp
from sqla_proletarian import statements

if TYPE_CHECKING:
    from conftest import Database

SUMMARY = re.compile(
    r"sqla-proletarian: 2 worker processes stopped: (\d+) succeeded, 0 retried, 0 failed"
)


@pytest.fixture
def supervisors() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()  # its worker processes stop when their standard input closes
            process.wait(timeout=10)


def supervise(
    supervisors: list[subprocess.Popen[str]], database: Database, directory: Path, *args: str
) -> subprocess.Popen[str]:
    """Start ``worker tasks:handlers --processes 2`` in ``directory``, stderr to a file."""
    with (directory / "stderr.log").open("w") as log:
        process = subprocess.Popen(
            [
                CLI,
                "worker",
                "tasks:handlers",
                "--processes",
                "2",
                "--handler-mode",
                "advanced",
                *args,
            ],
            cwd=directory,
            env={"PATH": "/usr/bin:/bin", "DATABASE_URL": url_of(database), **PACKAGE_ENV},
            stdout=subprocess.DEVNULL,
            stderr=log,
            text=True,
        )
    supervisors.append(process)
    return process


def stderr(directory: Path) -> str:
    return (directory / "stderr.log").read_text()


def enqueue_slow(engine: sa.Engine, count: int, seconds: float) -> list[uuid.UUID]:
    with engine.begin() as conn:
        return sp.enqueue_many(conn, [("slow", {"seconds": seconds})] * count)


def test_sigterm_stops_both_worker_processes_gracefully_with_one_summary_and_status_0(
    database: Database, tmp_path: Path, supervisors: list[subprocess.Popen[str]]
) -> None:
    """Both processes take the signal (forwarded once), finish their running jobs, start
    no others, report their counts; the supervisor prints their sum and exits 0."""
    write_tasks(tmp_path)
    engine = database.engine()
    jobs = enqueue_slow(engine, 40, 0.2)
    process = supervise(supervisors, database, tmp_path)
    wait_until(
        lambda: "#0 queue=" in stderr(tmp_path) and "#1 queue=" in stderr(tmp_path),
        "both worker processes to start",
    )
    wait_until(lambda: events(tmp_path), "a job to start")
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0, stderr(tmp_path)

    text = stderr(tmp_path)
    assert "SIGTERM received, stopping 2 worker processes gracefully" in text
    assert "proletarian[default]#0 stopped:" in text and "proletarian[default]#1 stopped:" in text
    summary = SUMMARY.search(text)
    assert summary is not None, text
    noted = events(tmp_path)
    started = {job_id for what, _, job_id in noted if what == "start"}
    ended = {job_id for what, _, job_id in noted if what == "end"}
    assert started == ended, "a running job did not finish"
    done = archived(engine)
    assert set(done) == ended and {row.status for row in done.values()} == {"success"}
    assert int(summary[1]) == len(done)
    assert {row.job_id for row in rows(engine, statements.JOB)} == set(jobs) - ended
    assert rows(engine, statements.RUN) == []


def test_a_worker_process_killed_by_sigkill_is_restarted_and_every_job_runs_once(
    database: Database, tmp_path: Path, supervisors: list[subprocess.Popen[str]]
) -> None:
    """With --burst: the supervisor logs the death, starts the process again after its
    backoff, and the queue drains: every job archived once as a success, the killed run
    counted as an unclean end, nothing left in the queue or the ledger; status 0."""
    write_tasks(tmp_path)
    engine = database.engine()
    jobs = enqueue_slow(engine, 8, 0.25)
    process = supervise(supervisors, database, tmp_path, "--burst")

    def running() -> tuple[int, uuid.UUID] | None:
        noted = events(tmp_path)
        ended = {job_id for what, _, job_id in noted if what == "end"}
        busy = [(pid, job_id) for what, pid, job_id in noted if job_id not in ended]
        return busy[0] if busy else None

    pid, killed_job = wait_until(running, "a job to be running")
    subprocess.run(["kill", "-KILL", str(pid)], check=True)
    assert process.wait(timeout=60) == 0, stderr(tmp_path)

    text = stderr(tmp_path)
    assert re.search(rf"worker-process-exited index=\d pid={pid} exit=SIGKILL restart_in=", text)
    summary = SUMMARY.search(text)
    assert summary is not None and text.rstrip().endswith("(1 restarted)"), text
    done = archived(engine)
    assert set(done) == set(jobs)
    assert {row.status for row in done.values()} == {"success"}
    assert done[killed_job].attempts == 2  # the killed run, an unclean end, and the last
    assert rows(engine, statements.JOB) == [] and rows(engine, statements.RUN) == []
    by_survivors = {job_id for what, p, job_id in events(tmp_path) if what == "end" and p != pid}
    assert killed_job in by_survivors
    # The summary counts what the processes reported: not what the killed one had finished.
    assert int(summary[1]) == len(done) - len(set(jobs) - by_survivors)


#: A handler module whose import takes long: its process has not installed its signal
#: handlers (nor started its worker) while the import goes on.
SLOW_START = """\
import os
import time

open(f"importing.{os.getpid()}", "w").close()
time.sleep(60)
from tasks import handlers
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_signal_while_a_worker_process_is_still_starting_is_a_clean_stop(
    supervisors: list[subprocess.Popen[str]], tmp_path: Path, signum: signal.Signals
) -> None:
    """The process, killed (or interrupted) by the forwarded signal before it installed its
    handlers, ran nothing: the supervisor exits 0, not 1."""
    write_tasks(tmp_path)
    (tmp_path / "slow_start.py").write_text(SLOW_START)
    with (tmp_path / "stderr.log").open("w") as log:
        process = subprocess.Popen(
            [CLI, "worker", "slow_start:handlers", "--processes", "2", "--burst"],
            cwd=tmp_path,
            env={"PATH": "/usr/bin:/bin", "DATABASE_URL": f"sqlite:///{tmp_path}/app.db",
                 **PACKAGE_ENV},
            stdout=subprocess.DEVNULL,
            stderr=log,
            text=True,
        )  # fmt: skip
    supervisors.append(process)
    wait_until(lambda: list(tmp_path.glob("importing.*")), "a worker process to start", 60)

    process.send_signal(signum)

    assert process.wait(timeout=30) == 0, stderr(tmp_path)
    assert "2 worker processes stopped: 0 succeeded" in stderr(tmp_path)
