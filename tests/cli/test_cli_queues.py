"""Several queues per worker on the command line, through the installed script on every
backend: a repeated ``--queue`` claims the queues in the order given, in one process and in
several (the supervisor passes every ``--queue`` on); ``queues`` from the handler module's
``worker_options``, overridden by ``--queue``; each named queue that never held a job is
warned about, by the threaded and the asyncio worker alike."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import sqlalchemy as sa
from cli_support import archived, cli, events, rows, url_of, write_tasks
from test_cli_async import assert_clean, async_url, write_async_tasks

import sqla_proletarian as sp
from sqla_proletarian import statements

if TYPE_CHECKING:
    from conftest import Database

WARNING = "has never held a job"

#: A handler module whose worker_options name two queues.
QUEUES_MODULE = """\
import os

worker_options = {"queues": ["mail", "reports"]}


def handle(job_type, payload):
    with open("events.log", "a") as events:
        events.write(f"end {os.getpid()} {payload['id']}\\n")
"""


def enqueue_ok(engine: sa.Engine, queue: str, count: int) -> list[uuid.UUID]:
    with engine.begin() as conn:
        return sp.enqueue_many(conn, [("ok", None)] * count, queue=queue)


def ran_in_order(directory: Path) -> list[uuid.UUID]:
    return [job_id for what, _, job_id in events(directory) if what == "end"]


def queued(engine: sa.Engine) -> list[str]:
    return sorted(row.queue for row in rows(engine, statements.JOB))


def test_a_repeated_queue_flag_claims_the_queues_in_the_order_given(
    database: Database, tmp_path: Path
) -> None:
    url = url_of(database)
    write_tasks(tmp_path)
    engine = database.engine()
    bulk = enqueue_ok(engine, "bulk", 2)
    urgent = enqueue_ok(engine, "urgent", 2)
    enqueue_ok(engine, "other", 1)

    done = cli("worker", "tasks:handlers", "--handler-mode", "advanced", "--queue", "urgent",
               "--queue", "bulk", "--burst", "--url", url, cwd=tmp_path)  # fmt: skip

    assert done.returncode == 0, done.stderr
    assert "proletarian[urgent,bulk] stopped: 4 succeeded" in done.stderr
    assert WARNING not in done.stderr
    assert ran_in_order(tmp_path) == [*urgent, *bulk]
    assert queued(engine) == ["other"]
    engine.dispose()


def test_queue_names_separated_by_commas_are_several_queues_in_that_order(
    database: Database, tmp_path: Path
) -> None:
    """``--queue urgent,bulk`` (as Celery's ``-Q`` takes them) is ``--queue urgent --queue
    bulk``; an empty name between commas is refused with the form to use."""
    url = url_of(database)
    write_tasks(tmp_path)
    engine = database.engine()
    bulk = enqueue_ok(engine, "bulk", 1)
    urgent = enqueue_ok(engine, "urgent", 1)

    done = cli("worker", "tasks:handlers", "--handler-mode", "advanced", "--queue", "urgent,bulk",
               "--burst", "--url", url, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "proletarian[urgent,bulk] stopped: 2 succeeded" in done.stderr
    assert ran_in_order(tmp_path) == [*urgent, *bulk]

    refused = cli("worker", "tasks:handlers", "--queue", "urgent,,bulk", "--url", url,
                  cwd=tmp_path)  # fmt: skip
    assert refused.returncode == 2
    assert "names separated by commas, e.g. critical,default" in refused.stderr
    engine.dispose()


def test_several_processes_each_serve_every_queue_given(database: Database, tmp_path: Path) -> None:
    url = url_of(database)
    write_tasks(tmp_path)
    engine = database.engine()
    ids = enqueue_ok(engine, "first", 3) + enqueue_ok(engine, "second", 3)

    done = cli("worker", "tasks:handlers", "--handler-mode", "advanced", "--queue", "first",
               "--queue", "second", "--processes", "2", "--burst", "--url", url, cwd=tmp_path,
               timeout=90)  # fmt: skip

    assert done.returncode == 0, done.stderr
    assert sorted(ran_in_order(tmp_path)) == sorted(ids), "each job ran once"
    assert {a.status for a in archived(engine).values()} == {"success"}
    assert queued(engine) == []
    engine.dispose()


def test_queues_from_worker_options_and_the_flag_that_overrides_them(
    database: Database, tmp_path: Path
) -> None:
    url = url_of(database)
    (tmp_path / "qtasks.py").write_text(QUEUES_MODULE)
    engine = database.engine()
    with engine.begin() as conn:
        reports = sp.enqueue(conn, "r", {"id": str(uuid.uuid4())}, queue="reports")
        mail = sp.enqueue(conn, "m", {"id": str(uuid.uuid4())}, queue="mail")
        other = sp.enqueue(conn, "o", {"id": str(uuid.uuid4())}, queue="other")

    from_module = cli("worker", "qtasks:handle", "--burst", "--url", url, cwd=tmp_path)
    assert from_module.returncode == 0, from_module.stderr
    assert "proletarian[mail,reports] stopped: 2 succeeded" in from_module.stderr
    assert set(archived(engine)) == {reports, mail}

    overridden = cli("worker", "qtasks:handle", "--queue", "other", "--burst", "--url", url,
                     cwd=tmp_path)  # fmt: skip
    assert overridden.returncode == 0, overridden.stderr
    assert "proletarian[other] stopped: 1 succeeded" in overridden.stderr
    assert other in archived(engine)
    engine.dispose()


def test_each_named_queue_that_never_held_a_job_is_warned_about(
    database: Database, tmp_path: Path
) -> None:
    url = url_of(database)
    write_tasks(tmp_path)
    engine = database.engine()
    enqueue_ok(engine, "emails", 1)

    done = cli("worker", "tasks:handlers", "--handler-mode", "advanced", "--queue", "emails",
               "--queue", "repotrs", "--queue", "digestz", "--burst", "--url", url,
               cwd=tmp_path)  # fmt: skip

    assert done.returncode == 0, done.stderr
    assert f"queue 'repotrs' {WARNING}" in done.stderr
    assert f"queue 'digestz' {WARNING}" in done.stderr
    assert f"queue 'emails' {WARNING}" not in done.stderr
    assert "1 succeeded" in done.stderr
    engine.dispose()


def test_the_asyncio_worker_takes_repeated_queues_and_warns_of_unknown_ones(
    database: Database, tmp_path: Path
) -> None:
    """``async def`` handlers on an async URL: the queues in order, and the warning the
    threaded worker gives for a queue that never held a job."""
    url = async_url(database)
    write_async_tasks(tmp_path)
    engine = database.engine()
    second = enqueue_ok(engine, "second", 2)
    first = enqueue_ok(engine, "first", 1)

    done = cli("worker", "atasks:handlers", "--handler-mode", "advanced", "--queue", "first",
               "--queue", "second", "--queue", "thrid", "--burst", "--url", url,
               cwd=tmp_path)  # fmt: skip

    assert_clean(done)
    assert f"worker: warning: queue 'thrid' {WARNING}" in done.stderr
    assert "proletarian[first,second,thrid] stopped: 3 succeeded" in done.stderr
    assert ran_in_order(tmp_path) == [*first, *second]
    engine.dispose()
