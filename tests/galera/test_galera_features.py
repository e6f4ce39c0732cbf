"""Unique keys, queue limits and dependencies across the nodes of a Galera cluster, with
lease-mode workers on every node."""

from __future__ import annotations

import itertools
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from conftest import (
    Cluster,
    Noted,
    archived_rows,
    causal,
    cli,
    committed,
    enqueue_round_robin,
    is_lock_conflict,
    queued,
    wait_for,
    workers_on_each_node,
)

import sqla_proletarian as sp


def most_at_once(runs: list[tuple[uuid.UUID, int, float, float]]) -> int:
    """The most handler runs that overlapped in time (by their noted starts and ends)."""
    edges = sorted([(began, 1) for _, _, began, _ in runs] + [(end, -1) for *_, end in runs])
    running = most = 0
    for _, step in edges:
        running += step
        most = max(most, running)
    return most


def enqueue_racing(
    engine: sa.Engine, key: str, barrier: threading.Barrier
) -> tuple[uuid.UUID, bool]:
    """Enqueue with ``key`` once ``barrier`` lets both racers go; made again after a lost
    commit. The job's id, and whether the first commit was lost."""
    try:
        with engine.begin() as conn:
            barrier.wait(timeout=10)
            return sp.enqueue(conn, "t", None, unique_key=key), False
    except sa.exc.OperationalError as exc:
        if not is_lock_conflict(exc):
            raise
    return committed(engine, lambda conn: sp.enqueue(conn, "t", None, unique_key=key)), True


def test_enqueues_with_one_unique_key_on_two_nodes_at_once_add_one_job(
    cluster: Cluster,
) -> None:
    """Two nodes enqueue with the same key at the same moment, 10 keys in a row: the loser's
    commit fails certification (1213) and, made again, finds the winner's job and returns
    its id. One job per key, both callers told its id."""
    engines = cluster.engines()
    lost = 0
    with ThreadPoolExecutor(2) as pool:
        for round_ in range(10):
            barrier = threading.Barrier(2)
            racing = [
                pool.submit(enqueue_racing, engines[node], f"key-{round_}", barrier)
                for node in (0, 1)
            ]
            (first, first_lost), (second, second_lost) = [f.result(30) for f in racing]
            assert first == second
            lost += first_lost + second_lost
    assert lost >= 1, "no commit lost: the enqueues never raced"
    table = sp.Job.__table__
    with causal(engines[2]) as conn:
        keys = conn.execute(
            sa.select(table.c.unique_key, sa.func.count()).group_by(table.c.unique_key)
        )
        assert dict(keys.all()) == {f"key-{n}": 1 for n in range(10)}


def test_max_running_holds_across_workers_on_three_nodes(cluster: Cluster) -> None:
    """max_running=2: three workers (one per node, three threads each) never run more than
    two of the queue's handlers at once, by the handlers' own start and end times."""
    engines = cluster.engines(pool_size=8)
    with engines[0].begin() as conn:
        sp.set_queue_limits(conn, "default", max_running=2)
    job_ids = enqueue_round_robin(engines, 45)
    noted = Noted()
    with workers_on_each_node(engines, lambda node: noted.handler(node, 0.05)):
        assert wait_for(lambda: queued(engines[0]) == 0, timeout=60)
    assert sorted(noted.counts()) == sorted(job_ids)
    assert max(noted.counts().values()) == 1
    assert len({node for _, node, _, _ in noted.runs}) > 1
    assert most_at_once(noted.runs) == 2


def test_max_running_per_key_holds_across_nodes(cluster: Cluster) -> None:
    engines = cluster.engines(pool_size=8)
    with engines[0].begin() as conn:
        sp.set_queue_limits(conn, "default", max_running_per_key=1)
    job_ids: list[uuid.UUID] = []
    for node, engine in enumerate(engines):
        for key in ("a", "b"):
            job_ids += committed(
                engine,
                lambda conn, key=key, node=node: sp.enqueue_many(
                    conn, [("t", (node, n)) for n in range(5)], concurrency_key=key
                ),
            )
    keys: dict[uuid.UUID, str] = {}
    with causal(engines[0]) as conn:
        table = sp.Job.__table__
        keys = dict(conn.execute(sa.select(table.c.job_id, table.c.concurrency_key)).all())
    noted = Noted()
    with workers_on_each_node(engines, lambda node: noted.handler(node, 0.05)):
        assert wait_for(lambda: queued(engines[0]) == 0, timeout=60)
    assert sorted(noted.counts()) == sorted(job_ids)
    for key in ("a", "b"):
        assert most_at_once([run for run in noted.runs if keys[run[0]] == key]) == 1


@pytest.mark.parametrize("per_key", [False, True])
def test_rate_limits_are_refused_on_galera_saying_what_to_do(
    cluster: Cluster, per_key: bool
) -> None:
    """A rate limit's window is kept by a row lock that holds on one node only: refused."""
    engine = cluster.engine(1)
    limit: dict[str, Any] = {"rate_limit_per_key" if per_key else "rate_limit": (5, 1.0)}
    with pytest.raises(sp.ConfigurationError, match="Galera") as refused, engine.begin() as conn:
        sp.set_queue_limits(conn, "default", **limit)
    assert "max_running" in str(refused.value)
    assert sp.queue_limits(engine) == {}


def test_a_job_depending_on_jobs_run_on_other_nodes_runs_after_them(cluster: Cluster) -> None:
    """Chains enqueued on one node, their links run by workers on the others: each job runs
    once, after every job it depends on ended. The workers run before the chains are
    enqueued, and each link takes 50 ms: a worker's 3 threads cannot take every link of 6
    chains before the other nodes' workers (polling every 50 ms) take some, however late a
    loaded machine started them."""
    engines = cluster.engines(pool_size=8)
    chains: list[list[uuid.UUID]] = []
    noted = Noted()
    with workers_on_each_node(engines, lambda node: noted.handler(node, 0.05)):
        for chain in range(6):
            engine = engines[chain % 3]

            def add_chain(conn: sa.Connection, chain: int = chain) -> list[uuid.UUID]:
                ids = [sp.enqueue(conn, "t", (chain, 0))]
                for link in range(1, 4):
                    ids.append(sp.enqueue(conn, "t", (chain, link), depends_on=[ids[-1]]))
                return ids

            chains.append(committed(engine, add_chain))
        assert wait_for(lambda: queued(engines[0]) == 0, timeout=60)
    runs = {job_id: (node, began, end) for job_id, node, began, end in noted.runs}
    assert max(noted.counts().values()) == 1
    for ids in chains:
        for before, after in itertools.pairwise(ids):
            assert runs[before][2] <= runs[after][1]
    assert {status for _, status, _ in archived_rows(engines[0])} == {"success"}
    assert len({node for node, _, _ in runs.values()}) > 1


def test_the_limits_command_refuses_a_rate_on_galera_in_one_line(
    cluster: Cluster, tmp_path: Path
) -> None:
    url = cluster.urls[0].render_as_string(hide_password=False)
    done = cli(tmp_path, "limits", "set", "default", "--rate", "10/s", "--url", url)
    assert done.returncode != 0, done.stdout
    assert "Traceback" not in done.stderr, done.stderr
    assert "Galera" in done.stderr and "max_running" in done.stderr, done.stderr
    assert sp.queue_limits(cluster.engine(0)) == {}
