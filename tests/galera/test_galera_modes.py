"""Which mode serves a Galera cluster: transaction mode is refused on every way of making a
worker (its row locks and GET_LOCK hold on one node only); lease mode drains one queue from
workers on all three nodes, every handler run exactly once, as the handlers noted."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from pathlib import Path
from typing import Any

import pymysql
import pytest
import sqlalchemy as sa
from conftest import (
    Base,
    Cluster,
    Done,
    Noted,
    Records,
    archived_rows,
    causal,
    cli,
    enqueue_round_robin,
    queued,
    wait_for,
    workers_on_each_node,
)
from sqlalchemy.ext.asyncio import create_async_engine

import sqla_proletarian as sp


def noop(job: object) -> None:
    pass


def test_get_lock_holds_on_one_node_only(cluster: Cluster) -> None:
    """The server's fact behind the refusal: MariaDB 10.11 accepts GET_LOCK on a Galera
    node, but the lock is the node's own: another node finds it free and takes it too (so
    the crash ledger's owner locks, like row locks, cannot tell a live worker elsewhere)."""
    first, second = cluster.engine(0), cluster.engine(1)
    with first.connect() as holder, second.connect() as other:
        assert holder.exec_driver_sql("SELECT GET_LOCK('sp_galera_owner', 0)").scalar() == 1
        assert other.exec_driver_sql("SELECT IS_FREE_LOCK('sp_galera_owner')").scalar() == 1
        assert other.exec_driver_sql("SELECT GET_LOCK('sp_galera_owner', 0)").scalar() == 1


def test_transaction_mode_is_refused_at_worker_creation_naming_lease_seconds(
    cluster: Cluster,
) -> None:
    engine = cluster.engine(1)
    with pytest.raises(sp.ConfigurationError, match="Galera") as refused:
        sp.create_queue_worker(engine, noop, handler_mode="advanced")
    assert "lease_seconds=" in str(refused.value)
    with pytest.raises(sp.ConfigurationError, match="lease_seconds="):
        sp.process_next_job(engine, noop, handler_mode="advanced")
    # Lease mode is accepted.
    sp.create_queue_worker(engine, noop, handler_mode="advanced", lease_seconds=30)


def test_a_worker_made_while_its_node_is_unreachable_refuses_transaction_mode_at_start(
    cluster: Cluster,
) -> None:
    """The server cannot be asked when the worker is made: it is asked again by start()."""
    engine = cluster.engine(2)
    down = True

    @sa.event.listens_for(engine, "do_connect")
    def refuse(*args: object) -> None:
        if down:
            raise pymysql.err.OperationalError(2003, "Can't connect to server (test)")

    worker = sp.create_queue_worker(engine, noop, handler_mode="advanced")
    down = False
    with pytest.raises(sp.ConfigurationError, match="lease_seconds="):
        worker.start()
    assert not worker.running


def test_the_asyncio_worker_refuses_transaction_mode_when_it_starts(cluster: Cluster) -> None:
    url = cluster.urls[2].set(drivername="mysql+aiomysql")

    async def start(**options: object) -> None:
        engine = create_async_engine(url)
        try:
            worker = sp.create_async_queue_worker(engine, noop, **options)  # type: ignore[arg-type]
            await worker.start()
            await worker.stop()
        finally:
            await engine.dispose()

    with pytest.raises(sp.ConfigurationError, match="lease_seconds="):
        asyncio.run(start(handler_mode="advanced"))
    asyncio.run(start(handler_mode="advanced", lease_seconds=30))


def test_the_worker_command_refuses_transaction_mode_in_one_line(
    cluster: Cluster, tmp_path: Path
) -> None:
    (tmp_path / "galera_tasks.py").write_text("def handler(job_type, payload):\n    pass\n")
    url = cluster.urls[0].render_as_string(hide_password=False)
    done = cli(tmp_path, "worker", "galera_tasks:handler", "--burst", "--url", url)
    assert done.returncode != 0, done.stdout
    assert "Traceback" not in done.stderr, done.stderr
    assert "Galera" in done.stderr and "--lease-seconds" in done.stderr, done.stderr


@pytest.mark.parametrize("batch_size", [1, 4])
def test_a_lease_mode_drain_from_three_nodes_runs_every_handler_exactly_once(
    cluster: Cluster, records: Records, batch_size: int
) -> None:
    """600 jobs enqueued on the three nodes, one worker per node (three threads each):
    claims on different nodes race for the same jobs, and the loser of each race (its
    commit's certification, or its abort by the winner's write) claims again. The handlers'
    own notes show each job run once; each job is archived once, succeeded, charged one
    attempt; nothing is logged at ERROR."""
    engines = cluster.engines(pool_size=8)
    job_ids = enqueue_round_robin(engines, 600)
    noted = Noted()
    with workers_on_each_node(engines, noted.handler, batch_size=batch_size) as workers:
        assert wait_for(lambda: queued(engines[0]) == 0, timeout=60), "the drain stalled"
        assert all(worker.running for worker in workers), [w.exception for w in workers]
    counts = noted.counts()
    assert set(counts) == set(job_ids)
    assert [job_id for job_id, runs in counts.items() if runs > 1] == []
    rows = archived_rows(engines[1])
    assert sorted(job_id for job_id, _, _ in rows) == sorted(job_ids)
    assert {(status, attempts) for _, status, attempts in rows} == {("success", 1)}
    assert records.at_least(logging.ERROR) == []
    # A completion that lost its races is never tried on a fresh connection, nor given up.
    retried = [
        r.getMessage() for r in records.records if getattr(r, "event", "") == "completion-retry"
    ]
    assert retried == []
    assert len({node for _, node, _, _ in noted.runs}) == 3, "a node's worker ran nothing"


def test_jobs_enqueued_on_one_node_are_claimed_by_workers_on_the_others(
    cluster: Cluster,
) -> None:
    engines = cluster.engines()
    with engines[0].begin() as conn:
        job_ids = sp.enqueue_many(conn, [("t", n) for n in range(30)])
    noted = Noted()
    # Workers on nodes 2 and 3 only.
    with workers_on_each_node(
        engines[1:], lambda node: noted.handler(node + 1, 0.01), worker_threads=2
    ):
        assert wait_for(lambda: queued(engines[0]) == 0, timeout=30)
    assert sorted(noted.counts()) == sorted(job_ids)


def test_an_asyncio_lease_drain_from_three_nodes_runs_every_handler_once(
    cluster: Cluster, records: Records
) -> None:
    """The asyncio worker's claims race the same way (one worker per node, aiomysql)."""
    engines = cluster.engines()
    job_ids = enqueue_round_robin(engines, 240)
    noted = Noted()

    async def drain() -> None:
        async_engines = [
            create_async_engine(url.set(drivername="mysql+aiomysql"), pool_size=8)
            for url in cluster.urls
        ]
        workers = [
            sp.create_async_queue_worker(
                engine,
                noted.handler(node),
                handler_mode="advanced",
                lease_seconds=30,
                polling_interval=0.05,
                concurrency=3,
                batch_size=2,
                worker_id=f"node{node}",
            )
            for node, engine in enumerate(async_engines)
        ]
        try:
            for worker in workers:
                await worker.start()
            deadline = asyncio.get_running_loop().time() + 60
            while queued(engines[0]) and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.1)
        finally:
            for worker in workers:
                await worker.stop()
            for engine in async_engines:
                await engine.dispose()

    asyncio.run(drain())
    counts = noted.counts()
    assert set(counts) == set(job_ids)
    assert [job_id for job_id, runs in counts.items() if runs > 1] == []
    assert records.at_least(logging.ERROR) == []


def test_handlers_writing_through_job_session_commit_their_writes_once_across_nodes(
    cluster: Cluster, records: Records
) -> None:
    """A completion that holds the handler's writes cannot be made again: one that loses a
    race with another node's write gives its job back, uncharged, to run again (a WARNING,
    not an ERROR). Each job's writes commit once, with its one archiving."""
    engines = cluster.engines(pool_size=8)
    cluster.create_all(Base.metadata)
    job_ids = enqueue_round_robin(engines, 300)

    def make_handler(node: int) -> Any:
        def handle(job: Any) -> None:
            job.session.add(Done(job_id=job.job_id))

        return handle

    with workers_on_each_node(engines, make_handler):
        assert wait_for(lambda: queued(engines[0]) == 0, timeout=60), "the drain stalled"
    with causal(engines[2]) as conn:
        done = Counter(conn.execute(sa.select(Done.job_id)).scalars())
    assert done == Counter(job_ids)
    rows = archived_rows(engines[1])
    assert sorted(job_id for job_id, _, _ in rows) == sorted(job_ids)
    assert {status for _, status, _ in rows} == {"success"}
    assert records.at_least(logging.ERROR) == []
