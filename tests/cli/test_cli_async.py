"""Async applications on the command line, run as subprocesses on every backend and async
driver installed: the commands that read and write the tables take an async URL (through
its sync twin), and ``worker`` runs ``async def`` handlers in the asyncio worker (on the
async URL, or on a sync URL's async twin), sync handlers in the threaded one, with the same
flags and the same graceful stop on SIGTERM."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import sqlalchemy as sa
from cli_support import (
    archived,
    assert_finished_only_the_first,
    cli,
    events,
    rows,
    run_until_sigterm,
    url_of,
    write_tasks,
)

import sqla_proletarian as sp
from sqla_proletarian import statements
from sqla_proletarian.supervisor import EXIT_JOBS_FAILED

if TYPE_CHECKING:
    from conftest import Database

#: Each backend's async drivers (the drivername, and the module it needs), where installed.
_PAIRS = [
    (backend, drivername)
    for backend, drivername, module in (
        ("sqlite", "sqlite+aiosqlite", "aiosqlite"),
        ("postgresql", "postgresql+asyncpg", "asyncpg"),
        ("postgresql", "postgresql+psycopg_async", "psycopg"),
        ("mariadb", "mysql+aiomysql", "aiomysql"),
    )
    if backend in os.environ.get("SP_TEST_BACKENDS", "sqlite,postgresql,mariadb").split(",")
    and importlib.util.find_spec(module) is not None
]
#: Runs a test once per installed async driver of each backend, with its drivername.
EVERY_DRIVER = pytest.mark.parametrize(
    ("empty_database", "drivername"),
    _PAIRS,
    indirect=["empty_database"],
    ids=[drivername for _, drivername in _PAIRS],
)
#: Each backend's first async driver.
FIRST_DRIVER = dict(reversed(_PAIRS))

#: Handlers that are ``async def``: each awaits, then notes its run as tasks.py's do.
ASYNC_TASKS = """\
import asyncio
import os

import sqla_proletarian as sp

handlers = sp.JobHandlers()


def note(what, job_id):
    with open("events.log", "a") as events:
        events.write(f"{what} {os.getpid()} {job_id}\\n")


@handlers.register("ok")
async def ok(job):
    await asyncio.sleep(0)
    note("end", job.job_id)


@handlers.register("fails")
async def fails(job):
    await asyncio.sleep(0)
    raise ValueError(f"no good: {job.payload}")


@handlers.register("slow")
async def slow(job):
    note("start", job.job_id)
    await asyncio.sleep(job.payload["seconds"])
    note("end", job.job_id)


async def by_type(job_type, payload):
    await asyncio.sleep(0)
    note("end", payload["id"])
"""


def async_url(database: Database, drivername: str | None = None) -> str:
    """The test database's URL through ``drivername``, or its backend's first async one."""
    if drivername is None:
        if database.backend not in FIRST_DRIVER:
            pytest.skip(f"no async driver of {database.backend} is installed")
        drivername = FIRST_DRIVER[database.backend]
    return database.url.set(drivername=drivername).render_as_string(hide_password=False)


def assert_clean(done: subprocess.CompletedProcess[str], status: int = 0) -> None:
    """The command ended with ``status``, and said nothing of coroutines or greenlets."""
    assert done.returncode == status, (done.stdout, done.stderr)
    for words in ("RuntimeWarning", "greenlet", "never awaited", "Traceback"):
        assert words not in done.stderr, done.stderr


def write_async_tasks(directory: Path) -> None:
    (directory / "atasks.py").write_text(ASYNC_TASKS)


@EVERY_DRIVER
def test_the_tables_commands_take_an_async_url(database: Database, drivername: str) -> None:
    """enqueue and status through an async URL: both connect with its sync twin (so do the
    other commands, by the same function), with no coroutine warning or greenlet error."""
    url = async_url(database, drivername)

    enqueued = cli("enqueue", "ok", '{"n": 1}', "--url", url)
    status = cli("status", "--json", "--url", url)

    assert_clean(enqueued)
    assert_clean(status)
    [queue] = json.loads(status.stdout)["queues"]
    assert (queue["queue"], queue["ready"]) == ("default", 1)
    [job] = rows(database.engine(), statements.JOB)
    assert str(job.job_id) == enqueued.stdout.strip()


@EVERY_DRIVER
def test_async_handlers_run_in_the_asyncio_worker_on_an_async_url(
    database: Database, drivername: str, tmp_path: Path
) -> None:
    """An async URL and a JobHandlers of ``async def``: --burst --threads 2 runs every job
    (the tasks as many as --threads), a failure is archived with the handler's own frame."""
    engine = database.engine()
    write_async_tasks(tmp_path)
    with engine.begin() as conn:
        ok = sp.enqueue(conn, "ok")
        fails = sp.enqueue(conn, "fails")

    worked = cli(
        *("worker", "atasks:handlers", "--handler-mode", "advanced", "--burst"),
        *("--threads", "2", "--url", async_url(database, drivername)),
        cwd=tmp_path,
    )

    assert_clean(worked, EXIT_JOBS_FAILED)  # a burst with a failure
    assert "proletarian[default] stopped: 1 succeeded, 0 retried, 1 failed" in worked.stderr
    assert [(what, job_id) for what, _, job_id in events(tmp_path)] == [("end", ok)]
    error = archived(engine)[fails].error
    assert error.startswith("ValueError: no good: None")
    assert 'atasks.py", line' in error and "in fails" in error


def test_async_handlers_given_a_sync_url_run_on_its_async_twin(
    database: Database, tmp_path: Path
) -> None:
    """``async def`` handlers with the sync URL (here a plain function, default mode): the
    asyncio worker on the URL's async twin runs them, instead of failing every job."""
    async_url(database)  # skips when the backend has no async driver installed
    engine = database.engine()
    write_async_tasks(tmp_path)
    with engine.begin() as conn:
        job_ids = [sp.enqueue(conn, "any", {"id": str(uuid.uuid4())}) for _ in range(2)]
    payload_ids = sorted(json.loads(row.payload)["id"] for row in rows(engine, statements.JOB))

    worked = cli("worker", "atasks:by_type", "--burst", "--url", url_of(database), cwd=tmp_path)

    assert_clean(worked)
    assert "2 succeeded, 0 retried, 0 failed" in worked.stderr
    assert sorted(str(job_id) for _, _, job_id in events(tmp_path)) == payload_ids
    assert sorted(archived(engine)) == sorted(job_ids)


def test_sync_handlers_given_an_async_url_run_in_the_threaded_worker(
    database: Database, tmp_path: Path
) -> None:
    """Plain handlers with an async URL: the threaded worker on its sync twin runs them."""
    engine = database.engine()
    write_tasks(tmp_path)
    url = async_url(database)
    with engine.begin() as conn:
        ok = sp.enqueue(conn, "ok")

    worked = cli(
        *("worker", "tasks:handlers", "--handler-mode", "advanced", "--burst", "--url", url),
        cwd=tmp_path,
    )

    assert_clean(worked)
    assert "1 succeeded, 0 retried, 0 failed" in worked.stderr
    assert [(what, job_id) for what, _, job_id in events(tmp_path)] == [("end", ok)]


def test_the_asyncio_worker_stops_gracefully_on_sigterm_and_exits_by_the_signal(
    tmp_path: Path,
) -> None:
    """As the threaded worker does: the running job finishes, no other starts, the summary
    is printed and the process ends by SIGTERM (on SQLite through aiosqlite: the signal
    handling is the same on every backend)."""
    if "sqlite" not in FIRST_DRIVER:
        pytest.skip("aiosqlite is not installed")
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'app.db'}")
    sp.metadata.create_all(engine)
    write_async_tasks(tmp_path)
    with engine.begin() as conn:
        first = sp.enqueue(conn, "slow", {"seconds": 0.5})
        second = sp.enqueue(conn, "slow", {"seconds": 0.5})
    status, stderr = run_until_sigterm(
        ["worker", "atasks:handlers", "--handler-mode", "advanced"],
        tmp_path,
        {**os.environ, "DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 'app.db'}"},
    )

    assert_finished_only_the_first(status, stderr, tmp_path, first)
    assert "SIGTERM received, finishing running jobs" in stderr
    assert [row.job_id for row in rows(engine, statements.JOB)] == [second]
    engine.dispose()
