"""Fixtures of the failover suite: a PostgreSQL primary with a streaming standby
(``scripts/pgpair.sh``), and a fresh database on it for each test.

The pair is made (or rebuilt after the previous test's failover) by ``pgpair.sh ensure``
before each test; its settings come from the environment (``SP_PGPAIR_DIR``, the ports,
``SP_PGPAIR_SYNC``). Where the pair cannot run (no PostgreSQL 15 binaries) the tests are
skipped, and under ``CI`` that is an error. A test holds the pair alone (a file lock beside
its state dir), since a failover ends every other test's primary.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shlex
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL, make_url

import sqla_proletarian as sp

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "pgpair.sh"


def pair_env() -> dict[str, str]:
    """``pgpair.sh ensure``, then the pair's env file as a dict; a skip (a failure under
    CI) when the pair cannot run."""
    done = subprocess.run(
        [str(SCRIPT), "ensure"], capture_output=True, text=True, timeout=180, check=False
    )
    if done.returncode != 0:
        message = f"no PostgreSQL primary/standby pair ({SCRIPT} ensure): {done.stderr.strip()}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    env_file = Path(os.environ.get("SP_PGPAIR_DIR", "/tmp/sqla-proletarian-pgpair")) / "env"
    values: dict[str, str] = {}
    for line in env_file.read_text().splitlines():
        name, _, value = line.removeprefix("export ").partition("=")
        values[name] = shlex.split(value)[0] if value else ""
    return values


class Pair:
    """A fresh database on the pair's primary, and the URLs that reach it."""

    def __init__(self, env: dict[str, str], name: str) -> None:
        self.env = env
        self.name = name
        #: Whether a commit waits for the standby (SP_PGPAIR_SYNC, on by default).
        self.synchronous = env["SP_PGPAIR_SYNC"] != "0"
        self._engines: list[sa.Engine] = []

    def url(self, which: str, driver: str = "psycopg") -> URL:
        """The database's URL on the ``primary``, the ``standby`` or ``multihost`` (both,
        with target_session_attrs=read-write), through ``driver``."""
        url = make_url(self.env[f"SP_TEST_PGPAIR_{which.upper()}_URL"])
        return url.set(drivername=f"postgresql+{driver}", database=self.name)

    def engine(self, which: str, driver: str = "psycopg", **kwargs: object) -> sa.Engine:
        engine = sa.create_engine(self.url(which, driver), **kwargs)  # type: ignore[arg-type]
        self._engines.append(engine)
        return engine

    def failover(self) -> None:
        """Stop the primary at once and promote the standby (until it takes writes)."""
        done = subprocess.run(
            [self.env["SP_PGPAIR_SCRIPT"], "failover"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr

    def replayed(self) -> None:
        """Wait until the standby has replayed what the primary committed (a synchronous
        commit waits for the standby to store it, not to apply it)."""
        primary = self.engine("primary", poolclass=sa.pool.NullPool)
        standby = self.engine("standby", poolclass=sa.pool.NullPool)
        with primary.connect() as conn:
            lsn = conn.exec_driver_sql("SELECT pg_current_wal_lsn()::text").scalar_one()
        query = sa.text("SELECT pg_last_wal_replay_lsn() >= CAST(:lsn AS pg_lsn)")
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(sa.exc.DBAPIError), standby.connect() as conn:
                if conn.execute(query, {"lsn": lsn}).scalar_one():
                    return
            assert time.monotonic() < deadline, "the standby did not catch up in 60 s"
            time.sleep(0.02)

    def dispose(self) -> None:
        for engine in self._engines:
            engine.dispose()


@pytest.fixture
def pair() -> Iterator[Pair]:
    """A healthy pair held by this test alone, with a fresh database (the library's tables
    created) on its primary."""
    lock_path = Path(os.environ.get("SP_PGPAIR_DIR", "/tmp/sqla-proletarian-pgpair"))
    with open(f"{lock_path}.use.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        env = pair_env()
        name = f"sp_{uuid.uuid4().hex[:16]}"
        admin = sa.create_engine(
            env["SP_TEST_PGPAIR_PRIMARY_URL"],
            isolation_level="AUTOCOMMIT",
            poolclass=sa.pool.NullPool,
        )
        with admin.connect() as conn:
            conn.exec_driver_sql(f"CREATE DATABASE {name}")
        admin.dispose()
        database = Pair(env, name)
        engine = database.engine("primary", poolclass=sa.pool.NullPool)
        sp.metadata.create_all(engine)
        try:
            yield database
        finally:
            database.dispose()
            # Without a failover the pair lives on: leave it as found (a failover's next
            # `ensure` makes a new, empty pair anyway).
            with contextlib.suppress(sa.exc.DBAPIError):
                admin = sa.create_engine(
                    database.url("multihost").set(database="postgres"),
                    isolation_level="AUTOCOMMIT",
                    poolclass=sa.pool.NullPool,
                )
                with admin.connect() as conn:
                    conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
                admin.dispose()
