"""The poll is served by the index ix_proletarian_job_poll on every backend: the index gives
both the WHERE (queue, due time) and the ORDER BY (process_at, seq), so no sort and no scan
of the whole table, with realistic data and fresh statistics (no planner switches)."""

from __future__ import annotations

import json
import random
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.base import Executable
from sqlalchemy.sql.expression import ClauseElement

import sqla_proletarian as sp
from sqla_proletarian import statements
from sqla_proletarian.values import build_job_values

INDEX = "ix_proletarian_job_poll"


class Explain(Executable, ClauseElement):
    """``EXPLAIN`` (with a dialect's prefix) of a statement, run with its bound parameters."""

    inherit_cache = False

    def __init__(self, statement: Any, prefix: str) -> None:
        self.statement = statement
        self.prefix = prefix


@compiles(Explain)
def _compile_explain(element: Explain, compiler: Any, **kw: Any) -> str:
    return element.prefix + compiler.process(element.statement, **kw)


@pytest.fixture
def busy_engine(engine: sa.Engine) -> sa.Engine:
    """2,000 jobs: most in one busy queue, the rest in four small ones, due times spread over
    the past and the next hour; table statistics refreshed."""
    now = sp.utc_now()
    rng = random.Random(2)
    jobs = [
        build_job_values(
            "work",
            {"n": n},
            queue=sp.DEFAULT_QUEUE if n % 4 else f"small-{n % 16 // 4}",
            process_at=now + timedelta(seconds=rng.uniform(-3600, 3600)),
        )
        for n in range(2000)
    ]
    with engine.connect() as conn:
        conn.execute(sa.insert(statements.JOB), jobs)
        conn.commit()
        if engine.dialect.name == "postgresql":
            conn.exec_driver_sql("ANALYZE proletarian_job")
        elif engine.dialect.name == "sqlite":
            conn.exec_driver_sql("ANALYZE")
        else:
            conn.exec_driver_sql("ANALYZE TABLE proletarian_job").all()
        conn.commit()
    return engine


def explain(engine: sa.Engine, prefix: str, queue: str) -> list[Any]:
    statement, params = statements.poll(queue, sp.utc_now())
    with engine.connect() as conn:
        rows = conn.execute(Explain(statement, prefix), params).all()
        conn.rollback()
    return rows


def plan_nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
    return [node, *(n for child in node.get("Plans", []) for n in plan_nodes(child))]


def check_plan(busy_engine: sa.Engine, backend: str, queue: str) -> None:
    if backend == "postgresql":
        (row,) = explain(busy_engine, "EXPLAIN (FORMAT JSON) ", queue)
        document = row[0] if not isinstance(row[0], str) else json.loads(row[0])
        nodes = plan_nodes(document[0]["Plan"])
        kinds = [node["Node Type"] for node in nodes]
        scans = [node for node in nodes if "Scan" in node["Node Type"]]
        assert [node.get("Index Name") for node in scans] == [INDEX], kinds
        assert scans[0]["Node Type"] in ("Index Scan", "Index Only Scan"), kinds
        assert "Sort" not in kinds and "Incremental Sort" not in kinds, kinds
        assert "LockRows" in kinds, kinds
    elif backend == "mariadb":
        (row,) = explain(busy_engine, "EXPLAIN ", queue)
        plan = row._mapping
        assert plan["key"] == INDEX, dict(plan)
        assert plan["type"] in ("range", "ref"), dict(plan)
        assert "filesort" not in (plan["Extra"] or ""), dict(plan)
        assert "temporary" not in (plan["Extra"] or ""), dict(plan)
    else:
        details = [row.detail for row in explain(busy_engine, "EXPLAIN QUERY PLAN ", queue)]
        assert any(f"USING INDEX {INDEX}" in detail for detail in details), details
        assert not any("TEMP B-TREE" in detail for detail in details), details
        assert not any(detail.startswith("SCAN") for detail in details), details


def test_the_poll_of_a_busy_and_of_a_small_queue_reads_the_index_in_order_without_sorting(
    busy_engine: sa.Engine, backend: str
) -> None:
    for queue in (sp.DEFAULT_QUEUE, "small-1"):
        check_plan(busy_engine, backend, queue)
