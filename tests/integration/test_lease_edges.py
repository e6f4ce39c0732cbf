"""Lease mode at its edges: a cancel requested while a job was leased holds for the next
claim of either mode once the lease expired; a claim whose jobs all ended at the claim still
counts as one that took jobs (``process_next_job``, ``testing.drain``); a long worker id
fits the lease's owner column."""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
import uuid
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from helpers import archived, archived_job, enqueue_committed, events, jobs, running, wait_for
from lease_helpers import JOB, job_row
from sqlalchemy.ext.asyncio import create_async_engine

import sqla_proletarian as sp
from sqla_proletarian import statements as sql
from sqla_proletarian.testing import drain

#: Long enough that no lease of a test's own worker expires while it looks.
LONG_LEASE = {"lease_seconds": 60.0, "polling_interval": 0.02}
MODES = {"transaction": {}, "lease": LONG_LEASE}


def lease_then_die(engine: sa.Engine, job_ids: list[uuid.UUID]) -> None:
    """A lease-mode worker's claim of the jobs, written as its claim writes it; the worker
    then dies (nothing renews or ends the lease)."""
    now = sp.utc_now()
    lease = sql.lease(job_ids, uuid.uuid4(), "dead@host:1/t", now, now + timedelta(minutes=5))
    with engine.begin() as conn:
        conn.execute(*lease)


def cancel(engine: sa.Engine, job_ids: list[uuid.UUID]) -> None:
    """cancel_job on each leased job: a request (True), for its worker's next heartbeat."""
    for job_id in job_ids:
        with engine.begin() as conn:
            assert sp.cancel_job(conn, job_id) is True
        assert job_row(engine, job_id).cancel_requested_at is not None


def expire(engine: sa.Engine, job_ids: list[uuid.UUID]) -> None:
    """The dead worker's leases expire (an hour ago: due before any job enqueued now)."""
    with engine.begin() as conn:
        conn.execute(
            sa.update(JOB)
            .where(JOB.c.job_id.in_(job_ids))
            .values(process_at=sp.utc_now() - timedelta(hours=1))
        )


def cancelled_then_dead(engine: sa.Engine, job_type: str, how_many: int) -> list[uuid.UUID]:
    """Jobs whose cancel was requested while a worker held their leases, and whose worker
    died: their leases expired with the requests on them."""
    job_ids = [enqueue_committed(engine, job_type, n) for n in range(how_many)]
    lease_then_die(engine, job_ids)
    cancel(engine, job_ids)
    expire(engine, job_ids)
    return job_ids


# --- a cancel requested under a lease whose worker died --------------------------------------


@pytest.mark.parametrize("max_unclean_ends", [3, None])
def test_a_transaction_mode_claim_archives_a_cancel_requested_job_whose_lease_expired(
    engine: sa.Engine, caplog: pytest.LogCaptureFixture, max_unclean_ends: int | None
) -> None:
    """cancel_job reported True for a leased job; its worker died and the lease expired.
    A transaction-mode drain never calls the handler: the claim archives the job as
    cancelled (its one run counted), logs it and takes the next job."""
    caplog.set_level(logging.INFO, logger="sqla_proletarian")
    [job_id] = cancelled_then_dead(engine, "cancelled", 1)
    after = enqueue_committed(engine, "after")
    calls: list[str] = []
    ran = drain(
        engine, lambda job_type, payload: calls.append(job_type), max_unclean_ends=max_unclean_ends
    )
    assert calls == ["after"], "the cancelled job's handler was called"
    assert ran == 1
    done = archived_job(engine, job_id)
    assert done is not None
    assert (done.status, done.attempts) == ("cancelled", 1)
    assert archived_job(engine, after).status == "success"  # type: ignore[union-attr]
    assert jobs(engine) == []
    assert [r.job_id for r in events(caplog.records, "job-cancelled")] == [job_id]


def test_a_transaction_mode_worker_never_runs_a_cancel_requested_job_whose_lease_expired(
    engine: sa.Engine,
) -> None:
    """The same through a running transaction-mode worker on the queue: the job is archived
    as cancelled by its claim, and the handler is never called."""
    job_ids = cancelled_then_dead(engine, "cancelled", 2)
    calls: list[Any] = []
    worker = sp.create_queue_worker(
        engine, lambda *args: calls.append(args), worker_threads=2, polling_interval=0.02
    )
    with running(worker):
        assert wait_for(lambda: all(archived_job(engine, j) is not None for j in job_ids))
    assert calls == []
    assert {row.status for row in archived(engine)} == {"cancelled"}
    assert jobs(engine) == []


#: The async driver of each backend's URL.
ASYNC_DRIVERNAME = {
    "sqlite": "sqlite+aiosqlite",
    "postgresql": "postgresql+psycopg",
    "mariadb": "mysql+aiomysql",
}


def test_an_asyncio_transaction_mode_worker_never_runs_a_cancel_requested_expired_job(
    database: Any, engine: sa.Engine
) -> None:
    """The asyncio worker's transaction-mode claim archives such a job as cancelled too,
    and runs the job enqueued after it."""
    job_ids = cancelled_then_dead(engine, "cancelled", 2)
    after = enqueue_committed(engine, "after")
    calls: list[str] = []

    async def handler(job_type: str, payload: Any) -> None:
        calls.append(job_type)

    async def main() -> None:
        url = database.url.set(drivername=ASYNC_DRIVERNAME[database.backend])
        worker_engine = create_async_engine(url)
        try:
            async with sp.create_async_queue_worker(worker_engine, handler, polling_interval=0.02):
                deadline = time.monotonic() + 10
                while archived_job(engine, after) is None and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
        finally:
            await worker_engine.dispose()

    asyncio.run(main())
    assert calls == ["after"]
    statuses = {row.job_id: row.status for row in archived(engine)}
    assert statuses == {**dict.fromkeys(job_ids, "cancelled"), after: "success"}
    assert jobs(engine) == []


# --- a claim whose jobs all ended at the claim -----------------------------------------------


@pytest.mark.parametrize(
    ("mode", "ending"),
    [("lease", "cancelled"), ("lease", "crashed"), ("transaction", "cancelled")],
)
def test_a_claim_whose_jobs_all_ended_at_the_claim_counts_and_drain_runs_the_rest(
    engine: sa.Engine, mode: str, ending: str
) -> None:
    """The first claims take only jobs that end at the claim (a cancel requested under a
    lease whose worker died; or, with max_unclean_ends=1, a job whose lease expired once):
    process_next_job returns True for such a claim, and drain goes on to run every due
    job after them."""
    if ending == "cancelled":
        ended = cancelled_then_dead(engine, "ended", 2)
        options: dict[str, Any] = dict(MODES[mode])
        status = "cancelled"
    else:
        ended = [enqueue_committed(engine, "ended", n) for n in range(2)]
        lease_then_die(engine, ended)
        expire(engine, ended)
        options = {**MODES[mode], "max_unclean_ends": 1}
        status = "failure"
    ordinary = [enqueue_committed(engine, "ordinary", n) for n in range(3)]
    calls: list[Any] = []
    lock = threading.Lock()

    def handler(job_type: str, payload: Any) -> None:
        with lock:
            calls.append((job_type, payload))

    # One job a claim (batch_size 1): the first claim takes an ended job only.
    assert sp.process_next_job(engine, handler, **options) is True
    assert calls == []
    assert archived_job(engine, ended[0]).status == status  # type: ignore[union-attr]
    drain(engine, handler, **options)
    assert sorted(calls) == [("ordinary", n) for n in range(3)]
    statuses = {row.job_id: row.status for row in archived(engine)}
    assert statuses == {**dict.fromkeys(ended, status), **dict.fromkeys(ordinary, "success")}
    assert jobs(engine) == []
    assert not sp.process_next_job(engine, handler, **options)


# --- a long worker id --------------------------------------------------------------------------


def test_a_long_worker_id_on_five_queues_claims_and_completes_in_lease_mode(
    engine: sa.Engine,
) -> None:
    """Five queues of 22-character names and a 300-character worker id ending in a
    process's ``#N``: every lease-mode claim writes an owner that fits the 255-character
    column (its start, and its end that names the claiming thread, kept), and every job
    completes."""
    queues = [f"queue-number-{n}-abcdefg" for n in range(5)]
    assert {len(queue) for queue in queues} == {22}
    worker_id = "w" * 300 + "#3"
    job_ids = [enqueue_committed(engine, "t", n, queue=queue) for n, queue in enumerate(queues)]
    owners: list[str] = []
    lock = threading.Lock()

    def handler(job: sp.JobContext) -> None:
        row = job_row(engine, job.job_id)
        with lock:
            owners.append(row.lease_owner)

    worker = sp.create_queue_worker(
        engine,
        handler,
        handler_mode="advanced",
        queues=queues,
        worker_id=worker_id,
        worker_threads=2,
        **LONG_LEASE,
    )

    def done() -> bool:
        return len(archived(engine)) == len(job_ids)

    with running(worker):
        assert wait_for(lambda: done() or not worker.running, timeout=30)
        assert worker.running, "the worker stopped on a claim's error"
        assert done()
    assert {row.status for row in archived(engine)} == {"success"}
    assert len(owners) == len(job_ids)
    for owner in owners:
        assert len(owner) <= 255, owner
        assert owner.startswith("w" * 100), owner
        # The claiming thread: the poller, or a claimer beside it while the queue is busy.
        assert re.search(f"{worker_id[-10:]}-(poller|claimer-\\d+)$", owner), owner
