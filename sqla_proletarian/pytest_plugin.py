"""pytest plugin of sqla-proletarian (registered through the ``pytest11`` entry point).

It only adds fixtures, which do nothing until a test asks for them:

- ``proletarian_engine``: yours to define (in your ``conftest.py``), returning the Engine of
  your test database; the plugin's own version only fails, saying so.
- ``proletarian_tables``: the library's tables on that engine for one test, empty; it yields
  the engine. Tables it had to create are dropped after the test. Tables that were there
  already (your migrations made them) must be empty: it refuses, deleting nothing, tables
  that hold rows (a developer's own database, say), and afterwards deletes the rows the
  test added to them.
- ``proletarian_drain``: ``drain(handler, **worker_options) -> int`` bound to that engine
  (``sqla_proletarian.testing.drain``), with the tables in place.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, Table, delete, func, inspect, select

from sqla_proletarian.models import metadata
from sqla_proletarian.testing import drain

Drain = Callable[..., int]


@pytest.fixture
def proletarian_engine() -> Engine:
    """The Engine of your test database: define this fixture yourself, in ``conftest.py``."""
    pytest.fail(
        "the proletarian_tables and proletarian_drain fixtures need your test database: "
        "define a fixture named proletarian_engine in your conftest.py that returns its "
        "sqlalchemy Engine (SQLite for speed, your real server in CI)",
        pytrace=False,
    )


@pytest.fixture
def proletarian_tables(proletarian_engine: Engine) -> Iterator[Engine]:
    """The library's tables on ``proletarian_engine`` for this test, empty; yields the engine.

    Tables it creates are dropped afterwards. Tables that existed already must hold no row
    (else the test errors, and nothing is deleted); the rows the test added to them are
    deleted afterwards.
    """
    engine = proletarian_engine
    if not isinstance(engine, Engine):
        pytest.fail(
            f"proletarian_engine returned {type(engine).__name__}; return a sqlalchemy Engine",
            pytrace=False,
        )
    tables = metadata.sorted_tables
    existing = set(inspect(engine).get_table_names())
    created = [table for table in tables if table.name not in existing]
    _refuse_rows(engine, [table for table in tables if table not in created])
    metadata.create_all(engine, tables=created)
    try:
        yield engine
    finally:
        with engine.begin() as conn:
            for table in reversed(tables):
                if table not in created:
                    conn.execute(delete(table))
        metadata.drop_all(engine, tables=created)


def _refuse_rows(engine: Engine, tables: list[Table]) -> None:
    """Fail the test, touching nothing, if any of ``tables`` holds a row: they are not the
    test's own, and emptying them afterwards would delete someone's jobs."""
    with engine.connect() as conn:
        held = {
            table.name: count
            for table in tables
            if (count := conn.execute(select(func.count()).select_from(table)).scalar_one())
        }
    if held:
        rows = ", ".join(f"{name}: {count}" for name, count in held.items())
        pytest.fail(
            f"proletarian_tables: the queue tables of "
            f"{engine.url.render_as_string(hide_password=True)} already hold rows ({rows}), "
            "and the fixture never deletes rows a test did not create: point "
            "proletarian_engine at a database of the tests' own (a fresh SQLite file, or an "
            "empty test database), or empty those tables first if their rows are disposable",
            pytrace=False,
        )


@pytest.fixture
def proletarian_drain(proletarian_tables: Engine) -> Drain:
    """``drain(handler, **worker_options)``: run the due jobs on the test's engine now, in
    this thread, and return how many runs ended (see ``sqla_proletarian.testing.drain``)."""

    def drain_jobs(handler: Callable[..., Any], **worker_options: Any) -> int:
        return drain(proletarian_tables, handler, **worker_options)

    return drain_jobs
