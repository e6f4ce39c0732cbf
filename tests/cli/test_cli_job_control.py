"""The job-control commands through the console script: pause, resume, cancel; enqueue with a
priority and a unique key; status showing paused queues and counts by priority; periodic
jobs declared in the handler's module."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cli_support import archived, cli, events, url_of, write_tasks

import sqla_proletarian as sp

if TYPE_CHECKING:
    from conftest import Database


def status_of(url: str) -> dict[str, dict[str, Any]]:
    done = cli("status", "--json", "--url", url)
    assert done.returncode == 0, done.stderr
    return {queue["queue"]: queue for queue in json.loads(done.stdout)["queues"]}


def test_pause_resume_cancel_priorities_and_unique_keys_from_the_command_line(
    database: Database, tmp_path: Path
) -> None:
    """A paused queue is shown paused and a burst worker claims nothing from it; resumed,
    the worker runs the higher priority first; a unique key enqueued twice gives one job and
    the same id; a cancelled job is archived as cancelled and a second cancel fails."""
    url = url_of(database)
    write_tasks(tmp_path)

    def enqueue(*args: str) -> uuid.UUID:
        done = cli("enqueue", *args, "--url", url)
        assert done.returncode == 0, done.stderr
        return uuid.UUID(done.stdout.strip())

    low = enqueue("ok", "--priority", "-3")
    high = enqueue("ok", "--priority", "7")
    keyed = enqueue("ok", "--unique-key", "nightly")
    assert enqueue("ok", "--unique-key", "nightly") == keyed
    doomed = enqueue("ok", "--queue", "other")

    paused = cli("pause", "default", "--url", url)
    assert paused.returncode == 0, paused.stderr
    queues = status_of(url)
    assert queues["default"]["paused"] is True and queues["other"]["paused"] is False
    assert queues["default"]["by_priority"] == {"7": 1, "0": 1, "-3": 1}
    if database.backend == "sqlite":
        table = cli("status", "--url", url).stdout.splitlines()
        assert table[0].split()[-3:] == ["PAUSED", "BY", "PRIORITY"]
        default_row = next(line for line in table if line.startswith("default"))
        assert default_row.split()[-4:] == ["paused", "7:1", "0:1", "-3:1"]

    idle = cli(
        "worker",
        "tasks:handlers",
        "--handler-mode",
        "advanced",
        "--burst",
        "--url",
        url,
        cwd=tmp_path,
    )
    assert idle.returncode == 0, idle.stderr
    assert events(tmp_path) == []

    cancelled = cli("cancel", str(doomed), "--url", url)
    assert cancelled.returncode == 0, cancelled.stderr
    again = cli("cancel", str(doomed), "--url", url)
    assert again.returncode == 1 and "was not cancelled" in again.stderr
    assert archived(database.engine())[doomed].status == "cancelled"

    assert cli("resume", "default", "--url", url).returncode == 0
    assert status_of(url)["default"]["paused"] is False
    worked = cli(
        "worker",
        "tasks:handlers",
        "--handler-mode",
        "advanced",
        "--burst",
        "--url",
        url,
        cwd=tmp_path,
    )
    assert worked.returncode == 0, worked.stderr
    assert [job_id for _, _, job_id in events(tmp_path)] == [high, keyed, low]


PERIODIC_TASKS = """\
from datetime import timedelta

import sqla_proletarian as sp

periodic_jobs = [sp.PeriodicJob("beat", every=timedelta(hours=1), name="hourly-beat")]


def handle(job_type, payload):
    pass
"""


def test_the_worker_command_runs_the_periodic_jobs_its_handler_module_declares(
    database: Database, tmp_path: Path
) -> None:
    """``periodic_jobs`` in the handler's module reaches the worker: its schedule is recorded
    at the first look (the next occurrence then comes at the top of the hour)."""
    url = url_of(database)
    (tmp_path / "beats.py").write_text(PERIODIC_TASKS)
    worked = cli("worker", "beats:handle", "--burst", "--url", url, cwd=tmp_path)
    assert worked.returncode == 0, worked.stderr
    table = sp.models.PeriodicSchedule.__table__
    engine = database.engine()
    with engine.connect() as conn:
        names = conn.execute(table.select()).all()
    assert [row.name for row in names] == ["hourly-beat"]

    (tmp_path / "broken.py").write_text("periodic_jobs = 3\ndef handle(t, p): pass\n")
    broken = cli("worker", "broken:handle", "--burst", "--url", url, cwd=tmp_path)
    assert broken.returncode == 2 and "list of sp.PeriodicJob" in broken.stderr
