"""Fixtures of the failover suite: a PostgreSQL primary with a streaming standby
(``scripts/pgpair.sh``), and a fresh database on it for each test.

The pair is made (or rebuilt after the previous test's failover) by ``pgpair.sh ensure``
before each test; its settings come from the environment (``SP_PGPAIR_DIR``, the ports,
``SP_PGPAIR_SYNC``). Where the pair cannot run (no PostgreSQL 15 binaries) the tests are
skipped, and under ``CI`` that is an error. A test holds the pair alone (the lock file
``$SP_PGPAIR_DIR.tests.lock`` beside its state dir, which tests/replica takes too), since a
failover ends every other test's primary.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from failover_helpers import Pair, pair_env

import sqla_proletarian as sp


@pytest.fixture
def pair() -> Iterator[Pair]:
    """A healthy pair held by this test alone, with a fresh database (the library's tables
    created) on its primary."""
    lock_path = Path(os.environ.get("SP_PGPAIR_DIR", "/tmp/sqla-proletarian-pgpair"))
    with open(f"{lock_path}.tests.lock", "w") as lock:
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
