"""pytest plugin of sqla-proletarian (registered through the ``pytest11`` entry point).

It only adds fixtures, which do nothing until a test asks for them:

- ``proletarian_engine``: yours to define (in your ``conftest.py``), returning the Engine of
  your test database; the plugin's own version only fails, saying so.
- ``proletarian_tables``: the library's tables on that engine for one test; it yields the
  engine. Tables it had to create are dropped after the test; tables that were there
  already (your migrations made them) are emptied instead.
- ``proletarian_drain``: ``drain(handler, **worker_options) -> int`` bound to that engine
  (``sqla_proletarian.testing.drain``), with the tables in place.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, delete, inspect

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
    """The library's tables on ``proletarian_engine`` for this test; yields the engine.

    Tables it creates are dropped afterwards; tables that existed already are emptied.
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
    metadata.create_all(engine, tables=created)
    try:
        yield engine
    finally:
        with engine.begin() as conn:
            for table in reversed(tables):
                if table not in created:
                    conn.execute(delete(table))
        metadata.drop_all(engine, tables=created)


@pytest.fixture
def proletarian_drain(proletarian_tables: Engine) -> Drain:
    """``drain(handler, **worker_options)``: run the due jobs on the test's engine now, in
    this thread, and return how many runs ended (see ``sqla_proletarian.testing.drain``)."""

    def drain_jobs(handler: Callable[..., Any], **worker_options: Any) -> int:
        return drain(proletarian_tables, handler, **worker_options)

    return drain_jobs
