"""The console script's commands, run as subprocesses on every backend: enqueue, status,
worker --burst, failed, retry-failed and prune do what the Python functions under them do,
and bad input gets one line on standard error and a non-zero status, never a traceback."""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import sqlalchemy as sa
from cli_support import (
    PACKAGE_ENV,
    archived,
    assert_finished_only_the_first,
    assert_one_line_error,
    cli,
    events,
    rows,
    run_until_sigterm,
    url_of,
    write_tasks,
)

import sqla_proletarian as sp
from sqla_proletarian import statements

if TYPE_CHECKING:
    from conftest import Database


def queues(done: subprocess.CompletedProcess[str]) -> dict[str, dict[str, object]]:
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    assert set(document) == {"queues"}
    return {row["queue"]: row for row in document["queues"]}


def test_enqueue_status_worker_failed_retry_failed_and_prune_work_a_queue_end_to_end(
    database: Database, tmp_path: Path
) -> None:
    """Jobs enqueued by the CLI (one due later, through --in), a burst worker that runs the
    due ones, the failure listed with its error and put back with its id and attempts from
    zero, the success pruned; status tells each step (its table once, on SQLite)."""
    url = url_of(database)
    write_tasks(tmp_path)
    engine = database.engine()
    enqueued = cli("enqueue", "ok", '{"n": 1}', "--url", url)
    assert enqueued.returncode == 0, enqueued.stderr
    ok = uuid.UUID(enqueued.stdout.strip())
    failing = uuid.UUID(cli("enqueue", "fails", "[1, 2]", "--url", url).stdout.strip())
    delayed = cli("enqueue", "ok", "--queue", "later", "--in", "2h", "--url", url)
    [later] = [row for row in rows(engine, statements.JOB) if row.queue == "later"]
    assert str(later.job_id) == delayed.stdout.strip()
    assert 7190 < (later.process_at - later.enqueued_at).total_seconds() <= 7200

    worked = cli(
        *("worker", "tasks:handlers", "--handler-mode", "advanced", "--burst"),
        *("--threads", "2", "--url", url),
        cwd=tmp_path,
    )
    assert worked.returncode == 3, worked.stderr  # every job ended, one failed for good
    assert "proletarian[default] stopped: 1 succeeded, 0 retried, 1 failed" in worked.stderr
    assert [(what, job_id) for what, _, job_id in events(tmp_path)] == [("end", ok)]

    listed = cli("failed", "--json", "--url", url)
    assert listed.returncode == 0, listed.stderr
    [failure] = json.loads(listed.stdout)["failed"]
    assert failure["job_id"] == str(failing)
    assert (failure["job_type"], failure["attempts"]) == ("fails", 1)
    assert failure["error"].startswith("ValueError: no good: [1, 2]")
    assert failure["payload"] == "[1,2]"
    if database.backend == "sqlite":
        readable = cli("failed", "--queue", "default", "--url", url)
        _, row, error = readable.stdout.splitlines()[:3]
        assert row.split()[:4] == [str(failing), "default", "fails", "1"]
        assert error.strip() == "ValueError: no good: [1, 2]"
        table = cli("status", "--url", url)
        header, *lines = table.stdout.splitlines()
        assert header.split()[:4] == ["QUEUE", "READY", "SCHEDULED", "RUNNING"]
        assert [line.split() for line in lines] == [
            ["default", "0", "0", "0", "0", "-", "1", "1", "-", "-"],
            ["later", "0", "1", "0", "0", "-", "0", "0", "-", "0:1"],
        ]

    retried = cli("retry-failed", str(failing), str(uuid.uuid4()), "--url", url)
    assert retried.returncode == 0, retried.stderr
    assert retried.stdout.strip() == "1 failed job put back in the queue"
    [queued] = [row for row in rows(engine, statements.JOB) if row.queue == "default"]
    assert (queued.job_id, queued.job_type, queued.attempts) == (failing, "fails", 0)
    assert failing not in archived(engine)

    status = queues(cli("status", "--json", "--url", url))
    assert status["default"]["ready"] == 1
    assert isinstance(status["default"]["oldest_ready_age_s"], float)
    assert status["later"] == {
        "queue": "later",
        "ready": 0,
        "scheduled": 1,
        "running": 0,
        "oldest_ready_age_s": None,
        "succeeded_last_hour": 0,
        "failed_last_hour": 0,
        "paused": False,
        "by_priority": {"0": 1},
        "expired_leases": 0,
        "unhandled_job_types": [],
        "limits": None,
        "waiting": None,
        "waiting_on_dependencies": 0,
    }

    pruned = cli("prune", "--older-than", "0s", "--status", "success", "--url", url)
    assert pruned.returncode == 0, pruned.stderr
    assert pruned.stdout.strip() == "1 archived job deleted"
    assert archived(engine) == {}


def sqlite_engine(directory: Path) -> tuple[str, sa.Engine]:
    """A SQLite database with the library's tables, for what every backend does alike."""
    url = f"sqlite:///{directory / 'app.db'}"
    engine = sa.create_engine(url)
    sp.metadata.create_all(engine)
    return url, engine


def test_a_worker_stops_gracefully_on_sigterm_and_exits_by_the_signal(tmp_path: Path) -> None:
    """The single-process worker uses the worker's signal handling: the running job
    finishes, no other starts, the summary is printed, and the process ends by SIGTERM
    (on SQLite: the signal handling is the same on every backend, see test_signals)."""
    write_tasks(tmp_path)
    url, engine = sqlite_engine(tmp_path)
    with engine.begin() as conn:
        first = sp.enqueue(conn, "slow", {"seconds": 0.5})
        second = sp.enqueue(conn, "slow", {"seconds": 0.5})
    status, stderr = run_until_sigterm(
        ["worker", "tasks:create_handlers()", "--handler-mode", "advanced"],
        tmp_path,
        {"PATH": "/usr/bin:/bin", "DATABASE_URL": url, **PACKAGE_ENV},
    )
    assert_finished_only_the_first(status, stderr, tmp_path, first)
    assert [row.job_id for row in rows(engine, statements.JOB)] == [second]
    engine.dispose()


def test_missing_tables_get_one_line_that_says_to_install(empty_database: Database) -> None:
    """On every backend: no traceback, status 1, and the command that fixes it."""
    missing = assert_one_line_error(cli("status", "--url", url_of(empty_database)), 1)
    assert "tables are missing" in missing and "sqla-proletarian install" in missing


def test_bad_input_gets_one_line_and_a_non_zero_status(tmp_path: Path) -> None:
    """A worker on missing tables, an unreachable server, an unimportable handler, bad
    JSON, a bad duration, no URL: one line that says what to do, no traceback; 2 for what
    the command line got wrong, 1 for the rest."""
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    worker = cli("worker", "tasks:handlers", "--burst", "--url", url, cwd=write_tasks(tmp_path))
    assert "sqla-proletarian install" in assert_one_line_error(worker, 1)

    unreachable = cli("status", "--url", "postgresql+psycopg://nobody@127.0.0.1:9/none")
    assert "cannot connect to the database" in assert_one_line_error(unreachable, 1)
    assert "--url or DATABASE_URL" in unreachable.stderr

    unimportable = cli("worker", "no_such_module:handlers", "--url", url, cwd=tmp_path)
    assert "no module named 'no_such_module'" in assert_one_line_error(unimportable, 2)
    no_attribute = cli("worker", "tasks:nothing", "--url", url, cwd=tmp_path)
    assert "has no attribute 'nothing'" in assert_one_line_error(no_attribute, 2)

    bad_json = cli("enqueue", "ok", "{not json", "--url", url)
    assert "PAYLOAD_JSON is not JSON" in assert_one_line_error(bad_json, 2)

    bad_grace = cli("worker", "tasks:handlers", "--reconnect-grace", "-1", "--url", url)
    assert "reconnect_grace is -1.0" in assert_one_line_error(bad_grace, 2)

    bad_duration = cli("prune", "--older-than", "ten days", "--url", url)
    assert "30d, 12h, 5min, 90m or 45s" in assert_one_line_error(bad_duration, 2)

    no_url = cli("status", DATABASE_URL="")
    assert "DATABASE_URL" in assert_one_line_error(no_url, 2)
    assert sa.inspect(sa.create_engine(url)).get_table_names() == []


def test_the_url_and_log_level_may_come_before_the_command(database: Database) -> None:
    """``sqla-proletarian --url URL status`` works like ``status --url URL``; an option after
    the command wins over the same option before it; an unknown command is one line."""
    url = url_of(database)
    before = cli("--url", url, "status", "--json")
    assert before.returncode == 0, before.stderr
    assert before.stdout == cli("status", "--json", "--url", url).stdout
    overridden = cli("--url", "sqlite:///nowhere/none.db", "status", "--json", "--url", url)
    assert overridden.returncode == 0, overridden.stderr
    unknown = assert_one_line_error(cli("--url", url, "frobnicate"), 2)
    assert unknown.startswith("sqla-proletarian: error: argument COMMAND: invalid choice")


def _read_order(text: str) -> object:
    """The test's own helper, where the handler's failure starts: json.loads inside it."""
    return json.loads(text)


def charge(job_type: str, payload: object) -> None:
    _read_order(str(payload))


def test_failed_shows_the_whole_traceback_and_its_json_carries_it(database: Database) -> None:
    """A failure inside a helper of this module: ``failed`` prints the summary, this file's
    frames and the innermost (json's) under the job's row, and ``failed --json`` has the
    same text in ``error``."""
    engine = database.engine()
    with engine.begin() as conn:
        job_id = sp.enqueue(conn, "charge", "{not json")
    assert sp.process_next_job(engine, charge)
    url = url_of(database)

    listed = cli("failed", "--json", "--url", url)
    readable = cli("failed", "--url", url)

    assert listed.returncode == 0 and readable.returncode == 0, listed.stderr + readable.stderr
    [failure] = json.loads(listed.stdout)["failed"]
    error = failure["error"]
    assert failure["job_id"] == str(job_id)
    assert error.startswith("json.decoder.JSONDecodeError: Expecting property name")
    assert f'File "{__file__}"' in error and "in _read_order" in error and "in charge" in error
    frames = [line.strip() for line in error.splitlines() if line.strip().startswith("File ")]
    assert "decoder.py" in frames[-1], frames
    _, row, *shown = readable.stdout.splitlines()
    assert row.split()[:3] == [str(job_id), "default", "charge"]
    assert [line.removeprefix("    ") for line in shown] == error.splitlines()
