"""Fixtures of the Galera suite: a fresh database on a three-node MariaDB Galera cluster, an
engine on each node, and lease-mode workers on each that note what their handlers saw.

The cluster comes from ``scripts/galera.sh start``: its URLs from ``SP_TEST_GALERA_URLS``
(space separated), else from ``$SP_GALERA_DIR/env`` (``/tmp/sqla-proletarian-galera/env``).
Without a cluster the tests skip; under ``CI`` that is an error. Before each test
``galera.sh ensure`` makes sure all three nodes are up and synced (a test that killed one
leaves it to be restarted).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL, make_url
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

import sqla_proletarian as sp

DEFAULT_DIR = "/tmp/sqla-proletarian-galera"
#: Long enough that no lease expires in a fault-free test.
LEASE = 30.0


def _env_file_values() -> dict[str, str]:
    """The ``export NAME=value`` lines of the cluster's env file, if it exists."""
    path = Path(os.environ.get("SP_GALERA_DIR", DEFAULT_DIR)) / "env"
    if not path.exists():
        return {}
    values = {}
    for line in path.read_text().splitlines():
        words = shlex.split(line)
        if len(words) == 2 and words[0] == "export" and "=" in words[1]:
            name, _, value = words[1].partition("=")
            values[name] = value
    return values


def _setting(name: str) -> str | None:
    return os.environ.get(name) or _env_file_values().get(name)


def cluster_urls() -> list[URL]:
    """The three nodes' admin URLs, or a skip (a failure under CI) without a cluster."""
    value = _setting("SP_TEST_GALERA_URLS")
    if not value:
        message = (
            "no Galera cluster: run scripts/galera.sh start (or set SP_TEST_GALERA_URLS to "
            "the three nodes' URLs)"
        )
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    urls = [make_url(url) for url in value.split()]
    assert len(urls) == 3, f"SP_TEST_GALERA_URLS names {len(urls)} nodes, not 3"
    return urls


def galera_script(*args: str, timeout: float = 120) -> None:
    """Run scripts/galera.sh (the one that started the cluster) with ``args``."""
    script = _setting("SP_GALERA_SCRIPT") or str(
        Path(__file__).resolve().parents[2] / "scripts" / "galera.sh"
    )
    done = subprocess.run(
        [script, *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, f"galera.sh {' '.join(args)}: {done.stderr[-2000:]}"


def cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run the command line (``python -m sqla_proletarian``) in ``cwd``, with this
    process's package and ``cwd`` on its path, to its end."""
    return subprocess.run(
        [sys.executable, "-m", "sqla_proletarian", *args],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(cwd), *sys.path])},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


class Cluster:
    """A fresh database on the cluster: its URL on each node, engines on each node."""

    def __init__(self, urls: list[URL]) -> None:
        self.urls = urls
        self._engines: list[sa.Engine] = []

    def engine(self, node: int, **kwargs: Any) -> sa.Engine:
        """An engine on node ``node`` (0, 1 or 2)."""
        engine = sa.create_engine(self.urls[node], **kwargs)
        self._engines.append(engine)
        return engine

    def engines(self, **kwargs: Any) -> list[sa.Engine]:
        """An engine on each node."""
        return [self.engine(node, **kwargs) for node in range(3)]

    def create_all(self, metadata: sa.MetaData) -> None:
        """Create ``metadata``'s tables on node 1, and wait until every node has them (the
        other nodes apply the replicated DDL a moment later)."""
        with self.engine(0, poolclass=sa.pool.NullPool).begin() as conn:
            metadata.create_all(conn)
        names = set(metadata.tables)
        for node in range(3):
            engine = self.engine(node, poolclass=sa.pool.NullPool)
            assert wait_for(lambda engine=engine: names <= _tables(engine), timeout=30), node

    def dispose(self) -> None:
        for engine in self._engines:
            engine.dispose()


def _tables(engine: sa.Engine) -> set[str]:
    with engine.connect() as conn:
        return set(
            conn.execute(
                sa.text(
                    "SELECT table_name FROM information_schema.tables "
                    "WHERE table_schema = DATABASE()"
                )
            ).scalars()
        )


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A fresh database with the library's tables on a three-node Galera cluster whose
    nodes are all up and synced (CREATE DATABASE and CREATE TABLE replicate at once)."""
    admin_urls = cluster_urls()
    galera_script("ensure")
    name = f"sp_{uuid.uuid4().hex[:16]}"
    admin = sa.create_engine(
        admin_urls[0], isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool
    )
    with admin.connect() as conn:
        conn.exec_driver_sql(f"CREATE DATABASE {name}")
    found = Cluster([url.set(database=name) for url in admin_urls])
    found.create_all(sp.metadata)
    try:
        yield found
    finally:
        found.dispose()
        with contextlib.suppress(sa.exc.DBAPIError), admin.connect() as conn:
            conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {name}")
        admin.dispose()


class Noted:
    """What handlers saw, noted by the handlers themselves: each run's job id, node and
    start and end times (``time.monotonic``, one process)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.runs: list[tuple[uuid.UUID, int, float, float]] = []

    def handler(self, node: int, seconds: float = 0.0) -> Callable[[Any], None]:
        def handle(job: Any) -> None:
            began = time.monotonic()
            if seconds:
                time.sleep(seconds)
            with self.lock:
                self.runs.append((job.job_id, node, began, time.monotonic()))

        return handle

    def counts(self) -> Counter[uuid.UUID]:
        with self.lock:
            return Counter(job_id for job_id, *_ in self.runs)


class Base(DeclarativeBase):
    pass


class Done(Base):
    """A row each handler writes through ``job.session``: it commits with the job's
    completion only, so its rows count the completions that committed (archivings)."""

    __tablename__ = "galera_done"
    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[uuid.UUID] = mapped_column(sa.Uuid())


class Records(logging.Handler):
    """Every log record of the library's loggers, kept for a test to look at."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def at_least(self, level: int) -> list[str]:
        return [
            f"{r.levelname} {getattr(r, 'event', '')}: {r.getMessage()[:300]}"
            for r in self.records
            if r.levelno >= level
        ]


@pytest.fixture
def records() -> Iterator[Records]:
    """The library's log records during the test."""
    handler = Records()
    root = logging.getLogger("sqla_proletarian")
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def is_lock_conflict(exc: BaseException) -> bool:
    """A Galera certification failure or brute-force abort (or a deadlock): 1213."""
    orig = getattr(exc, "orig", None)
    return bool(orig is not None and getattr(orig, "args", (None,))[0] == 1213)


T = TypeVar("T")


def committed(engine: sa.Engine, work: Callable[[sa.Connection], T], tries: int = 20) -> T:
    """``work`` in a transaction of its own on ``engine``, committed; made again when it
    loses a lock conflict, as every writer to a Galera cluster must (two nodes' enqueues
    with one unique key conflict at commit: see docs/guide/databases.md)."""
    for left in range(tries - 1, -1, -1):
        try:
            with engine.begin() as conn:
                return work(conn)
        except sa.exc.OperationalError as exc:
            if not left or not is_lock_conflict(exc):
                raise
            time.sleep(0.01)
    raise AssertionError("unreachable")


def enqueue_round_robin(engines: list[sa.Engine], count: int, **kw: Any) -> list[uuid.UUID]:
    """``count`` jobs, enqueued in turn on each node (one committed batch per node)."""
    ids: list[uuid.UUID] = []
    for node, engine in enumerate(engines):
        jobs = [("t", n) for n in range(node, count, len(engines))]
        ids += committed(engine, lambda conn, jobs=jobs: sp.enqueue_many(conn, jobs, **kw))
    return ids


@contextlib.contextmanager
def causal(engine: sa.Engine) -> Iterator[sa.Connection]:
    """A connection whose reads wait until its node has applied every write the cluster
    committed before them (``wsrep_sync_wait``): a node applies other nodes' writes a
    moment after their commit."""
    with engine.connect() as conn:
        conn.exec_driver_sql("SET SESSION wsrep_sync_wait = 1")
        try:
            yield conn
        finally:
            conn.rollback()
            conn.exec_driver_sql("SET SESSION wsrep_sync_wait = 0")


def queued(engine: sa.Engine) -> int:
    with causal(engine) as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(sp.Job)).scalar_one())


def archived_rows(engine: sa.Engine) -> list[Any]:
    """(job_id, status, attempts) of every archived job."""
    table = sp.ArchivedJob.__table__
    with causal(engine) as conn:
        return list(conn.execute(sa.select(table.c.job_id, table.c.status, table.c.attempts)))


def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
    return True


@contextlib.contextmanager
def workers_on_each_node(
    engines: list[sa.Engine],
    make_handler: Callable[[int], Callable[[Any], None]],
    **options: Any,
) -> Iterator[list[sp.QueueWorker]]:
    """A lease-mode worker on each node, stopped at the end of the block."""
    settings = {
        "lease_seconds": LEASE,
        "handler_mode": "advanced",
        "polling_interval": 0.05,
        "worker_threads": 3,
        **options,
    }
    workers = [
        sp.create_queue_worker(engine, make_handler(node), worker_id=f"node{node}", **settings)
        for node, engine in enumerate(engines)
    ]
    try:
        for worker in workers:
            worker.start()
        yield workers
    finally:
        for worker in workers:
            worker.stop()


#: Report lines of the fault tests, printed at the end of the run (each test prints its own
#: too, seen with -s).
REPORT: list[str] = []


def report(line: str) -> None:
    print(line)
    REPORT.append(line)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if REPORT:
        terminalreporter.write_sep("=", "galera fault report")
        for line in REPORT:
            terminalreporter.write_line(line)
