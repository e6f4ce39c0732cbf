"""``jobs --json`` and ``status`` show jobs waiting for their dependencies: ``--state
waiting`` lists them, each job has its ``depends_on``, ``dependents`` and ``progress``, and
``status`` counts them per queue as ``waiting_on_dependencies``, apart from the scheduled."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from cli_support import cli, url_of

import sqla_proletarian as sp

if TYPE_CHECKING:
    from conftest import Database


def listed(url: str, *args: str) -> list[dict[str, Any]]:
    done = cli("jobs", "--json", *args, "--url", url)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert isinstance(found, list)
    return found


def test_jobs_and_status_show_waiting_jobs_their_graph_and_progress(database: Database) -> None:
    url = url_of(database)
    engine: sa.Engine = database.engine()
    with engine.begin() as conn:
        first = sp.enqueue(conn, "first", None)
        then = sp.enqueue(conn, "then", None, depends_on=[first])

    [waiting] = listed(url, "--state", "waiting")
    assert (waiting["job_id"], waiting["state"]) == (str(then), "waiting")
    assert (waiting["depends_on"], waiting["dependents"]) == ([str(first)], [])
    assert (waiting["progress"], waiting["progress_message"]) == (None, None)
    queued = {job["job_id"]: job for job in listed(url)}
    assert queued[str(then)]["state"] == "waiting"  # the queued jobs include the waiting
    assert queued[str(first)]["dependents"] == [str(then)]

    done = cli("status", "--json", "--url", url)
    assert done.returncode == 0, done.stderr
    [queue] = json.loads(done.stdout)["queues"]
    assert (queue["ready"], queue["scheduled"], queue["waiting_on_dependencies"]) == (1, 0, 1)
    table = cli("status", "--url", url)
    assert table.returncode == 0, table.stderr
    assert "WAITING ON DEPS" in table.stdout.splitlines()[0]

    def handler(job_type: str, payload: object) -> None:
        sp.current_job().set_progress(0.5, "halfway")

    assert sp.process_next_job(engine, handler)
    [succeeded] = listed(url, "--state", "succeeded")
    assert (succeeded["progress"], succeeded["progress_message"]) == (0.5, "halfway")
    assert succeeded["dependents"] == [str(then)]
    [ready] = listed(url, "--state", "ready")
    assert (ready["job_id"], ready["depends_on"]) == (str(then), [str(first)])
