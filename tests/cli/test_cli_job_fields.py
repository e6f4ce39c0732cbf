"""``jobs --json`` gives each job's ``snoozes`` and ``concurrency_key``, queued or archived."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import sqlalchemy as sa
from cli_support import cli, url_of

import sqla_proletarian as sp

if TYPE_CHECKING:
    from conftest import Database


def listed(url: str, *args: str) -> list[dict[str, object]]:
    done = cli("jobs", "--json", *args, "--url", url)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert isinstance(found, list)
    return found


def test_jobs_json_shows_snoozes_and_the_concurrency_key(database: Database) -> None:
    """A job snoozed once is listed as scheduled with snoozes 1 and its key; once it
    succeeded, the archived job shows the same; a job without a key shows null."""
    url = url_of(database)
    engine: sa.Engine = database.engine()
    with engine.begin() as conn:
        keyed = sp.enqueue(conn, "sync", None, concurrency_key="tenant-42")
    runs: list[int] = []

    def handler(job_type: str, payload: object) -> None:
        runs.append(1)
        if len(runs) == 1:
            raise sp.Snooze(3600)

    assert sp.process_next_job(engine, handler)
    with engine.begin() as conn:
        plain = sp.enqueue(conn, "other", None)
    queued = {job["job_id"]: job for job in listed(url)}
    assert (queued[str(keyed)]["state"], queued[str(keyed)]["snoozes"]) == ("scheduled", 1)
    assert queued[str(keyed)]["concurrency_key"] == "tenant-42"
    assert (queued[str(plain)]["snoozes"], queued[str(plain)]["concurrency_key"]) == (0, None)

    with engine.begin() as conn:
        assert sp.cancel_job(conn, keyed)
    [cancelled] = listed(url, "--state", "cancelled")
    assert (cancelled["snoozes"], cancelled["concurrency_key"]) == (1, "tenant-42")
