"""The views read from a real PostgreSQL streaming standby: ``status``, ``jobs`` and
``failed`` with ``--read-url`` show what the primary committed once the standby replayed it,
under a line that says how far the standby lags; the lag is counted in bytes and seconds
while replay is paused and drops to nothing once it resumes; the dashboard reads the
standby and its actions write to the primary."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from datetime import timedelta
from typing import Any

import sqlalchemy as sa
from replica_support import Replicated, set_replay, wait_for
from werkzeug.datastructures import MultiDict
from werkzeug.test import Client

import sqla_proletarian as sp
from sqla_proletarian import statements
from sqla_proletarian.dashboard import create_dashboard

#: "replica lag: 1234 bytes, 0.0s (PostgreSQL standby)"
STANDBY_LAG = re.compile(r"replica lag: \d+ bytes, \d+\.\ds \(PostgreSQL standby\)")
_TOKEN = re.compile(r'name="csrf_token" value="([0-9a-f]{64})"')


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """The command line, given no primary URL (no --url, no DATABASE_URL)."""
    env = dict(os.environ)
    env.pop("DATABASE_URL", None)
    return subprocess.run(
        [sys.executable, "-m", "sqla_proletarian", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


def url_text(url: sa.URL) -> str:
    return url.render_as_string(hide_password=False)


def enqueue(engine: sa.Engine, **kw: Any) -> uuid.UUID:
    with engine.begin() as conn:
        return sp.enqueue(conn, "work", **kw)


def archive_failure(engine: sa.Engine) -> uuid.UUID:
    now = sp.utc_now()
    job_id = uuid.uuid4()
    with engine.begin() as conn:
        conn.execute(
            sa.insert(statements.ARCHIVE),
            {
                "job_id": job_id,
                "queue": "mail",
                "job_type": "send",
                "payload": "{}",
                "attempts": 1,
                "enqueued_at": now - timedelta(seconds=2),
                "process_at": now - timedelta(seconds=2),
                "status": "failure",
                "finished_at": now,
                "error": "RuntimeError: send",
            },
        )
    return job_id


def test_cli_views_on_the_standby_show_the_primarys_jobs_once_replayed_under_a_lag_line(
    replicated: Replicated,
) -> None:
    queued = enqueue(replicated.primary, queue="mail")
    failed = archive_failure(replicated.primary)
    replicated.replayed()
    standby = url_text(replicated.standby_url)

    status = cli("status", "--read-url", standby)
    jobs = cli("jobs", "--read-url", standby)
    failures = cli("failed", "--read-url", standby)

    for done in (status, jobs, failures):
        assert done.returncode == 0, done.stderr
        assert STANDBY_LAG.fullmatch(done.stdout.splitlines()[0]), done.stdout
    assert status.stdout.splitlines()[1].startswith("QUEUE") and "mail" in status.stdout
    assert str(queued) in jobs.stdout and str(failed) in failures.stdout
    lag = json.loads(cli("status", "--json", "--read-url", standby).stdout)["replica_lag"]
    assert lag["role"] == "standby" and lag["bytes"] >= 0 and lag["seconds"] >= 0


def test_lag_counts_bytes_and_seconds_while_replay_is_paused_and_nothing_once_resumed(
    replicated: Replicated,
) -> None:
    """Replay paused, a job committed on the primary: the standby has received its WAL
    (synchronous replication) but not replayed it, so the lag is some bytes and the seconds
    since its last replayed commit, and the standby's views do not show the job yet.
    Resumed: the lag is 0 bytes and 0 seconds, and the job is there."""
    standby = url_text(replicated.standby_url)
    set_replay(replicated.standby, paused=True)
    queued = enqueue(replicated.primary, queue="mail")

    def lagging() -> sp.ReplicaLag | None:
        lag = sp.replica_lag(replicated.standby)
        return lag if lag.bytes and lag.seconds else None

    wait_for(lagging, "the standby to have received WAL it has not replayed")
    lag = sp.replica_lag(replicated.standby)
    assert lag.role == "standby" and lag.bytes is not None and lag.bytes > 0
    assert lag.seconds is not None and lag.seconds > 0
    paused = cli("jobs", "--read-url", standby)
    assert paused.returncode == 0, paused.stderr
    assert STANDBY_LAG.fullmatch(paused.stdout.splitlines()[0])
    assert str(queued) not in paused.stdout

    set_replay(replicated.standby, paused=False)
    replicated.replayed()

    assert sp.replica_lag(replicated.standby) == sp.ReplicaLag("standby", bytes=0, seconds=0.0)
    resumed = cli("jobs", "--read-url", standby)
    assert resumed.stdout.splitlines()[0] == "replica lag: 0 bytes, 0.0s (PostgreSQL standby)"
    assert str(queued) in resumed.stdout


def test_dashboard_reading_the_standby_renders_and_its_actions_write_to_the_primary(
    replicated: Replicated,
) -> None:
    """Every page reads the standby (which refuses writes: it is in recovery) and says how
    far it lags; retrying a failure puts it back in the primary's queue."""
    failed = archive_failure(replicated.primary)
    replicated.replayed()
    client = Client(create_dashboard(replicated.primary, read_engine=replicated.standby))

    page = client.get("/")
    text = page.get_data(as_text=True)
    assert page.status_code == 200, text
    assert STANDBY_LAG.search(text) and 'id="replica-lag"' in text
    overview = client.get("/api/overview").json
    assert overview is not None and overview["replica_lag"]["role"] == "standby"
    listed = client.get("/jobs?state=failed").get_data(as_text=True)
    assert str(failed) in listed

    token = _TOKEN.search(listed)
    assert token is not None
    form = [("job_id", str(failed)), ("next", "/"), ("csrf_token", token.group(1))]
    done = client.post("/actions/retry", data=MultiDict([*form, ("confirm", "yes")]))
    assert done.status_code == 303, done.get_data(as_text=True)
    with replicated.primary.connect() as conn:
        back = conn.execute(sa.select(statements.JOB.c.job_id)).scalars().all()
    assert back == [failed]
    replicated.replayed()
    after = client.get(done.headers["Location"]).get_data(as_text=True)
    assert "1 failed job(s) put back in the queue" in after
