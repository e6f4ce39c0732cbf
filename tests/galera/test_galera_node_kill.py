"""A lease-mode drain over three Galera nodes while one node is killed (SIGKILL) and
restarted: no job lost, none archived twice. Jobs whose handler ran through a worker of the
killed node, or whose completion was under way there, run again once their leases expire
(at least once: their handlers may run twice); their writes commit once."""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from typing import Any

import sqlalchemy as sa
from conftest import (
    Base,
    Cluster,
    Done,
    archived_rows,
    causal,
    enqueue_round_robin,
    galera_script,
    queued,
    report,
    wait_for,
    workers_on_each_node,
)

JOBS = 2000


def test_a_drain_over_three_nodes_loses_nothing_and_archives_once_when_a_node_is_killed(
    cluster: Cluster,
) -> None:
    engines = cluster.engines(pool_size=8, pool_pre_ping=True)
    cluster.create_all(Base.metadata)
    job_ids = enqueue_round_robin(engines, JOBS)
    runs: list[uuid.UUID] = []
    runs_lock = threading.Lock()

    def make_handler(node: int) -> Any:
        def handle(job: Any) -> None:
            with runs_lock:
                runs.append(job.job_id)
            job.session.add(Done(job_id=job.job_id))

        return handle

    def archived() -> int:
        return len(archived_rows(engines[0]))

    restart = threading.Thread(target=galera_script, args=("restart", "2"))
    try:
        with workers_on_each_node(
            engines, make_handler, lease_seconds=3.0, heartbeat_interval=0.5, worker_threads=4
        ):
            assert wait_for(lambda: archived() >= JOBS // 4, timeout=60), "the drain stalled"
            galera_script("kill", "2")
            killed_at = archived()
            # The others go on while node 2 is down (it leaves the cluster within seconds).
            assert wait_for(lambda: archived() >= killed_at + 200, timeout=60)
            restart.start()
            assert wait_for(lambda: queued(engines[0]) == 0, timeout=90), "jobs left"
    finally:
        if restart.ident is not None:
            restart.join(timeout=120)
    rows = archived_rows(engines[0])
    with causal(engines[0]) as conn:
        done = Counter(conn.execute(sa.select(Done.job_id)).scalars())
    archived_ids = {job_id for job_id, _, _ in rows}
    lost = len(set(job_ids) - archived_ids)
    archived_twice = sum(1 for count in done.values() if count > 1)
    handler_runs = len(runs)
    report(
        f"galera node kill: enqueued={len(job_ids)} archived={len(rows)} "
        f"archived_twice={archived_twice} lost={lost} handler_runs={handler_runs} "
        f"ran_again={handler_runs - len(set(runs))} killed_at_archived={killed_at}"
    )
    assert lost == 0
    assert archived_twice == 0
    assert set(done) == set(job_ids)
    assert {status for _, status, _ in rows} == {"success"}
    assert set(runs) == set(job_ids)
