"""Reading the views from another engine (a replica): the dashboard's ``read_engine=`` and
the commands' ``--read-url`` read there and nowhere else, the dashboard's actions still
write through the primary engine, and every view says how far the read server lags
(``replica_lag``; here the read server is the primary itself: "not a replica").

The read engine is the test's database opened read-only (PostgreSQL
``default_transaction_read_only``, MariaDB ``SET SESSION TRANSACTION READ ONLY``, SQLite
``mode=ro``), so a write sent there fails, and it counts the statements it runs.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL, make_url
from werkzeug.datastructures import MultiDict
from werkzeug.test import Client

import sqla_proletarian as sp
from sqla_proletarian import statements
from sqla_proletarian.dashboard import create_dashboard
from sqla_proletarian.replicas import ReplicaLag

if TYPE_CHECKING:
    from conftest import Database

CLI_ENV = {"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {}
_TOKEN = re.compile(r'name="csrf_token" value="([0-9a-f]{64})"')
#: MariaDB: an account on any host (``%`` doubled for the driver's parameter style).
ANY_HOST = "%%"


def read_only_url(database: Database) -> URL:
    """The test's database, opened read-only: a write through it fails."""
    url = database.url
    if database.backend == "postgresql":
        return url.update_query_dict({"options": "-c default_transaction_read_only=on"})
    if database.backend == "mariadb":
        return url.update_query_dict({"init_command": "SET SESSION TRANSACTION READ ONLY"})
    return make_url(f"sqlite:///file:{url.database}?mode=ro&uri=true")


class Counted:
    """The statements an engine ran since the last ``reset``."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.statements: list[str] = []
        sa.event.listen(engine, "before_cursor_execute", self._note)

    def _note(self, conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        self.statements.append(statement)

    def reset(self) -> None:
        self.statements.clear()


@pytest.fixture
def primary(engine: sa.Engine) -> Counted:
    return Counted(engine)


@pytest.fixture
def reader(database: Database) -> Iterator[Counted]:
    engine = sa.create_engine(read_only_url(database))
    try:
        yield Counted(engine)
    finally:
        engine.dispose()


def enqueue(engine: sa.Engine, job_type: str = "work", **kw: Any) -> uuid.UUID:
    with engine.begin() as conn:
        return sp.enqueue(conn, job_type, **kw)


def archive_failure(engine: sa.Engine, queue: str = "mail") -> uuid.UUID:
    """A failure in the archive, as a worker writes it."""
    now = sp.utc_now()
    job_id = uuid.uuid4()
    with engine.begin() as conn:
        conn.execute(
            sa.insert(statements.ARCHIVE),
            {
                "job_id": job_id,
                "queue": queue,
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


def queued_ids(engine: sa.Engine) -> set[uuid.UUID]:
    with engine.connect() as conn:
        return set(conn.execute(sa.select(statements.JOB.c.job_id)).scalars())


class Browser:
    """A test client that keeps its cookies and sends forms with the last page's token."""

    def __init__(self, app: Any) -> None:
        self.client = Client(app)
        self.page = ""

    def get(self, path: str) -> Any:
        response = self.client.get(path)
        assert response.status_code == 200, (path, response.get_data(as_text=True))
        if response.mimetype == "text/html":
            self.page = response.get_data(as_text=True)
        return response

    def act(self, action: str, **fields: str) -> str:
        """Send an action, confirm it, and return the page it ends on."""
        found = _TOKEN.search(self.page)
        assert found is not None, "the page has no form"
        form = MultiDict([*fields.items(), ("next", "/"), ("csrf_token", found.group(1))])
        asked = self.client.post(f"/actions/{action}", data=form)
        assert asked.status_code == 200, asked.get_data(as_text=True)
        form.add("confirm", "yes")
        done = self.client.post(f"/actions/{action}", data=form)
        assert done.status_code == 303, done.get_data(as_text=True)
        return str(self.get(done.headers["Location"]).get_data(as_text=True))


def test_dashboard_pages_read_through_read_engine_and_actions_write_through_engine(
    primary: Counted, reader: Counted
) -> None:
    """Every page reads through ``read_engine`` only (not one statement on the primary
    engine), says how far it lags, and retry, pause, resume and cancel write through the
    primary engine (the read engine is read-only: a write there would fail the action).
    Without ``read_engine``, the pages say nothing of replicas."""
    with pytest.raises(sa.exc.DBAPIError), reader.engine.begin() as conn:
        sp.enqueue(conn, "work")
    plain = Browser(create_dashboard(primary.engine)).get("/").get_data(as_text=True)
    assert 'id="replica-lag"' not in plain and "not a replica" not in plain
    failed = archive_failure(primary.engine)
    queued = enqueue(primary.engine, queue="mail")
    app = create_dashboard(primary.engine, read_engine=reader.engine)
    browser = Browser(app)
    primary.reset()

    overview = browser.get("/").get_data(as_text=True)
    data = browser.get("/api/overview").json
    failures = browser.get("/jobs?state=failed").get_data(as_text=True)
    job_page = browser.get(f"/jobs/{queued}").get_data(as_text=True)

    assert primary.statements == []
    assert reader.statements
    assert '<tr data-queue="mail">' in overview
    assert 'id="replica-lag"' in overview and "not a replica" in overview
    assert data is not None and data["replica_lag"]["role"] == "primary"
    assert str(failed) in failures and str(queued) in job_page

    browser.get("/")
    page = browser.act("retry", job_id=str(failed))
    assert "1 failed job(s) put back in the queue" in page
    assert failed in queued_ids(primary.engine)
    assert any("proletarian_job" in statement for statement in primary.statements)

    page = browser.act("pause", queue="mail")
    assert "Queue mail paused" in page
    with primary.engine.connect() as conn:
        assert sp.paused_queues(conn) == {"mail"}
    browser.act("resume", queue="mail")
    with primary.engine.connect() as conn:
        assert sp.paused_queues(conn) == set()
    page = browser.act("cancel", job_id=str(queued))
    assert f"Job {queued} cancelled." in page
    assert queued not in queued_ids(primary.engine)


def test_create_dashboard_refuses_a_read_engine_that_is_not_an_engine(engine: sa.Engine) -> None:
    with pytest.raises(sp.ConfigurationError, match="read_engine: give a sqlalchemy Engine"):
        create_dashboard(engine, read_engine="postgresql://replica/app")  # type: ignore[arg-type]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """The command with no primary URL at all (no --url, no DATABASE_URL)."""
    env = {**os.environ, **CLI_ENV}
    env.pop("DATABASE_URL", None)
    return subprocess.run(
        [sys.executable, "-m", "sqla_proletarian", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


def test_status_jobs_and_failed_read_from_read_url_alone_and_say_the_lag_first(
    database: Database, primary: Counted
) -> None:
    """``--read-url`` is all the read commands need (no primary URL is given): they show
    the jobs, with a line above saying how far the read server lags, and the JSON objects
    carry it as ``replica_lag``; ``jobs --json`` (a list) says it on standard error.
    Without ``--read-url`` they say nothing of replicas."""
    failed = archive_failure(primary.engine)
    queued = enqueue(primary.engine, queue="mail")
    read_url = read_only_url(database).render_as_string(hide_password=False)
    url = database.url.render_as_string(hide_password=False)
    plain = run_cli("status", "--url", url)
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.splitlines()[0].startswith("QUEUE")
    assert "replica_lag" not in json.loads(run_cli("status", "--json", "--url", url).stdout)

    status = run_cli("status", "--read-url", read_url)
    jobs = run_cli("jobs", "--read-url", read_url)
    failures = run_cli("failed", "--read-url", read_url)

    for done in (status, jobs, failures):
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines()[0] == "not a replica: reading from the primary"
    assert status.stdout.splitlines()[1].startswith("QUEUE")
    assert "mail" in status.stdout and str(queued) in jobs.stdout and str(failed) in failures.stdout

    status_json = json.loads(run_cli("status", "--json", "--read-url", read_url).stdout)
    failed_json = json.loads(run_cli("failed", "--json", "--read-url", read_url).stdout)
    jobs_json = run_cli("jobs", "--json", "--read-url", read_url)
    assert status_json["replica_lag"]["role"] == "primary"
    assert [row["queue"] for row in status_json["queues"]] == ["mail"]
    assert failed_json["replica_lag"]["text"] == "not a replica: reading from the primary"
    assert [job["job_id"] for job in json.loads(jobs_json.stdout)] == [str(queued)]
    assert "not a replica" in jobs_json.stderr


def test_dashboard_command_with_read_url_serves_pages_read_there_with_the_lag(
    database: Database, primary: Counted
) -> None:
    """``sqla-proletarian dashboard --read-url``: the pages say how far the read server
    lags (here: not a replica), and the command says it reads from there."""
    enqueue(primary.engine, queue="mail")
    read_url = read_only_url(database).render_as_string(hide_password=False)
    url = database.url.render_as_string(hide_password=False)
    command = ["dashboard", "--url", url, "--port", "0", "--read-url", read_url]
    process = subprocess.Popen(
        [sys.executable, "-m", "sqla_proletarian", *command],
        env={**os.environ, **CLI_ENV},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("dashboard at http://127.0.0.1:"), line
        assert "reading from --read-url" in line
        with urllib.request.urlopen(line.split()[2].rstrip(";"), timeout=30) as response:
            page = response.read().decode()
        assert 'id="replica-lag"' in page and "not a replica" in page
        assert '<tr data-queue="mail">' in page
        process.send_signal(signal.SIGINT)
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stdout.close()  # type: ignore[union-attr]


def test_replica_lag_of_a_primary_says_not_a_replica_and_leaves_a_transaction_usable(
    engine: sa.Engine,
) -> None:
    """On every backend's primary (SQLite has no replicas): role ``primary``; called with a
    Connection inside a transaction, the transaction goes on."""
    assert sp.replica_lag(engine) == ReplicaLag("primary")
    with engine.begin() as conn:
        sp.enqueue(conn, "work")
        assert sp.replica_lag(conn).describe() == "not a replica: reading from the primary"
        assert conn.execute(sa.select(sa.func.count()).select_from(statements.JOB)).scalar() == 1


def test_replica_lag_that_cannot_be_read_is_unknown_with_the_reason() -> None:
    """A read server that cannot be reached: no error, a lag unknown that says why."""
    unreachable = sa.create_engine(
        "postgresql+psycopg://nobody@127.0.0.1:1/none", connect_args={"connect_timeout": 5}
    )
    lag = sp.replica_lag(unreachable)
    assert lag.role == "unknown" and lag.reason
    assert lag.describe().startswith("lag unknown: ")


@pytest.fixture
def refused_url(database: Database) -> Iterator[URL]:
    """A role that may read the library's tables but not the server's replication state
    (PostgreSQL: EXECUTE on pg_is_in_recovery() revoked in this database; MariaDB: no
    SLAVE MONITOR privilege)."""
    if database.backend == "sqlite":
        pytest.skip("SQLite has no roles nor replication")
    name, password = f"sp_lag_{uuid.uuid4().hex[:12]}", "lag-password"
    admin = database.engine(isolation_level="AUTOCOMMIT")
    tables = [table.name for table in sp.metadata.sorted_tables]
    with admin.connect() as conn:
        if database.backend == "postgresql":
            conn.exec_driver_sql(f"CREATE ROLE {name} LOGIN PASSWORD '{password}'")
            conn.exec_driver_sql(f"GRANT SELECT ON {', '.join(tables)} TO {name}")
            conn.exec_driver_sql("REVOKE EXECUTE ON FUNCTION pg_is_in_recovery() FROM PUBLIC")
        else:
            conn.exec_driver_sql(f"CREATE USER '{name}'@'{ANY_HOST}' IDENTIFIED BY '{password}'")
            conn.exec_driver_sql(f"GRANT SELECT ON {database.url.database}.* TO '{name}'@'%%'")
    try:
        yield database.url.set(username=name, password=password)
    finally:
        with admin.connect() as conn:
            if database.backend == "postgresql":
                conn.exec_driver_sql("GRANT EXECUTE ON FUNCTION pg_is_in_recovery() TO PUBLIC")
                conn.exec_driver_sql(f"DROP OWNED BY {name}")
                conn.exec_driver_sql(f"DROP ROLE {name}")
            else:
                conn.exec_driver_sql(f"DROP USER IF EXISTS '{name}'@'{ANY_HOST}'")


def test_views_on_a_read_role_refused_the_lag_show_lag_unknown_and_go_on(
    refused_url: URL, primary: Counted
) -> None:
    """A read role the server refuses the replication functions to: ``status`` and the
    dashboard still show the queues, with "lag unknown" and the server's reason; read
    through the caller's connection, the refusal leaves its transaction usable."""
    enqueue(primary.engine, queue="mail")
    reader = sa.create_engine(refused_url)
    try:
        lag = sp.replica_lag(reader)
        assert lag.role == "unknown"
        assert re.search(r"permission denied|SLAVE MONITOR|REPLICA MONITOR", lag.reason or "")
        count = sa.select(sa.func.count()).select_from(statements.JOB)
        with reader.connect() as conn:
            assert conn.execute(count).scalar() == 1  # the caller's transaction begins
            assert sp.replica_lag(conn).role == "unknown"
            assert conn.execute(count).scalar() == 1  # and is still usable

        done = run_cli("status", "--read-url", refused_url.render_as_string(hide_password=False))
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"lag unknown: {lag.reason}\nQUEUE")
        assert "mail" in done.stdout

        page = Browser(create_dashboard(primary.engine, read_engine=reader)).get("/")
        text = page.get_data(as_text=True)
        assert "lag unknown: " in text and '<tr data-queue="mail">' in text
    finally:
        reader.dispose()
