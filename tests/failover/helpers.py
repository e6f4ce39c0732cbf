"""What the failover tests share: enqueueing, counting the archive, waiting, and handlers
that record the jobs they ran."""

from __future__ import annotations

import collections
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

import sqla_proletarian as sp
from sqla_proletarian import statements

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
