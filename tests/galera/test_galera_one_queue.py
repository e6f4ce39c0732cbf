"""Writes to the jobs of one queue from three nodes at once: Galera certifies a job's row by
the keys of its unique indexes, and no key of a job without a ``unique_key`` is shared with
another job's (on MySQL and MariaDB the keys are held by ``unique_slot``, NULL for those
jobs), so the nodes' writes do not conflict at commit."""

from __future__ import annotations

import logging
import threading
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import sqlalchemy as sa
from conftest import (
    Base,
    Cluster,
    Done,
    Noted,
    Records,
    archived_rows,
    causal,
    enqueue_round_robin,
    is_lock_conflict,
    queued,
    wait_for,
    workers_on_each_node,
)

import sqla_proletarian as sp

#: Threads enqueueing on each node, and the jobs each enqueues (one transaction a job).
THREADS_PER_NODE = 2
JOBS_PER_THREAD = 50


def test_enqueues_into_one_queue_from_three_nodes_at_once_all_commit(cluster: Cluster) -> None:
    """300 single-job enqueues into one queue, from two threads on each node at once, each in
    a transaction of its own and none made again: every one commits (one in five with a
    unique key of its own). With the unique index on ``(queue, unique_key)`` every job was
    certified under the key ``(queue, NULL)``, and 62 of the 300 failed with 1213."""
    engines = cluster.engines(pool_size=THREADS_PER_NODE)
    barrier = threading.Barrier(3 * THREADS_PER_NODE)

    def enqueue_from(engine: sa.Engine, thread: int) -> tuple[list[uuid.UUID], int]:
        added: list[uuid.UUID] = []
        lost = 0
        barrier.wait(timeout=30)
        for n in range(JOBS_PER_THREAD):
            key = f"k-{thread}-{n}" if n % 5 == 0 else None
            try:
                with engine.begin() as conn:
                    added.append(sp.enqueue(conn, "t", n, queue="shared", unique_key=key))
            except sa.exc.OperationalError as exc:
                if not is_lock_conflict(exc):
                    raise
                lost += 1
        return added, lost

    with ThreadPoolExecutor(3 * THREADS_PER_NODE) as pool:
        futures = [
            pool.submit(enqueue_from, engines[thread % 3], thread)
            for thread in range(3 * THREADS_PER_NODE)
        ]
        results = [future.result(timeout=120) for future in futures]
    lost = sum(lost for _, lost in results)
    added = [job_id for ids, _ in results for job_id in ids]
    assert lost == 0, f"{lost} of {len(futures) * JOBS_PER_THREAD} enqueues lost at commit"
    assert len(set(added)) == len(futures) * JOBS_PER_THREAD
    table = sp.Job.__table__
    with causal(engines[1]) as conn:
        stored = set(conn.execute(sa.select(table.c.job_id).where(table.c.queue == "shared")))
    assert {job_id for (job_id,) in stored} == set(added)


def test_handlers_writing_through_job_session_on_three_nodes_run_once(
    cluster: Cluster, records: Records
) -> None:
    """A lease-mode drain of one queue from a worker on each node, each handler writing a row
    through ``job.session`` (committed with its job's completion): no completion loses a race
    with another node's, so the handlers' own notes show each job run once, and each row is
    written once. With the unique index on ``(queue, unique_key)`` 66 of these 300 handlers
    ran twice (their completions lost at commit, the jobs given back)."""
    engines = cluster.engines(pool_size=8)
    cluster.create_all(Base.metadata)
    job_ids = enqueue_round_robin(engines, 300)
    noted = Noted()

    def make_handler(node: int) -> Any:
        note = noted.handler(node)

        def handle(job: Any) -> None:
            note(job)
            job.session.add(Done(job_id=job.job_id))

        return handle

    with workers_on_each_node(engines, make_handler):
        assert wait_for(lambda: queued(engines[0]) == 0, timeout=60), "the drain stalled"
    counts = noted.counts()
    assert set(counts) == set(job_ids)
    twice = [job_id for job_id, runs in counts.items() if runs > 1]
    assert twice == [], f"{len(twice)} of {len(job_ids)} handlers ran more than once"
    with causal(engines[2]) as conn:
        done = Counter(conn.execute(sa.select(Done.job_id)).scalars())
    assert done == Counter(job_ids)
    rows = archived_rows(engines[1])
    assert sorted(job_id for job_id, _, _ in rows) == sorted(job_ids)
    assert {(status, attempts) for _, status, attempts in rows} == {("success", 1)}
    assert records.at_least(logging.WARNING) == []
    assert len({node for _, node, _, _ in noted.runs}) == 3, "a node's worker ran nothing"
