"""Shared fixtures: one fresh database per test on every backend the run covers.

Backends: SQLite always; PostgreSQL and MariaDB from ``SP_TEST_POSTGRESQL_URL`` and
``SP_TEST_MARIADB_URL`` (admin URLs; ``make test`` starts the servers and sets them).
``SP_TEST_BACKENDS`` (comma list) narrows the run. Under ``CI`` a missing server is an error,
never a silent skip.

``SP_TEST_POSTGRESQL_DRIVER`` (e.g. ``psycopg2``) runs every PostgreSQL test through another
driver; ``make test`` reruns the worker's conformance tests that way.

``SP_TEST_POSTGRESQL_VERSION`` (a major version, e.g. ``18``) stops the run at its start unless
the server at ``SP_TEST_POSTGRESQL_URL`` is that version: ``make test`` reruns the core suites
on PostgreSQL 18 with both set, so that rerun cannot pass on another server unnoticed.

``driver_database`` runs a test once per driver of each backend (psycopg 3 and psycopg2 on
PostgreSQL, PyMySQL on MariaDB, pysqlite): the same fresh database, reached through that
driver. ``@pytest.mark.backends("postgresql", ...)`` narrows such a test to some backends.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL, make_url

import sqla_proletarian as sp

ALL_BACKENDS = ("sqlite", "postgresql", "mariadb")
SERVER_URL_VARS = {"postgresql": "SP_TEST_POSTGRESQL_URL", "mariadb": "SP_TEST_MARIADB_URL"}
#: The drivers ``driver_database`` runs each backend through, and the module each imports.
DRIVERS = {
    "sqlite": ("pysqlite",),
    "postgresql": ("psycopg", "psycopg2"),
    "mariadb": ("pymysql",),
}
DRIVER_MODULES = {
    "pysqlite": "sqlite3",
    "psycopg": "psycopg",
    "psycopg2": "psycopg2",
    "pymysql": "pymysql",
}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--soak", action="store_true", help="run the long fault-injection soak")


POSTGRESQL_SERVER_VERSION = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "backends(*names): run a driver_database test on these backends only"
    )
    if not hasattr(config, "workerinput"):  # once, in the controller of an xdist run
        version = checked_postgresql_version()
        if version:
            config.stash[POSTGRESQL_SERVER_VERSION] = version


def pytest_report_header(config: pytest.Config) -> str | None:
    version = config.stash.get(POSTGRESQL_SERVER_VERSION, None)
    return f"PostgreSQL server: {version}" if version else None


def checked_postgresql_version() -> str | None:
    """The PostgreSQL server's version when ``SP_TEST_POSTGRESQL_VERSION`` asks for a major
    version, after checking that the server has it (a usage error otherwise)."""
    wanted = os.environ.get("SP_TEST_POSTGRESQL_VERSION")
    if not wanted:
        return None
    url = os.environ.get(SERVER_URL_VARS["postgresql"])
    if not url:
        raise pytest.UsageError(
            f"SP_TEST_POSTGRESQL_VERSION={wanted} needs SP_TEST_POSTGRESQL_URL, the server to "
            "check: run the tests with `make test`"
        )
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            version = str(conn.exec_driver_sql("SHOW server_version").scalar_one())
    finally:
        engine.dispose()
    major = re.match(r"\d+", version)
    if major is None or major.group() != wanted:
        raise pytest.UsageError(
            f"SP_TEST_POSTGRESQL_VERSION={wanted}, but the server at SP_TEST_POSTGRESQL_URL is "
            f"PostgreSQL {version}: point SP_TEST_POSTGRESQL_URL at a PostgreSQL {wanted} server "
            "(SP_TEST_POSTGRESQL18_URL from scripts/testdb.sh)"
        )
    return version


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrise ``driver_database`` over every driver of each selected backend."""
    if "driver_database" not in metafunc.fixturenames:
        return
    marker = metafunc.definition.get_closest_marker("backends")
    wanted = marker.args if marker else ALL_BACKENDS
    pairs = [
        (backend, driver)
        for backend in selected_backends()
        if backend in wanted
        for driver in DRIVERS[backend]
    ]
    metafunc.parametrize(
        "driver_database", pairs, indirect=True, ids=[f"{b}-{d}" for b, d in pairs]
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--soak"):
        return
    skip = pytest.mark.skip(reason="soak run: pass --soak (make soak)")
    for item in items:
        if "soak" in item.keywords:
            item.add_marker(skip)


def selected_backends() -> list[str]:
    wanted = os.environ.get("SP_TEST_BACKENDS")
    if not wanted:
        return list(ALL_BACKENDS)
    names = [name.strip() for name in wanted.split(",") if name.strip()]
    unknown = set(names) - set(ALL_BACKENDS)
    if unknown:
        raise pytest.UsageError(f"SP_TEST_BACKENDS names unknown backends: {sorted(unknown)}")
    return names


def server_url(backend: str) -> URL:
    """The admin URL of a server backend, or a skip (an error under CI) when it is absent."""
    value = os.environ.get(SERVER_URL_VARS[backend])
    if not value:
        message = f"{SERVER_URL_VARS[backend]} is not set: run the tests with `make test`"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return make_url(value)


class Database:
    """A throwaway database on one backend: its URL, and how to make engines on it."""

    def __init__(self, backend: str, url: URL) -> None:
        self.backend = backend
        self.url = url
        #: The DBAPI driver of ``url`` ("psycopg", "psycopg2", "pymysql", "pysqlite").
        self.driver = url.get_driver_name()
        self._engines: list[sa.Engine] = []

    def engine(self, **kwargs: object) -> sa.Engine:
        engine = sa.create_engine(self.url, **kwargs)  # type: ignore[arg-type]
        self._engines.append(engine)
        return engine

    def dispose(self) -> None:
        for engine in self._engines:
            engine.dispose()


def _create_database(backend: str, tmp_path: Path) -> tuple[URL, sa.Engine | None, str]:
    if backend == "sqlite":
        return make_url(f"sqlite:///{tmp_path / 'jobs.db'}"), None, ""
    admin_url = server_url(backend)
    name = f"sp_{uuid.uuid4().hex[:16]}"
    admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    with admin.connect() as conn:
        conn.exec_driver_sql(f"CREATE DATABASE {name}")
    url = admin_url.set(database=name)
    driver = os.environ.get("SP_TEST_POSTGRESQL_DRIVER")
    if backend == "postgresql" and driver:
        require_driver(driver)
        url = url.set(drivername=f"postgresql+{driver}")
    return url, admin, name


def _drop_database(backend: str, admin: sa.Engine | None, name: str) -> None:
    if admin is None:
        return
    with admin.connect() as conn:
        if backend == "postgresql":
            conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        else:
            for (pid,) in conn.exec_driver_sql(
                "SELECT id FROM information_schema.processlist WHERE db = %s", (name,)
            ):
                with contextlib.suppress(sa.exc.DBAPIError):
                    conn.exec_driver_sql(f"KILL {int(pid)}")
            conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {name}")
    admin.dispose()


@pytest.fixture(params=selected_backends())
def empty_database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    """A fresh, empty database on each selected backend (no tables)."""
    backend: str = request.param
    url, admin, name = _create_database(backend, tmp_path)
    database = Database(backend, url)
    try:
        yield database
    finally:
        database.dispose()
        _drop_database(backend, admin, name)


@pytest.fixture
def database(empty_database: Database) -> Database:
    """A fresh database on each selected backend, with the library's tables created."""
    engine = empty_database.engine()
    sp.metadata.create_all(engine)
    engine.dispose()
    return empty_database


@pytest.fixture
def engine(database: Database) -> sa.Engine:
    """An engine on a fresh database with the library's tables."""
    return database.engine()


@pytest.fixture
def backend(database: Database) -> str:
    return database.backend


def require_driver(driver: str) -> None:
    """Skip (fail under CI) when a driver's module is not installed."""
    module = DRIVER_MODULES[driver]
    if importlib.util.find_spec(module) is None:
        message = f"the {driver} driver ({module}) is not installed: pip install -e '.[dev]'"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture
def driver_database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    """A fresh database with the library's tables, reached through one driver of its backend
    (parametrised by ``pytest_generate_tests``): ``database.driver`` says which."""
    backend, driver = request.param
    require_driver(driver)
    url, admin, name = _create_database(backend, tmp_path)
    database = Database(backend, url.set(drivername=f"{url.get_backend_name()}+{driver}"))
    try:
        engine = database.engine()
        sp.metadata.create_all(engine)
        engine.dispose()
        yield database
    finally:
        database.dispose()
        _drop_database(backend, admin, name)
