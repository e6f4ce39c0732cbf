"""The registry of the hot path (``statements.hot_path``), without a database: every entry
builds on every server that sends it, says when it runs, and has a shape of its own, so that
each statement the worker sends matches one entry; ``shape`` reads the texts the drivers are
sent (expanded IN lists, executemany rows, CASE arms, casts) as the compiled text."""

from __future__ import annotations

import pytest
from sqlalchemy.dialects import mysql, postgresql

from sqla_proletarian.dialects import DIALECTS
from sqla_proletarian.statements.hot_path import HOT_PATH, hot_path, shape

SERVERS = {
    "postgresql": postgresql.psycopg.dialect(),
    "mariadb": mysql.pymysql.dialect(is_mariadb=True),
}


@pytest.mark.parametrize("server", sorted(SERVERS))
def test_each_entry_builds_says_when_it_runs_and_has_a_shape_no_other_has(server: str) -> None:
    dialect, sql_dialect = DIALECTS[server], SERVERS[server]
    shapes: dict[str, str] = {}
    for entry in hot_path(dialect):
        assert entry.when, entry.name
        taken = shapes.setdefault(shape(entry.text(dialect, sql_dialect)), entry.name)
        assert taken == entry.name, f"{entry.name} has the shape of {taken}"
    assert len(shapes) > 50


def test_the_servers_send_their_own_forms() -> None:
    postgres = {entry.name for entry in hot_path(DIALECTS["postgresql"])}
    mariadb = {entry.name for entry in hot_path(DIALECTS["mariadb"])}
    assert {"poll_first", "due_run_orders", "archive_succeeded", "archive_lease"} <= postgres
    assert {"first_entry", "first_entry_after", "archive_succeeded_copy"} <= mariadb
    assert not {"poll_first", "archive_succeeded", "start_runs_batch"} & mariadb
    assert not {"first_entry", "archive_succeeded_copy", "idle_limits"} & postgres
    assert set(HOT_PATH) == postgres | mariadb


@pytest.mark.parametrize(
    ("sent", "compiled"),
    [
        # An expanding IN list, with PostgreSQL's casts and psycopg's binary arrays.
        (
            "DELETE FROM t WHERE t.id IN (%(ids_1)s::UUID, %(ids_2)s::UUID) AND t.a = %(a)b",
            "DELETE FROM t WHERE t.id IN (__[POSTCOMPILE_ids]) AND t.a = %(a)s",
        ),
        # A list of pairs, and an empty NOT IN.
        (
            "DELETE FROM t WHERE (t.a, t.b) IN ((%s, %s), (%s, %s)) AND (t.c NOT IN (NULL) OR "
            "(1 = 1))",
            "DELETE FROM t WHERE (t.a, t.b) IN (__[POSTCOMPILE_runs]) AND (t.c NOT IN "
            "(__[POSTCOMPILE_full]))",
        ),
        # A CASE arm per row, and a timestamp's cast.
        (
            "UPDATE s SET j=CASE s.n WHEN %(p_1)s THEN %(j_1)s WHEN %(p_2)s THEN %(j_2)s END, "
            "at=%(at)s::TIMESTAMP WITH TIME ZONE",
            "UPDATE s SET j=CASE s.n WHEN %(p_1)s THEN %(j_1)s END, at=%(at)s",
        ),
    ],
)
def test_a_sent_text_has_the_shape_of_its_compiled_text(sent: str, compiled: str) -> None:
    assert shape(sent) == shape(compiled)


def test_statements_that_differ_beyond_their_parameters_differ_in_shape() -> None:
    assert shape("SELECT a FROM t WHERE b = %s") != shape("SELECT a FROM t WHERE c = %s")
    assert shape("SELECT a FROM t WHERE b IN (%s)") != shape("SELECT a FROM t WHERE b = %s")
