"""Workflows: jobs that run after other jobs, and the end of a job told to whoever waits.

A job enqueued with ``depends_on`` is written with one ``proletarian_dependency`` row per
dependency and ``waiting_on``, the number of them not yet ended (a row is ``pending`` until
its dependency's end is counted). While ``waiting_on`` is above 0 the job WAITS: its
``process_at`` is ``WAITING_AT``, which no poll reaches, and ``due_at`` holds its own due time.

Whatever ends a job (a success, a failure, a cancel, in either mode) calls ``settle`` in the
same transaction: it locks the rows pending on the ended jobs, marks them settled, and counts
the ends off their dependents' ``waiting_on`` under the dependents' row locks, so that two
dependencies ending at the same moment on different workers count down in turn, and exactly
one of them sees the count reach 0 and makes the dependent due (``process_at`` back from
``due_at``). A dependency that failed or was cancelled cancels a dependent whose
``on_dependency_failure`` is ``"cancel"``: it is archived as cancelled in the same transaction,
and its own dependents are settled in turn (the cascade). ``"run"`` counts it as any end.

An enqueue reads its dependencies' states without locks (it never waits for a running job),
so a dependency may end between that read and the enqueue's commit, settling without seeing
the new rows. Each worker's ``Sweeper`` looks for such rows (pending, their dependency gone
from the queue) every ``SWEEP_INTERVAL`` seconds and settles them as the end would have.

A ``wait_for_result`` caller's row (kind ``WAIT_KIND``) is deleted by the end it waits for,
which on PostgreSQL also NOTIFYs ``DONE_CHANNEL`` with the job id.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from sqlalchemy import Connection

from sqla_proletarian import statements as sql
from sqla_proletarian import wakeups
from sqla_proletarian.dialects import Dialect
from sqla_proletarian.errors import InvalidJobError
from sqla_proletarian.logs import log_event
from sqla_proletarian.models import WAIT_KIND, WAITING_AT
from sqla_proletarian.statements import workflows as wsql
from sqla_proletarian.wakeups import DONE_CHANNEL

__all__ = [
    "DONE_CHANNEL",
    "MAX_DEPENDENCIES",
    "SWEEP_INTERVAL",
    "WAIT_KIND",
    "OnDependencyFailure",
    "Sweeper",
    "check_depends_on",
    "settle",
]

#: What a dependent does when one of its dependencies fails or is cancelled.
OnDependencyFailure = Literal["cancel", "run"]
_POLICIES = ("cancel", "run")

#: The most dependencies one job may have.
MAX_DEPENDENCIES = 10_000
#: Ids per statement where a statement reads or settles many.
_CHUNK = 1_000
#: Seconds between a worker's looks for ends that no settle counted.
SWEEP_INTERVAL = 2.0


def check_depends_on(
    depends_on: Iterable[uuid.UUID | str] | None, on_dependency_failure: object
) -> list[uuid.UUID]:
    """The dependency ids as given (UUIDs or their text), each once, in order; a clear
    ``InvalidJobError`` for anything else."""
    if on_dependency_failure not in _POLICIES:
        raise InvalidJobError(
            "on_dependency_failure",
            f"{on_dependency_failure!r} is not one of 'cancel' (archive the job as cancelled "
            "when a dependency fails or is cancelled) or 'run' (run it anyway)",
        )
    if depends_on is None:
        return []
    if isinstance(depends_on, str | bytes | uuid.UUID) or not isinstance(depends_on, Iterable):
        raise InvalidJobError(
            "depends_on", f"give a list of job ids (uuid.UUID), not {depends_on!r}"
        )
    ids: dict[uuid.UUID, None] = {}
    for index, value in enumerate(depends_on):
        if isinstance(value, uuid.UUID):
            ids[value] = None
            continue
        try:
            ids[uuid.UUID(str(value))] = None
        except (ValueError, TypeError, AttributeError):
            raise InvalidJobError(
                "depends_on", f"item {index}, {value!r}, is not a job id (a uuid.UUID)"
            ) from None
    if len(ids) > MAX_DEPENDENCIES:
        raise InvalidJobError(
            "depends_on",
            f"{len(ids)} dependencies; a job may have {MAX_DEPENDENCIES:,} at most (make a "
            "join of joins: a few jobs that each depend on a part, and one that depends on them)",
        )
    return list(ids)


@dataclass
class Dependencies:
    """An enqueue's dependencies as it found them: those still in the queue, and the first
    that failed or was cancelled (with its status), if any."""

    ids: list[uuid.UUID]
    policy: str
    live: list[uuid.UUID] = field(default_factory=list)
    failed: tuple[uuid.UUID, str] | None = None

    @property
    def cancels(self) -> bool:
        """The dependent is cancelled at once: a dependency failed, and it does not run then."""
        return self.failed is not None and self.policy == "cancel"


def read_dependencies(
    conn: Connection, ids: list[uuid.UUID], policy: str, own: Sequence[uuid.UUID] = ()
) -> Dependencies:
    """Find every dependency in the queue or the archive; an unknown one (or one of the jobs
    being enqueued, ``own``) is refused with ``InvalidJobError`` naming it."""
    mine = set(own).intersection(ids)
    if mine:
        raise InvalidJobError("depends_on", f"job {next(iter(mine))} cannot depend on itself")
    found = Dependencies(ids, policy)
    live: set[uuid.UUID] = set()
    statuses: dict[uuid.UUID, str] = {}
    for start in range(0, len(ids), _CHUNK):
        chunk = ids[start : start + _CHUNK]
        live.update(conn.execute(*wsql.live_jobs(chunk)).scalars())
        rest = [job_id for job_id in chunk if job_id not in live]
        if rest:
            statuses.update((row[0], row[1]) for row in conn.execute(*wsql.ended_jobs(rest)))
    for job_id in ids:
        if job_id in live:
            found.live.append(job_id)
        elif job_id not in statuses:
            raise InvalidJobError(
                "depends_on",
                f"no job {job_id} is queued, running or archived (enqueue the dependency "
                "first, in this transaction or an earlier one); nothing was written",
            )
        elif statuses[job_id] != "success" and found.failed is None:
            found.failed = (job_id, statuses[job_id])
    return found


def _cancel_reason(dependency: uuid.UUID, status: str) -> str:
    ended = "failed" if status == "failure" else "was cancelled"
    return f"cancelled: its dependency {dependency} {ended}"


def make_waiting(row: dict[str, Any], dependencies: Dependencies) -> None:
    """Set a dependent's row to wait for its live dependencies (if it has any)."""
    waiting = len(dependencies.live)
    row["waiting_on"] = waiting or wsql.HAD_DEPENDENCIES
    if waiting:
        row["due_at"] = row["process_at"]
        row["process_at"] = WAITING_AT


def write_dependents(
    conn: Connection,
    rows: list[dict[str, Any]],
    dependencies: Dependencies,
    dialect: Dialect,
    *,
    inserted: bool = False,
) -> None:
    """Write enqueued dependents (rows made waiting by ``make_waiting``, unless ``inserted``
    already) and their edges; dependents whose dependency failed, with ``"cancel"``, go
    straight to the archive as cancelled."""
    if dependencies.cancels:
        assert dependencies.failed is not None
        reason = _cancel_reason(*dependencies.failed)
        for row in rows:
            job = {**row, "process_at": row.get("due_at") or row["process_at"]}
            conn.execute(
                *sql.archive(
                    job,
                    status="cancelled",
                    attempts=0,
                    finished_at=row["enqueued_at"],
                    error=reason,
                    upsert=dialect.archive_upsert,
                )
            )
            _log_cancelled(row, reason)
    elif not inserted:
        conn.execute(*wsql.insert_dependents(rows))
    live = set(dependencies.live) if not dependencies.cancels else set()
    edges = [
        {
            "job_id": row["job_id"],
            "depends_on": depends_on,
            "kind": dependencies.policy,
            "pending": depends_on in live,
        }
        for row in rows
        for depends_on in dependencies.ids
    ]
    for start in range(0, len(edges), _CHUNK * 10):
        conn.execute(*wsql.insert_dependencies(edges[start : start + _CHUNK * 10]))


def _log_cancelled(job: Mapping[str, Any], reason: str) -> None:
    log_event(
        logging.INFO,
        "job-cancelled",
        job_id=job["job_id"],
        job_type=job["job_type"],
        queue=job["queue"],
        hint=reason,
    )


def settle(
    conn: Connection, ended: Mapping[uuid.UUID, str], dialect: Dialect, now: datetime
) -> None:
    """Count the ends of ``ended`` (job id to archive status) in their dependents, in the
    transaction that archived them: dependents with nothing left to wait on become due;
    with ``"cancel"``, a failed or cancelled dependency cancels them, and so on down the
    graph. Their waiters' rows are deleted (and NOTIFYed on PostgreSQL)."""
    pending: dict[uuid.UUID, str] = dict(ended)
    woken: set[str] = set()
    while pending:
        edges = _pending_edges(conn, list(pending), dialect.settles_in_one)
        if not edges:
            break
        waits = [(job_id, on) for job_id, on, kind in edges if kind == WAIT_KIND]
        counted = [(job_id, on) for job_id, on, kind in edges if kind != WAIT_KIND]
        if waits:
            conn.execute(*wsql.drop_waits(waits))
            if dialect.notifies:
                for on in sorted({on for _, on in waits}):
                    conn.execute(*wsql.notify_done(on))
        if not counted:
            break
        if not dialect.settles_in_one:
            conn.execute(*wsql.settle_edges(counted))
        pending = _count_ends(conn, edges, pending, dialect, now, woken)
    if woken:
        if dialect.notifies:
            for queue in sorted(woken):
                conn.execute(*sql.notify_queue(queue))
        wakeups.enqueued(conn, woken)


def _pending_edges(
    conn: Connection, ended: list[uuid.UUID], settling: bool
) -> list[tuple[uuid.UUID, uuid.UUID, str]]:
    """The rows waiting for ``ended``, locked (``settling``: marked counted too, but for
    waiters' rows)."""
    read = wsql.settle_pending_on if settling else wsql.pending_on
    edges: list[tuple[uuid.UUID, uuid.UUID, str]] = []
    for start in range(0, len(ended), _CHUNK):
        chunk = ended[start : start + _CHUNK]
        edges.extend((row[0], row[1], row[2]) for row in conn.execute(*read(chunk)))
    return edges


def _count_ends(
    conn: Connection,
    edges: list[tuple[uuid.UUID, uuid.UUID, str]],
    ended: Mapping[uuid.UUID, str],
    dialect: Dialect,
    now: datetime,
    woken: set[str],
) -> dict[uuid.UUID, str]:
    """Count settled edges off their (locked) dependents; the dependents this cancelled."""
    by_dependent: dict[uuid.UUID, list[tuple[uuid.UUID, str]]] = {}
    for job_id, on, kind in edges:
        if kind != WAIT_KIND:
            by_dependent.setdefault(job_id, []).append((on, kind))
    cancelled: dict[uuid.UUID, str] = {}
    counts: dict[uuid.UUID, int] = {}
    released: dict[uuid.UUID, int] = {}
    dependents = sorted(by_dependent)
    for start in range(0, len(dependents), _CHUNK):
        chunk = dependents[start : start + _CHUNK]
        for job in conn.execute(*wsql.lock_dependents(chunk)).mappings():
            job_id = job["job_id"]
            its = by_dependent[job_id]
            failed = next(
                (
                    (on, ended[on])
                    for on, kind in its
                    if kind == "cancel" and ended[on] != "success"
                ),
                None,
            )
            if failed is not None:
                _cancel_dependent(conn, dict(job), failed, dialect, now)
                cancelled[job_id] = "cancelled"
                continue
            if job["waiting_on"] <= len(its):
                # Released at once: its count needs no counting down first.
                released[job_id] = len(its)
                woken.add(job["queue"])
            else:
                counts[job_id] = len(its)
    if counts:
        conn.execute(*wsql.count_down(counts))
    if released:
        conn.execute(*wsql.release(released))
    return cancelled


def _cancel_dependent(
    conn: Connection,
    job: dict[str, Any],
    failed: tuple[uuid.UUID, str],
    dialect: Dialect,
    now: datetime,
) -> None:
    """Archive a waiting dependent as cancelled: a dependency of it failed or was cancelled."""
    reason = _cancel_reason(*failed)
    conn.execute(*sql.delete_job(job["job_id"]))
    conn.execute(
        *sql.archive(
            job,
            status="cancelled",
            attempts=job["attempts"],
            finished_at=now,
            error=reason,
            upsert=dialect.archive_upsert,
        )
    )
    _log_cancelled(job, reason)


class Sweeper:
    """A worker's look, every ``SWEEP_INTERVAL`` seconds, for ended jobs whose dependents (or
    waiters) no settle counted: an enqueue that read its dependency as running, while that
    dependency's end was committing. It settles them as their end would have."""

    def __init__(self, dialect: Dialect, interval: float | None = None) -> None:
        self.dialect = dialect
        self.interval = SWEEP_INTERVAL if interval is None else interval
        self._next_look = time.monotonic() + self.interval / 2
        self._lock = threading.Lock()

    def tick(self, conn: Connection, now: Callable[[], datetime]) -> int:
        """Sweep if it is time and no other thread of the runner is sweeping; the ended jobs
        settled. ``conn`` is the thread's claim connection, outside a transaction; ``now``
        (the worker's clock) is read only for a sweep."""
        if time.monotonic() < self._next_look or not self._lock.acquire(blocking=False):
            return 0
        try:
            self._next_look = time.monotonic() + self.interval
            return self._sweep(conn, now())
        finally:
            self._lock.release()

    def _sweep(self, conn: Connection, now: datetime) -> int:
        # A read first, outside the claim's transaction form (SQLite's takes the write lock).
        try:
            found = list(conn.execute(*wsql.stranded()).scalars())
        finally:
            conn.rollback()
        if not found:
            return 0
        self.dialect.begin_claim(conn)
        try:
            statuses = {row[0]: row[1] for row in conn.execute(*wsql.ended_jobs(found))}
            live = set(conn.execute(*wsql.live_jobs(found)).scalars())
            # An archive row pruned away counts as cancelled: its result is gone.
            ended = {
                job_id: statuses.get(job_id, "cancelled") for job_id in found if job_id not in live
            }
            settle(conn, ended, self.dialect, now)
            conn.commit()
        except BaseException:
            conn.rollback()
            raise
        log_event(
            logging.INFO,
            "dependencies-swept",
            jobs=len(ended),
            hint="these jobs ended while a dependent of theirs was being enqueued; their "
            "dependents are counted now",
        )
        return len(ended)
