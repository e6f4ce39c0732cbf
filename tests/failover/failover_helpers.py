"""What the failover tests share: the PostgreSQL pair (``scripts/pgpair.sh``) and a fresh
database on it, enqueueing, counting the archive, waiting, and a handler that records the
jobs it ran."""

from __future__ import annotations

import collections
import contextlib
import os
import shlex
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL, make_url
from sqlalchemy.orm import Session

import sqla_proletarian as sp
from sqla_proletarian import statements

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

    def cut_replication(self) -> None:
        """Make the standby stop receiving: its WAL receiver is pointed at a port where no
        server listens (what a network partition or a standby far behind does). On an
        asynchronous pair the primary goes on committing what the standby will never have."""
        standby = self.engine("standby", poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT")
        with standby.connect() as conn:
            conn.exec_driver_sql(
                "ALTER SYSTEM SET primary_conninfo = 'host=127.0.0.1 port=1 connect_timeout=1'"
            )
            conn.exec_driver_sql("SELECT pg_reload_conf()")

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


#: The worker options of each mode (lease mode: short leases, so that a test would see a
#: lease left to expire).
MODES: dict[str, dict[str, Any]] = {"transaction": {}, "lease": {"lease_seconds": 5}}


def enqueue(engine: sa.Engine, count: int) -> list[uuid.UUID]:
    """Enqueue ``count`` jobs in one transaction; their ids."""
    with Session(engine) as session:
        ids = [sp.enqueue(session, "work", {"n": n}) for n in range(count)]
        session.commit()
    return ids


def archive(engine: sa.Engine) -> list[Any]:
    """The archive's rows (job id, status, attempts)."""
    with engine.connect() as conn:
        table = statements.ARCHIVE
        query = sa.select(table.c.job_id, table.c.status, table.c.attempts)
        return list(conn.execute(query).all())


def count(engine: sa.Engine, table: Any) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one())


def wait_until(
    condition: Callable[[], bool], what: str, worker: Any = None, timeout: float = 60.0
) -> None:
    """Wait until ``condition()`` holds (a database error counts as not yet), failing after
    ``timeout`` seconds or as soon as ``worker`` stopped."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if condition():
                return
        except sa.exc.DBAPIError:
            pass  # the server is changing hands
        if worker is not None and not worker.running:
            pytest.fail(f"the worker stopped while waiting until {what}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting until {what}")
        time.sleep(0.05)


class Runs:
    """A handler that records each run of a job (the runs of jobs running at the moment of
    the failover may repeat)."""

    def __init__(self, pause: float = 0.0) -> None:
        self.pause = pause
        self.counts: collections.Counter[uuid.UUID] = collections.Counter()
        self._lock = threading.Lock()

    def __call__(self, job: sp.JobContext) -> None:
        with self._lock:
            self.counts[job.job_id] += 1
        if self.pause:
            time.sleep(self.pause)

    def __len__(self) -> int:
        with self._lock:
            return len(self.counts)

    def reruns(self) -> int:
        with self._lock:
            return sum(runs - 1 for runs in self.counts.values())


def events(records: list[Any], name: str) -> list[Any]:
    return [record for record in records if getattr(record, "event", None) == name]
