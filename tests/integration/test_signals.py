"""SIGTERM and SIGINT stop a worker process gracefully: the running job finishes, no new job
starts, a summary of outcomes is printed, and the process exits as the signal would have
made it exit."""

from __future__ import annotations

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
from sqlalchemy.orm import Session

import sqla_proletarian as sp
from sqla_proletarian import statements

PROGRAM = Path(__file__).parent / "programs" / "worker.py"


def enqueue(engine: sa.Engine, job_type: str) -> uuid.UUID:
    with Session(engine) as session:
        job_id = sp.enqueue(session, job_type)
        session.commit()
    return job_id


def started(events_file: Path, job_id: uuid.UUID) -> bool:
    return events_file.exists() and f"start {job_id} " in events_file.read_text()


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    running: list[subprocess.Popen[str]] = []
    try:
        yield running
    finally:
        for process in running:
            if process.poll() is None:
                process.kill()
            process.communicate(timeout=10)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_signal_lets_the_running_job_finish_prints_a_summary_and_exits_by_the_signal(
    database: Any,
    engine: sa.Engine,
    tmp_path: Path,
    processes: list[subprocess.Popen[str]],
    signum: signal.Signals,
) -> None:
    slow = enqueue(engine, "slow")
    waiting = enqueue(engine, "quick")
    events_file = tmp_path / "events.log"
    url = database.url.render_as_string(hide_password=False)
    process = subprocess.Popen(
        [
            *(sys.executable, str(PROGRAM), url, str(events_file), "--signals"),
            *("--hang-type", "slow", "--hang-seconds", "1.0"),
            # The exit runs the atexit hooks off the main thread, slowly, while the main
            # thread has already returned: the interpreter must wait for it, not end with 0.
            *("--slow-exit-hook", "0.5"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    processes.append(process)
    deadline = time.monotonic() + 30
    while not started(events_file, slow):
        assert process.poll() is None, process.communicate()[1]
        assert time.monotonic() < deadline, "the worker never started the job"
        time.sleep(0.02)

    process.send_signal(signum)
    _, stderr = process.communicate(timeout=30)

    assert process.returncode == -signum, stderr
    assert f"test-worker-{process.pid} stopped: 1 succeeded, 0 retried, 0 failed" in stderr
    assert f"end {slow} " in events_file.read_text(), "the running job did not finish"
    with engine.connect() as conn:
        archived = conn.execute(sa.select(statements.ARCHIVE)).all()
        queued = conn.execute(sa.select(statements.JOB.c.job_id)).scalars().all()
        runs = conn.execute(sa.select(statements.RUN)).all()
    assert [(row.job_id, row.status) for row in archived] == [(slow, "success")]
    assert queued == [waiting], "the worker took a new job after the signal"
    assert runs == []
