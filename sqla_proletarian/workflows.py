"""Workflows: jobs that run after other jobs, and the end of a job told to whoever waits.

A job enqueued with ``depends_on`` is written with one ``proletarian_dependency`` row per
dependency and ``waiting_on``, the number of them not ended at the enqueue (a row is
``pending`` until its dependency's end is counted). While ``waiting_on`` is above 0 the job
WAITS: its ``process_at`` is ``WAITING_AT``, which no poll reaches, and ``due_at`` holds its
own due time; the dependent made due has ``waiting_on`` ``HAD_DEPENDENCIES`` (-1).

Whatever ends a job (a success, a failure, a cancel, in either mode) calls ``settle`` in the
same transaction. It locks the rows pending on the ended jobs and marks them counted: a row
of its own, which no other end touches, so that the parts of a fan-in ending at the same
moment on different workers do not wait for one another. Then, per dependent, it reads the
dependent's other pending rows with ``FOR SHARE SKIP LOCKED``:

- one that no transaction holds: that dependency has not ended, and its end (which waits
  for this commit, should it come now, as the row read is share-locked) comes later and sees
  this one counted: the dependent is not touched;
- none at all: this end is the last; it locks the dependent and makes it due (``process_at``
  back from ``due_at``);
- only rows held by other ends, not committed yet: which end is the last shows only after
  the commits. Its rows are set pending again and the end is counted after this commit
  (``count_later``, a ``Sweeper.tick``): a transaction that locks the dependent's pending
  rows in key order, which waits for those ends, marks the ended ones counted, and makes the
  dependent due if none is left. Of ends committing together, such counts take turns on
  the rows, so the dependent is made due exactly once.

A dependency that failed or was cancelled cancels a dependent whose ``on_dependency_failure``
is ``"cancel"``: its end locks the dependent and archives it as cancelled in the same
transaction, and its own dependents are settled in turn (the cascade). ``"run"`` counts it
as any end.

An enqueue reads its dependencies' states without locks (it never waits for a running job),
so a dependency may end between that read and the enqueue's commit, settling without seeing
the new rows. Each worker's ``Sweeper`` looks for pending rows whose dependency is gone from
the queue every ``SWEEP_INTERVAL`` seconds (such an enqueue's, or an end left to count after
its commit by a worker that stopped before it did) and counts them as above.

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

from sqlalchemy import Connection, Engine, Executable

from sqla_proletarian import direct, wakeups
from sqla_proletarian import statements as sql
from sqla_proletarian.dialects import Dialect, dialect_of
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
    "count_later",
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
    transaction that archived them: a dependent whose dependencies have all ended becomes
    due; with ``"cancel"``, a failed or cancelled dependency cancels it, and so on down the
    graph. Their waiters' rows are deleted (and NOTIFYed on PostgreSQL). An end that other
    ends of the same dependent are being counted with, uncommitted, is counted after this
    transaction's commit, by the worker's ``Sweeper``."""
    later = _settle(conn, ended, dialect, now)
    if later:
        _count_later(conn, later)


def _settle(
    conn: Connection, ended: Mapping[uuid.UUID, str], dialect: Dialect, now: datetime
) -> list[uuid.UUID]:
    """``settle``; the ends left to count after the commit."""
    pending: dict[uuid.UUID, str] = dict(ended)
    woken: set[str] = set()
    later: list[uuid.UUID] = []
    while pending:
        edges, unlocked = _pending_edges(conn, list(pending), dialect.settles_in_one)
        if not edges:
            break
        _drop_waits(
            conn, [(job_id, on) for job_id, on, kind in edges if kind == WAIT_KIND], dialect
        )
        counted = [(job_id, on) for job_id, on, kind in edges if kind != WAIT_KIND]
        if not counted:
            break
        if not dialect.settles_in_one:
            _run(conn, wsql.settle_edges(counted))
        by_dependent = _by_dependent(edges)
        cancels = _cancels(by_dependent, pending)
        releases: list[uuid.UUID] = []
        uncounted: list[tuple[uuid.UUID, uuid.UUID]] = []
        for job_id in sorted(by_dependent.keys() - cancels.keys()):
            if unlocked is not None and job_id in unlocked:
                continue  # a dependency that has not ended: its end counts this one's
            if _unlocked_pending(conn, job_id, by_dependent[job_id][0][0], unlocked is None):
                continue
            if not _run(conn, wsql.any_pending_of(job_id)).rows:
                releases.append(job_id)  # the last end
                continue
            # Every other pending row is being counted by an end not committed yet: which of
            # them is the last shows after the commits. This one's row stays pending, and
            # its end is counted after this commit (or by a sweep, should that be lost).
            uncounted.extend((job_id, on) for on, _ in by_dependent[job_id])
        if uncounted:
            _run(conn, wsql.unsettle_edges(uncounted))
            later.extend({on: None for _, on in uncounted})
        pending = _end_dependents(conn, cancels, releases, dialect, now, woken)
    _wake(conn, woken, dialect)
    return later


def _run(conn: Connection, statement: tuple[Executable, Any]) -> direct.Rows:
    """A statement of the settle, on the hot path (``direct``): an executemany of one row as
    one statement."""
    executable, params = statement
    if isinstance(params, list) and len(params) == 1:
        params = params[0]
    return direct.execute(conn, executable, params)


def _unlocked_pending(conn: Connection, job_id: uuid.UUID, own: uuid.UUID, after_too: bool) -> bool:
    """Whether the dependent has a row still pending that no transaction holds (read after
    the row of ``own``, unless read already, then before it), share-locked."""
    return any(
        _run(conn, wsql.unlocked_pending_of(job_id, own, after=after)).rows
        for after in ((True, False) if after_too else (False,))
    )


def _pending_edges(
    conn: Connection, ended: list[uuid.UUID], settling: bool
) -> tuple[list[tuple[uuid.UUID, uuid.UUID, str]], set[uuid.UUID] | None]:
    """The rows waiting for ``ended``, locked (``settling``: marked counted too, but for
    waiters' rows, and the dependents found to have a row pending after one of them that
    no transaction holds; else None)."""
    read = wsql.settle_pending_on if settling else wsql.pending_on
    edges: list[tuple[uuid.UUID, uuid.UUID, str]] = []
    unlocked: set[uuid.UUID] | None = set() if settling else None
    for start in range(0, len(ended), _CHUNK):
        chunk = ended[start : start + _CHUNK]
        for row in _run(conn, read(chunk)):
            edges.append((row[0], row[1], row[2]))
            if unlocked is not None and row[3] is not None:
                unlocked.add(row[0])
    return edges, unlocked


def _drop_waits(
    conn: Connection, waits: list[tuple[uuid.UUID, uuid.UUID]], dialect: Dialect
) -> None:
    """Delete the waiters' rows of ended jobs, and wake the waiters (PostgreSQL)."""
    if not waits:
        return
    _run(conn, wsql.drop_waits(waits))
    if dialect.notifies:
        for on in sorted({on for _, on in waits}):
            _run(conn, wsql.notify_done(on))


def _wake(conn: Connection, woken: set[str], dialect: Dialect) -> None:
    """Wake the workers of the queues where dependents became due."""
    if woken:
        if dialect.notifies:
            for queue in sorted(woken):
                _run(conn, sql.notify_queue(queue))
        wakeups.enqueued(conn, woken)


def _by_dependent(
    edges: Iterable[tuple[uuid.UUID, uuid.UUID, str]],
) -> dict[uuid.UUID, list[tuple[uuid.UUID, str]]]:
    """The ended dependencies and their kinds, per dependent (waiters' rows left out)."""
    by_dependent: dict[uuid.UUID, list[tuple[uuid.UUID, str]]] = {}
    for job_id, on, kind in edges:
        if kind != WAIT_KIND:
            by_dependent.setdefault(job_id, []).append((on, kind))
    return by_dependent


def _cancels(
    by_dependent: Mapping[uuid.UUID, list[tuple[uuid.UUID, str]]], ended: Mapping[uuid.UUID, str]
) -> dict[uuid.UUID, tuple[uuid.UUID, str]]:
    """The dependents that an ended dependency cancels (``"cancel"``, and it did not
    succeed), each with the first such dependency and its status."""
    cancels: dict[uuid.UUID, tuple[uuid.UUID, str]] = {}
    for job_id, its in by_dependent.items():
        for on, kind in its:
            if kind == "cancel" and ended[on] != "success":
                cancels[job_id] = (on, ended[on])
                break
    return cancels


def _end_dependents(
    conn: Connection,
    cancels: Mapping[uuid.UUID, tuple[uuid.UUID, str]],
    releases: list[uuid.UUID],
    dialect: Dialect,
    now: datetime,
    woken: set[str],
) -> dict[uuid.UUID, str]:
    """Lock the dependents to cancel or release (those still waiting), in id order, and do
    so; the dependents this cancelled."""
    cancelled: dict[uuid.UUID, str] = {}
    released: list[uuid.UUID] = []
    dependents = sorted({*cancels, *releases})
    for start in range(0, len(dependents), _CHUNK):
        chunk = dependents[start : start + _CHUNK]
        for job in _run(conn, wsql.lock_dependents(chunk)).mappings():
            job_id = job["job_id"]
            if job_id in cancels:
                _cancel_dependent(conn, dict(job), cancels[job_id], dialect, now)
                cancelled[job_id] = "cancelled"
            else:
                released.append(job_id)
                woken.add(job["queue"])
    if released:
        _run(conn, wsql.release(released))
    return cancelled


def _settle_late(
    conn: Connection, found: list[uuid.UUID], dialect: Dialect, now: datetime
) -> dict[uuid.UUID, str]:
    """Count the ends of ``found``, jobs whose rows in their dependents are still pending
    after their end may have committed (an end counted after its commit, an end that a
    dependent's enqueue did not see): lock each dependent's pending rows in key order,
    which waits for the ends marking them, then count those of ``found`` that have ended
    (are no longer queued) as ``settle`` does. A dependent with no other row pending is
    released. The ends counted (a row of theirs settled), with their status."""
    edges: list[tuple[uuid.UUID, uuid.UUID, str]] = []
    for start in range(0, len(found), _CHUNK):
        chunk = found[start : start + _CHUNK]
        edges.extend((row[0], row[1], row[2]) for row in conn.execute(*wsql.waiting_on(chunk)))
    held = {
        job_id: set(conn.execute(*wsql.lock_pending_of(job_id)).scalars())
        for job_id in sorted({job_id for job_id, _, kind in edges if kind != WAIT_KIND})
    }
    # Read after the locks: an end that was committing is seen.
    live = set(conn.execute(*wsql.live_jobs(found)).scalars())
    rest = [job_id for job_id in found if job_id not in live]
    statuses = {row[0]: row[1] for row in conn.execute(*wsql.ended_jobs(rest))} if rest else {}
    # An archive row pruned away counts as cancelled: its result is gone.
    ended = {job_id: statuses.get(job_id, "cancelled") for job_id in rest}
    waits = [(job_id, on) for job_id, on, kind in edges if kind == WAIT_KIND and on in ended]
    _drop_waits(conn, waits, dialect)
    counted = [
        (job_id, on, kind)
        for job_id, on, kind in edges
        if kind != WAIT_KIND and on in ended and on in held[job_id]
    ]
    settled = {on: ended[on] for _, on in waits} | {on: ended[on] for _, on, _ in counted}
    if not counted:
        return settled
    conn.execute(*wsql.settle_edges([(job_id, on) for job_id, on, _ in counted]))
    by_dependent = _by_dependent(counted)
    cancels = _cancels(by_dependent, ended)
    releases = [
        job_id
        for job_id, its in by_dependent.items()
        if job_id not in cancels and not held[job_id] - {on for on, _ in its}
    ]
    woken: set[str] = set()
    cancelled = _end_dependents(conn, cancels, releases, dialect, now, woken)
    _wake(conn, woken, dialect)
    if cancelled:
        settle(conn, cancelled, dialect, now)
    return settled


#: Ends to count after their commit (see ``settle``), per database (an engine's URL): the
#: next ``Sweeper.tick`` of a worker on it counts them.
_LATER: dict[Any, dict[uuid.UUID, None]] = {}
_LATER_LOCK = threading.Lock()


def _count_later(conn: Connection, ended: Iterable[uuid.UUID]) -> None:
    with _LATER_LOCK:
        _LATER.setdefault(conn.engine.url, {}).update(dict.fromkeys(ended))


def _take_later(engine: Engine) -> list[uuid.UUID]:
    with _LATER_LOCK:
        return list(_LATER.pop(engine.url, None) or ())


def count_later(engine: Engine, now: Callable[[], datetime]) -> int:
    """Count the ends that ``settle`` left to count after their commit on ``engine``'s
    database, if any, on a claim connection of its own: ``process_next_job``, which runs
    no ``Sweeper``, calls it after each job. The ended jobs counted."""
    later = _take_later(engine)
    if not later:
        return 0
    dialect = dialect_of(engine)
    with dialect.claim_connection(engine) as conn:
        return len(_count_apart(conn, later, dialect, now()))


def _count_apart(
    conn: Connection, found: list[uuid.UUID], dialect: Dialect, now: datetime
) -> dict[uuid.UUID, str]:
    """``_settle_late`` in a claim transaction of its own; on an error, ``found`` is left
    for the next count (and the sweep)."""
    dialect.begin_claim(conn)
    try:
        ended = _settle_late(conn, found, dialect, now)
        conn.commit()
    except BaseException:
        conn.rollback()
        _count_later(conn, found)
        raise
    return ended


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
    """A worker's count of ends that no settle counted in their transaction: at each tick,
    those of its own ends that ``settle`` left to count after their commit; every
    ``SWEEP_INTERVAL`` seconds, a look for any such end in the database (an enqueue that
    read its dependency as running while that dependency's end was committing, an end left
    to count by a worker that stopped before it did). It counts them as their end would
    have."""

    def __init__(self, dialect: Dialect, interval: float | None = None) -> None:
        self.dialect = dialect
        self.interval = SWEEP_INTERVAL if interval is None else interval
        self._next_look = time.monotonic() + self.interval / 2
        self._lock = threading.Lock()

    def tick(self, conn: Connection, now: Callable[[], datetime]) -> int:
        """Count the ends left to count after their commit, if any; sweep if it is time and
        no other thread of the runner is sweeping. The ended jobs counted. ``conn`` is the
        thread's claim connection, outside a transaction; ``now`` (the worker's clock) is
        read only when there is something to count."""
        later = _take_later(conn.engine)
        counted = len(_count_apart(conn, later, self.dialect, now())) if later else 0
        if time.monotonic() < self._next_look or not self._lock.acquire(blocking=False):
            return counted
        try:
            self._next_look = time.monotonic() + self.interval
            return counted + self._sweep(conn, now())
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
        ended = _count_apart(conn, found, self.dialect, now)
        if ended:
            log_event(
                logging.INFO,
                "dependencies-swept",
                jobs=len(ended),
                hint="these jobs' ends were not counted in their dependents (a dependent "
                "enqueued while its dependency ended, or a worker that stopped before it "
                "counted an end); they are counted now",
            )
        return len(ended)
