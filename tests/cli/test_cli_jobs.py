"""``jobs`` lists the jobs of a state (or the queued ones) as a table or a JSON list, through
``sp.list_jobs``; ``--version``; ``cancel`` of an id it cannot cancel says why and points at
``jobs``; a ``mysql://`` URL without its driver advises the MySQL extra."""

from __future__ import annotations

import importlib.util
import json
import uuid
from typing import TYPE_CHECKING, Any

import pytest
from cli_support import assert_one_line_error, cli, url_of

import sqla_proletarian as sp

if TYPE_CHECKING:
    from conftest import Database


def listed(url: str, *args: str) -> list[dict[str, Any]]:
    done = cli("jobs", "--json", *args, "--url", url)
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    assert isinstance(document, list)
    return document


def fails(job_type: str, payload: Any) -> None:
    raise ValueError("no good")


def test_jobs_lists_a_state_or_the_queued_jobs_as_json_and_as_a_table(database: Database) -> None:
    """Without --state: the queued jobs (ready, then scheduled); --state failed: the archived
    failure; --queue, --job-type and --limit narrow; the table shows each id and state."""
    url = url_of(database)
    engine = database.engine()
    with engine.begin() as conn:
        ready = sp.enqueue(conn, "ok", None, queue="a")
        other = sp.enqueue(conn, "other", None, queue="a")
        later = sp.enqueue(conn, "ok", None, queue="a", process_in=3600)
        failed = sp.enqueue(conn, "ok", None, queue="b")
    assert sp.process_next_job(engine, fails, queue="b")

    queued = listed(url)
    assert [(job["job_id"], job["state"]) for job in queued] == [
        (str(ready), "ready"),
        (str(other), "ready"),
        (str(later), "scheduled"),
    ]
    assert {"job_id", "queue", "job_type", "state", "attempts"} <= set(queued[0])
    assert (queued[0]["queue"], queued[0]["job_type"], queued[0]["attempts"]) == ("a", "ok", 0)
    [failure] = listed(url, "--state", "failed", "--queue", "b")
    assert (failure["job_id"], failure["attempts"]) == (str(failed), 1)
    assert failure["error"].startswith("ValueError: no good")
    assert [job["job_id"] for job in listed(url, "--job-type", "ok", "--limit", "1")] == [
        str(ready)
    ]

    table = cli("jobs", "--queue", "a", "--url", url)
    assert table.returncode == 0, table.stderr
    header, *lines = table.stdout.splitlines()
    assert header.split()[:6] == ["JOB", "ID", "QUEUE", "JOB", "TYPE", "STATE"]
    assert [line.split()[:4] for line in lines] == [
        [str(ready), "a", "ok", "ready"],
        [str(other), "a", "other", "ready"],
        [str(later), "a", "ok", "scheduled"],
    ]
    engine.dispose()


def test_cancel_says_why_a_job_was_not_cancelled_and_points_at_jobs(database: Database) -> None:
    """An unknown id: no such job, see ``jobs`` (not ``failed``, whose archived ids cannot
    be cancelled); an archived job: it has ended; a malformed id: the UUIDs ``jobs`` shows."""
    url = url_of(database)
    engine = database.engine()
    with engine.begin() as conn:
        done = sp.enqueue(conn, "ok", None)
    assert sp.process_next_job(engine, lambda job_type, payload: None)
    unknown = assert_one_line_error(cli("cancel", str(uuid.uuid4()), "--url", url), 1)
    assert "no job has this id; `sqla-proletarian jobs` lists" in unknown
    assert "failed" not in unknown
    ended = assert_one_line_error(cli("cancel", str(done), "--url", url), 1)
    assert "it has ended already (succeeded)" in ended
    malformed = assert_one_line_error(cli("cancel", "not-an-id", "--url", url), 2)
    assert "give the UUIDs `sqla-proletarian jobs` shows" in malformed
    engine.dispose()


def test_version_and_a_mysql_url_without_its_driver() -> None:
    """``--version`` prints the package's version; ``mysql://`` (MySQLdb, not installed) and
    ``mariadb://`` advise the MySQL extra and a mysql+pymysql:// URL, not PostgreSQL's."""
    version = cli("--version")
    assert (version.returncode, version.stdout.strip()) == (0, f"sqla-proletarian {sp.__version__}")
    if importlib.util.find_spec("MySQLdb") is not None:
        pytest.skip("MySQLdb is installed here: a mysql:// URL has its driver")
    for url in ("mysql://app@127.0.0.1:9/app", "mariadb://app@127.0.0.1:9/app"):
        line = assert_one_line_error(cli("status", "--url", url), 1)
        assert "pip install 'sqla-proletarian[mysql]' (PyMySQL)" in line, line
        assert "mysql+pymysql://" in line and "postgresql" not in line, line
