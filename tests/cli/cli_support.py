"""Running the installed ``sqla-proletarian`` console script, and reading the tables back."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from sqla_proletarian import statements

if TYPE_CHECKING:
    from conftest import Database

#: The console script of this venv (beside its python), else the one on PATH.
_BESIDE = Path(sys.executable).with_name("sqla-proletarian")
CLI = str(_BESIDE) if _BESIDE.exists() else shutil.which("sqla-proletarian") or "sqla-proletarian"

#: A handler module for the commands' tests: ``ok`` succeeds, ``fails`` raises, ``slow``
#: takes a while; every run is noted in ``events.log`` as ``start|end <pid> <job id>``.
TASKS = """\
import os
import time

import sqla_proletarian as sp

handlers = sp.JobHandlers()


def note(what, job):
    with open("events.log", "a") as events:
        events.write(f"{what} {os.getpid()} {job.job_id}\\n")


@handlers.register("ok")
def ok(job):
    note("end", job)


@handlers.register("fails")
def fails(job):
    raise ValueError(f"no good: {job.payload}")


@handlers.register("slow")
def slow(job):
    note("start", job)
    time.sleep(job.payload["seconds"])
    note("end", job)


def create_handlers():
    return handlers
"""


#: The package under test, for processes started with an environment of their own.
PACKAGE_ENV = {"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {}


def url_of(database: Database) -> str:
    return database.url.render_as_string(hide_password=False)


def write_tasks(directory: Path) -> Path:
    (directory / "tasks.py").write_text(TASKS)
    return directory


def cli(
    *args: str, cwd: Path | None = None, timeout: float = 60, **env: str
) -> subprocess.CompletedProcess[str]:
    """Run the console script to its end, capturing its output."""
    return subprocess.run(
        [CLI, *args],
        cwd=cwd,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def assert_one_line_error(done: subprocess.CompletedProcess[str], status: int) -> str:
    """The command failed with ``status``, saying so in one line and no traceback."""
    assert done.returncode == status, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("sqla-proletarian"), lines[0]
    return lines[0]


def events(directory: Path) -> list[tuple[str, int, uuid.UUID]]:
    """The handler runs noted so far: (start|end, pid, job id)."""
    path = directory / "events.log"
    if not path.exists():
        return []
    noted = []
    for line in path.read_text().splitlines():
        what, pid, job_id = line.split()
        noted.append((what, int(pid), uuid.UUID(job_id)))
    return noted


def run_until_sigterm(args: list[str], cwd: Path, env: dict[str, str]) -> tuple[int, str]:
    """Run the console script until its first job starts (in ``events.log``), then send it
    SIGTERM: its exit status and standard error."""
    process = subprocess.Popen([CLI, *args], cwd=cwd, env=env, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: events(cwd), "the first job to start")
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    return process.returncode, stderr


def assert_finished_only_the_first(
    status: int, stderr: str, directory: Path, first: uuid.UUID
) -> None:
    """After ``run_until_sigterm``: the process ended by SIGTERM after its summary, and the
    running job ``first`` finished while no other started."""
    assert status == -signal.SIGTERM, stderr
    assert "proletarian[default] stopped: 1 succeeded, 0 retried, 0 failed" in stderr
    assert [(what, job_id) for what, _, job_id in events(directory)] == [
        ("start", first),
        ("end", first),
    ]


def wait_until(predicate: Callable[[], Any], what: str, timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def rows(engine: sa.Engine, table: sa.Table) -> list[sa.Row[Any]]:
    with engine.connect() as conn:
        return list(conn.execute(sa.select(table)).all())


def archived(engine: sa.Engine) -> dict[uuid.UUID, sa.Row[Any]]:
    return {row.job_id: row for row in rows(engine, statements.ARCHIVE)}
