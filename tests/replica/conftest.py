"""A PostgreSQL primary and its streaming standby (``scripts/pgpair.sh``), for the views read
from a replica.

Before each test, ``"$SP_PGPAIR_SCRIPT" ensure`` (else ``scripts/pgpair.sh ensure``) makes
sure a healthy pair runs, and its env file (``$SP_PGPAIR_DIR/env``) gives the two URLs. A
test gets a fresh database of its own on the primary, seen on the standby once replayed.
Without the script or without PostgreSQL the tests are skipped; under ``CI`` that is an error.

The tests take turns on the pair (the lock file ``$SP_PGPAIR_DIR.tests.lock``, beside the
state directory), also across xdist workers: one of them pauses the standby's replay, which
would hold up the others' waits, and any other suite that fails the pair over should hold
the same lock.
"""

from __future__ import annotations

import fcntl
import os
import shlex
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import sqlalchemy as sa
from replica_support import Replicated, set_replay
from sqlalchemy.engine import URL, make_url

import sqla_proletarian as sp

ROOT = Path(__file__).resolve().parents[2]


def _absent(message: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def _state_dir() -> Path:
    return Path(os.environ.get("SP_PGPAIR_DIR", "/tmp/sqla-proletarian-pgpair"))


def _script() -> Path:
    given = os.environ.get("SP_PGPAIR_SCRIPT")
    return Path(given) if given else ROOT / "scripts" / "pgpair.sh"


def _read_env(path: Path) -> dict[str, str]:
    """The ``export NAME=VALUE`` lines of the pair's env file."""
    found = {}
    for line in path.read_text().splitlines():
        words = shlex.split(line, comments=True)
        if len(words) == 2 and words[0] == "export" and "=" in words[1]:
            name, _, value = words[1].partition("=")
            found[name] = value
    return found


@dataclass
class Pair:
    """The running pair: the admin URL of each server."""

    primary_url: URL
    standby_url: URL


@pytest.fixture
def pair() -> Iterator[Pair]:
    """A healthy primary and standby (``pgpair.sh ensure``), this test's alone while it runs."""
    script = _script()
    if not script.exists():
        _absent(f"{script} is not there: set SP_PGPAIR_SCRIPT to the pair's script")
    state = _state_dir()
    state.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{state}.tests.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = subprocess.run([str(script), "ensure"], capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            _absent(f"{script} ensure failed ({done.returncode}): {done.stderr.strip()}")
        env = _read_env(state / "env")
        yield Pair(
            make_url(env["SP_TEST_PGPAIR_PRIMARY_URL"]),
            make_url(env["SP_TEST_PGPAIR_STANDBY_URL"]),
        )


@pytest.fixture
def replicated(pair: Pair) -> Iterator[Replicated]:
    """A fresh database with the library's tables on the primary, replayed on the standby."""
    name = f"sp_{uuid.uuid4().hex[:16]}"
    admin = sa.create_engine(
        pair.primary_url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool
    )
    with admin.connect() as conn:
        conn.exec_driver_sql(f"CREATE DATABASE {name}")
    primary_url = pair.primary_url.set(database=name)
    standby_url = pair.standby_url.set(database=name)
    primary = sa.create_engine(primary_url)
    standby = sa.create_engine(standby_url, poolclass=sa.pool.NullPool)
    database = Replicated(primary, standby, primary_url, standby_url)
    try:
        sp.metadata.create_all(primary)
        database.replayed()
        yield database
    finally:
        standby_admin = sa.create_engine(pair.standby_url, poolclass=sa.pool.NullPool)
        set_replay(standby_admin, paused=False)  # a failed test may leave it paused
        standby_admin.dispose()
        primary.dispose()
        with admin.connect() as conn:
            conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        admin.dispose()
