"""The benchmark's durable servers (scripts/benchdb.sh) and its scratch databases on them."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "benchdb.sh"
#: The databases the benchmark creates on each server: one for the library's and the raw
#: loops' drains, one that keeps a deep queue for the whole run, and on PostgreSQL one each
#: for pgqueuer and procrastinate.
DATABASES = ("bench", "bench_deep")
POSTGRESQL_DATABASES = (*DATABASES, "bench_pgqueuer", "bench_procrastinate")


@dataclass(frozen=True)
class Server:
    """One server: its label and the SQLAlchemy URL of each scratch database."""

    label: str
    urls: dict[str, str]

    @property
    def is_postgresql(self) -> bool:
        return self.urls["bench"].startswith("postgresql")

    def engine(self, database: str = "bench", **options: object) -> sa.Engine:
        return sa.create_engine(self.urls[database], pool_size=20, max_overflow=10, **options)

    def libpq_dsn(self, database: str = "bench") -> str:
        """The plain libpq URL, for pgqueuer and procrastinate (PostgreSQL only)."""
        return (
            sa.make_url(self.urls[database])
            .set(drivername="postgresql")
            .render_as_string(hide_password=False)
        )


def _run(command: str) -> str:
    done = subprocess.run(
        ["bash", str(SCRIPT), command], check=True, capture_output=True, text=True
    )
    return done.stdout + done.stderr


def _env() -> dict[str, str]:
    lines = _run("env").splitlines()
    pairs = (line.removeprefix("export ").split("=", 1) for line in lines if "=" in line)
    return dict(pairs)


def _create_databases(admin_url: str, names: tuple[str, ...]) -> dict[str, str]:
    engine = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    urls = {}
    with engine.connect() as conn:
        for name in names:
            quoted = conn.dialect.identifier_preparer.quote(name)
            conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {quoted}")
            conn.exec_driver_sql(f"CREATE DATABASE {quoted}")
            urls[name] = sa.make_url(admin_url).set(database=name).render_as_string(False)
    engine.dispose()
    return urls


@contextlib.contextmanager
def durable_servers(keep: bool = False) -> Iterator[list[Server]]:
    """Start the durable servers (unless running), yield them, and stop them unless ``keep``
    or they were running before."""
    was_running = subprocess.run(["bash", str(SCRIPT), "status"], capture_output=True).returncode
    print(_run("start").strip())
    try:
        env = _env()
        yield [
            Server(
                "PostgreSQL 15",
                _create_databases(env["SP_BENCH_POSTGRESQL_URL"], POSTGRESQL_DATABASES),
            ),
            Server("MariaDB 10.11", _create_databases(env["SP_BENCH_MARIADB_URL"], DATABASES)),
        ]
    finally:
        if not keep and was_running != 0 and not os.environ.get("SP_BENCH_KEEP_SERVERS"):
            _run("stop")
            print("benchdb: servers stopped")
