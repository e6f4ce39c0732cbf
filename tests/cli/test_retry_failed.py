"""sp.retry_failed, called directly, on every backend: archived failures go back in the
queue with their job id, attempts from zero, due now, and leave the archive in the same
transaction; in the caller's transaction it never commits; ids that are not archived
failures, or are queued right now, are skipped; workers wake as for an enqueue."""

from __future__ import annotations

import threading
import time
import uuid
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import pytest
import sqlalchemy as sa
from cli_support import archived, cli, rows, url_of
from sqlalchemy.orm import Session

import sqla_proletarian as sp
from sqla_proletarian import statements
from sqla_proletarian.maintenance import RETRY_BATCH_SIZE

if TYPE_CHECKING:
    from conftest import Database


def fail(engine: sa.Engine, job_type: str = "work", **kw: Any) -> uuid.UUID:
    """Enqueue a job and run it to a recorded failure."""
    with engine.begin() as conn:
        job_id = sp.enqueue(conn, job_type, {"n": 1}, **kw)

    def handler(job_type: str, payload: Any) -> None:
        raise RuntimeError("no")

    assert sp.process_next_job(engine, handler, queue=kw.get("queue", sp.DEFAULT_QUEUE))
    return job_id


def archive_failures(engine: sa.Engine, count: int, queue: str, job_type: str) -> list[uuid.UUID]:
    now = sp.utc_now()
    values = [
        {
            "job_id": uuid.uuid4(),
            "queue": queue,
            "job_type": job_type,
            "payload": "{}",
            "attempts": 3,
            "enqueued_at": now - timedelta(hours=1),
            "process_at": now - timedelta(hours=1),
            "status": "failure",
            "finished_at": now - timedelta(seconds=count - index),
            "error": "RuntimeError: no",
        }
        for index in range(count)
    ]
    with engine.begin() as conn:
        conn.execute(sa.insert(statements.ARCHIVE), values)
    return [value["job_id"] for value in values]


def test_retry_failed_in_a_rolled_back_transaction_leaves_nothing(engine: sa.Engine) -> None:
    """Through a Connection or a Session it joins the caller's transaction: the job is in
    the queue inside it, and a rollback leaves queue and archive as they were."""
    job_id = fail(engine)
    with engine.connect() as conn:
        assert sp.retry_failed(conn, [job_id]) == 1
        assert [row.job_id for row in conn.execute(sa.select(statements.JOB))] == [job_id]
        conn.rollback()
    with Session(engine) as session:
        assert sp.retry_failed(session) == 1
        assert session.get(sp.Job, job_id) is not None
        session.rollback()
    assert rows(engine, statements.JOB) == []
    assert archived(engine)[job_id].status == "failure"


def test_retry_failed_keeps_the_job_id_and_the_archive_tells_the_truth_after_success(
    engine: sa.Engine,
) -> None:
    """Same id, attempts from zero, enqueued and due now, no archive row until it ends
    again; once it succeeds the archive says success, with one attempt and no error."""
    job_id = fail(engine, process_in=0)
    before = sp.utc_now()
    assert sp.retry_failed(engine, [str(job_id)]) == 1
    [queued] = rows(engine, statements.JOB)
    assert (queued.job_id, queued.job_type, queued.attempts, queued.payload) == (
        job_id,
        "work",
        0,
        '{"n":1}',
    )
    assert before <= queued.process_at == queued.enqueued_at <= sp.utc_now()
    assert archived(engine) == {}

    seen: list[object] = []
    assert sp.process_next_job(engine, lambda job_type, payload: seen.append(payload))
    assert seen == [{"n": 1}]
    row = archived(engine)[job_id]
    assert (row.status, row.attempts, row.error) == ("success", 1, None)
    assert rows(engine, statements.JOB) == [] and rows(engine, statements.RUN) == []


@pytest.mark.parametrize("key", [None, "invoice-8"], ids=["unkeyed", "keyed"])
def test_the_failures_put_back_stay_in_the_jobs_history(engine: sa.Engine, key: str | None) -> None:
    """retry_failed keeps each failure it puts back (error, attempts, time) in the job's
    history: get_job shows it while the job is queued again and once it has ended anew,
    oldest first, while the archive keeps one row per job id, the last end; pruning the
    job deletes its history."""
    job_id = fail(engine, unique_key=key)
    first = archived(engine)[job_id]
    assert sp.retry_failed(engine, [job_id]) == 1
    queued = sp.get_job(engine, job_id)
    assert queued is not None and queued.state == "ready" and queued.attempts == 0
    assert [(h.state, h.attempts, h.finished_at, h.error) for h in queued.history] == [
        ("failed", 1, first.finished_at, first.error)
    ]
    assert "RuntimeError: no" in (queued.history[0].error or "")

    def flaky(job_type: str, payload: Any) -> None:
        raise ValueError("still no")

    assert sp.process_next_job(engine, flaky)
    second = archived(engine)[job_id]
    assert sp.retry_failed(engine, [job_id]) == 1
    assert sp.process_next_job(engine, lambda job_type, payload: None)
    done = sp.get_job(engine, job_id)
    assert done is not None and (done.state, done.attempts, done.error) == ("succeeded", 1, None)
    assert [(h.state, h.error) for h in done.history] == [
        ("failed", first.error),
        ("failed", second.error),
    ]
    assert "ValueError: still no" in (done.history[1].error or "")
    assert list(archived(engine)) == [job_id]
    assert len(rows(engine, statements.HISTORY)) == 2

    assert (
        sp.prune_archive(
            engine, older_than=timedelta(0), clock=lambda: sp.utc_now() + timedelta(seconds=1)
        )
        == 1
    )
    assert rows(engine, statements.HISTORY) == []
    assert sp.get_job(engine, job_id) is None


def test_retry_failed_skips_ids_that_are_not_archived_failures_or_are_queued_now(
    engine: sa.Engine,
) -> None:
    """A success, an unknown id and a failure whose id is queued again are left alone: no
    duplicate in the queue, the archive row kept; bad ids and names are refused."""
    with engine.begin() as conn:
        succeeded = sp.enqueue(conn, "work")
    assert sp.process_next_job(engine, lambda job_type, payload: None)
    queued_again = fail(engine)
    with engine.begin() as conn:
        sp.enqueue(conn, "work", job_id=queued_again)

    assert sp.retry_failed(engine, [succeeded, uuid.uuid4(), queued_again]) == 0
    assert [row.job_id for row in rows(engine, statements.JOB)] == [queued_again]
    assert archived(engine)[queued_again].status == "failure"
    assert archived(engine)[succeeded].status == "success"
    assert sp.retry_failed(engine, []) == 0
    with pytest.raises(sp.InvalidJobError, match="one id"):
        sp.retry_failed(engine, str(succeeded))  # type: ignore[arg-type]
    with pytest.raises(sp.InvalidJobError, match="not a job id"):
        sp.retry_failed(engine, ["nope"])
    with pytest.raises(sp.InvalidJobError, match="queue"):
        sp.retry_failed(engine, queue="")


def test_retry_failed_puts_back_all_matching_failures_in_batches(engine: sa.Engine) -> None:
    """More than a batch by id through a Connection; all of one queue and job type, and
    then everything else, with an Engine (a transaction per batch)."""
    by_id = archive_failures(engine, RETRY_BATCH_SIZE + 100, "a", "first")
    typed = archive_failures(engine, 30, "a", "second")
    other = archive_failures(engine, 1, "b", "first")
    with engine.begin() as conn:
        assert sp.retry_failed(conn, by_id) == len(by_id)
    assert sp.retry_failed(engine, queue="a", job_type="second") == len(typed)
    assert sp.retry_failed(engine) == len(other)
    with engine.connect() as conn:
        counts = dict(
            conn.execute(
                sa.select(statements.JOB.c.job_type, sa.func.count()).group_by(
                    statements.JOB.c.job_type
                )
            ).all()
        )
    assert counts == {"first": len(by_id) + 1, "second": len(typed)}
    assert archived(engine) == {}


def test_retry_failed_wakes_an_idle_worker_like_an_enqueue(engine: sa.Engine) -> None:
    """A worker that would poll again only in 30 s runs the job at once."""
    [job_id] = archive_failures(engine, 1, sp.DEFAULT_QUEUE, "work")
    ran = threading.Event()
    worker = sp.create_queue_worker(
        engine, lambda job_type, payload: ran.set(), polling_interval=30
    )
    worker.start()
    try:
        time.sleep(0.3)  # its first poll found nothing: it is idle
        started = time.monotonic()
        assert sp.retry_failed(engine, [job_id]) == 1
        assert ran.wait(10)
        assert time.monotonic() - started < 5
    finally:
        worker.stop()
    assert archived(engine)[job_id].status == "success"


def test_a_failure_put_back_holds_its_unique_key_again(engine: sa.Engine) -> None:
    """A keyed job that failed goes back with its key: enqueueing the key again returns the
    put-back job instead of adding a second one; once it succeeds, the key is free."""
    job_id = fail(engine, unique_key="invoice-7")
    assert archived(engine)[job_id].unique_key == "invoice-7"
    assert sp.retry_failed(engine, [job_id]) == 1
    with engine.begin() as conn:
        assert sp.enqueue(conn, "work", unique_key="invoice-7") == job_id
    [queued] = rows(engine, statements.JOB)
    assert (queued.job_id, queued.unique_key) == (job_id, "invoice-7")
    assert sp.process_next_job(engine, lambda job_type, payload: None)
    assert archived(engine)[job_id].unique_key == "invoice-7"
    with engine.begin() as conn:
        assert sp.enqueue(conn, "work", unique_key="invoice-7") != job_id


def test_a_failure_whose_key_a_queued_job_holds_stays_archived_and_is_reported(
    engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """Another job took the key after the failure: the failure stays archived, is not
    counted, is listed by retry_failed_report and logged; the others go back. Of two
    failures with one key, the first put back takes it."""
    held = fail(engine, unique_key="k")
    with engine.begin() as conn:
        holder = sp.enqueue(conn, "work", unique_key="k")
    plain = fail(engine, queue="other")
    first = fail(engine, queue="other", unique_key="twice")
    second = fail(engine, queue="other", unique_key="twice")
    with caplog.at_level("WARNING", logger="sqla_proletarian"):
        report = sp.retry_failed_report(engine, [held, plain, first, second])
    assert report == sp.RetryReport(put_back=2, key_held=(held, second))
    assert [r.job_id for r in caplog.records if getattr(r, "event", None) == "retry-key-held"] == [
        held,
        second,
    ]
    assert {row.job_id for row in rows(engine, statements.JOB)} == {holder, plain, first}
    assert {job_id: row.status for job_id, row in archived(engine).items()} == {
        held: "failure",
        second: "failure",
    }
    with engine.connect() as conn:
        assert sp.retry_failed(conn, [held]) == 0
    for queue in (sp.DEFAULT_QUEUE, "other"):
        while sp.process_next_job(engine, lambda job_type, payload: None, queue=queue):
            pass
    assert sp.retry_failed(engine) == 2  # their keys are free again


def test_the_cli_puts_a_keyed_failure_back_and_names_one_whose_key_is_held(
    database: Database,
) -> None:
    """``retry-failed`` counts what went back with its key and names, one a line, the
    failures left archived because a queued job holds their key."""
    engine = database.engine()
    free = fail(engine, unique_key="free")
    held = fail(engine, unique_key="taken")
    with engine.begin() as conn:
        holder = sp.enqueue(conn, "work", unique_key="taken")
    done = cli("retry-failed", str(free), str(held), "--url", url_of(database))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "1 failed job put back in the queue",
        f"{held} stays archived: a queued job of its queue holds its unique_key",
    ]
    assert {(row.job_id, row.unique_key) for row in rows(engine, statements.JOB)} == {
        (free, "free"),
        (holder, "taken"),
    }
    assert archived(engine)[held].status == "failure"
